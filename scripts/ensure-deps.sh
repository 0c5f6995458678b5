#!/usr/bin/env bash
# Installs, from Debian's packages, what the tests and the demo need when it
# is missing. With no argument: everything. Arguments pick parts:
#   postgres  PostgreSQL's server binaries (initdb, pg_ctl, postgres)
#   rabbitmq  the RabbitMQ server
#   tools     amqp-tools and kcat: a publisher and a Kafka client not ours
#   chromium  headless Chromium, for the web console's browser tests and
#             `make screenshots` (cmd/once)
#   kafka     Java 17 and Maven, then the pinned Apache Kafka release fetched
#             into the cache by scripts/kafka.sh (internal/kafkatemp runs it)
set -euo pipefail

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(postgres rabbitmq tools chromium kafka)

need=()
for part in "${parts[@]}"; do
  case "$part" in
    postgres)
      ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || need+=(postgresql) ;;
    rabbitmq)
      command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || need+=(rabbitmq-server) ;;
    tools)
      command -v amqp-publish >/dev/null 2>&1 || need+=(amqp-tools)
      command -v kcat >/dev/null 2>&1 || need+=(kcat) ;;
    chromium)
      command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || need+=(chromium) ;;
    kafka)
      command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
      command -v mvn >/dev/null 2>&1 || need+=(maven)
      fetch_kafka=1 ;;
    *) echo "ensure-deps: unknown part $part" >&2; exit 2 ;;
  esac
done

fetch_kafka() {
  if [ -n "${fetch_kafka:-}" ]; then
    "$(dirname "$0")/kafka.sh" fetch >/dev/null
  fi
}

[ ${#need[@]} -eq 0 ] && { fetch_kafka; exit 0; }
echo "ensure-deps: installing ${need[*]} from Debian's packages" >&2
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fetch_kafka
