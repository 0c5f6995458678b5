#!/usr/bin/env bash
# The one test command (make test): makes sure PostgreSQL and RabbitMQ are
# reachable, then runs every test with the race detector.
#   DATABASE_URL set: tests use that database; else each test binary starts a
#                     throwaway PostgreSQL cluster (internal/pgtemp).
#   AMQP_URL set:     tests use that broker; else a throwaway RabbitMQ node is
#                     started here and stopped on exit.
#   Apache Kafka:     ensure-deps.sh fetches the pinned release once into the
#                     cache (scripts/kafka.sh); each test binary that needs a
#                     real broker starts its own (internal/kafkatemp), because
#                     the tests kill and restart brokers.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/ensure-deps.sh

if [ -z "${AMQP_URL:-}" ] && [ -x scripts/rabbitmq.sh ]; then
  rabbit_dir=$(mktemp -d /tmp/once-rabbit-XXXXXX)
  trap 'scripts/rabbitmq.sh stop "$rabbit_dir"' EXIT
  eval "$(scripts/rabbitmq.sh start "$rabbit_dir")"
fi

# Tests that need a server fail instead of skipping when it is missing.
export ONCE_REQUIRE_SERVERS=1
# Every module of the workspace (go.work): the library, and the command,
# the examples and the benchmark, which live in modules of their own so that
# their dependencies stay out of a service's module graph. ./... from the
# root does not reach into them.
for module in $(go work edit -json | sed -n 's/.*"DiskPath": "\(.*\)".*/\1/p'); do
  (cd "$module" && go test -race -count=1 -timeout 15m ${GOTESTFLAGS:-} ./...)
done
# The chaos build: crash points that kill the process at each step of a
# message's way (compiled out of every other build).
go test -race -count=1 -timeout 5m -tags chaos -run 'CrashPoint' ${GOTESTFLAGS:-} ./consumer/
