#!/usr/bin/env bash
# Checks what a service's module graph gets from this library: a throwaway
# module that imports only consumer and brokers/kafka must not pull in the
# Prometheus client, an OpenTelemetry exporter or the browser driver of the
# command's tests. (The OpenTelemetry SDK is listed there only because the
# library's own tests read spans and metrics back with it: module graph
# pruning keeps test-only requirements in the list, but no package a service
# builds imports it.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d /tmp/once-modgraph-XXXXXX)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/go.mod" <<MOD
module example.com/service

go 1.26.0

require github.com/onceco/once v0.0.0

replace github.com/onceco/once => $root
MOD
cat > "$dir/main.go" <<'SRC'
package main

import (
	_ "github.com/onceco/once/brokers/kafka"
	_ "github.com/onceco/once/consumer"
)

func main() {}
SRC
cd "$dir"
GOWORK=off GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1
bad=$(GOWORK=off go list -m all | grep -E 'prometheus|otel/exporters|chromedp' || true)
if [ -n "$bad" ]; then
  echo "check-module-graph: a service importing consumer and brokers/kafka gets:"
  echo "$bad"
  exit 1
fi
built=$(GOWORK=off go list -deps . | grep -E 'go.opentelemetry.io/otel/sdk|prometheus' || true)
if [ -n "$built" ]; then
  echo "check-module-graph: a service importing consumer and brokers/kafka builds:"
  echo "$built"
  exit 1
fi
echo "check-module-graph: ok ($(GOWORK=off go list -m all | wc -l) modules, no exporter, Prometheus client or SDK built)"
