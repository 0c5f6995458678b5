#!/usr/bin/env bash
# make lint: gofmt, go vet and golangci-lint (the version pinned below, with
# .golangci.yml) over every module of the workspace, the module-graph check,
# and, once a release is tagged, gorelease against it (the exported API may
# change only as semantic versioning allows).
set -euo pipefail
cd "$(dirname "$0")/.."

GOLANGCI_LINT=github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0
GORELEASE=golang.org/x/exp/cmd/gorelease@v0.0.0-20261113113407-e3970619a1a4

unformatted=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$unformatted" ]; then
  echo "gofmt would change:"; echo "$unformatted"; exit 1
fi

# go run builds the pinned linter once; later runs take it from the build cache.
lint=$(mktemp -d /tmp/once-lint-XXXXXX)
trap 'rm -rf "$lint"' EXIT
GOFLAGS= GOBIN="$lint" go install "$GOLANGCI_LINT"

config=$(pwd)/.golangci.yml
for module in $(go work edit -json | sed -n 's/.*"DiskPath": "\(.*\)".*/\1/p'); do
  echo "lint $module"
  (cd "$module" && go vet ./... && "$lint/golangci-lint" run --config "$config" ./...)
done

scripts/check-module-graph.sh

base=$(git describe --tags --abbrev=0 2>/dev/null || true)
if [ -n "$base" ]; then
  echo "gorelease against $base"
  GOWORK=off GOFLAGS= go run "$GORELEASE" -base="$base"
else
  echo "gorelease: no release tagged yet, nothing to compare the API with"
fi
