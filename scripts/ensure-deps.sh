#!/usr/bin/env bash
# Installs, from Debian's packages, the servers and tools the tests need when
# they are missing: PostgreSQL's server binaries, RabbitMQ, amqp-tools (a
# publisher that is not ours) and kcat (a Kafka client that is not ours).
set -euo pipefail

need=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || need+=(postgresql)
command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || need+=(rabbitmq-server)
command -v amqp-publish >/dev/null 2>&1 || need+=(amqp-tools)
command -v kcat >/dev/null 2>&1 || need+=(kcat)

[ ${#need[@]} -eq 0 ] && exit 0
echo "ensure-deps: installing ${need[*]}" >&2
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
