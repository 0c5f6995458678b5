#!/usr/bin/env bash
# Fetches a pinned Apache Kafka release (the broker's jars, KRaft mode, no
# ZooKeeper) from Maven Central with the machine's Maven, and caches it.
#
#   scripts/kafka.sh fetch     download the release unless it is cached, then
#                              print the directory of its jars on stdout
#   scripts/kafka.sh libs      print that directory if the release is cached;
#                              exit 1 (printing nothing) if it is not
#   scripts/kafka.sh version   print the pinned release
#
# The cache lives in $ONCE_CACHE_DIR (default ~/.cache/once): kafka-VERSION/
# holds the jars (libs/) and Maven's own repository (m2/), so a second run
# downloads nothing and ~/.m2 is left alone. internal/kafkatemp starts
# throwaway brokers from libs/ (ONCE_KAFKA_LIBS overrides where it looks).
# KAFKA_VERSION overrides the pinned release (4.x needs Java 17).
set -euo pipefail

version=${KAFKA_VERSION:-4.1.1}
cache=${ONCE_CACHE_DIR:-${HOME}/.cache/once}/kafka-$version
libs=$cache/libs

log() { echo "kafka.sh: $*" >&2; }
die() { log "$*"; exit 1; }

fetch() {
  if [ -f "$libs/.complete" ]; then
    echo "$libs"
    return 0
  fi
  command -v mvn >/dev/null 2>&1 || die "Maven (mvn) is missing: apt-get install maven, or scripts/ensure-deps.sh kafka"
  command -v java >/dev/null 2>&1 || die "Java is missing: apt-get install openjdk-17-jre-headless, or scripts/ensure-deps.sh kafka"
  mkdir -p "$cache"
  local work
  work=$(mktemp -d "$cache/fetch-XXXXXX")
  # The broker (kafka_2.13) pulls the server, metadata, raft, storage and
  # clients modules; the slf4j binding and log4j let the broker log to a file.
  cat >"$work/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>co.once</groupId>
  <artifactId>kafka-broker-fetch</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$version</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>2.24.3</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>2.24.3</version>
    </dependency>
  </dependencies>
</project>
EOF
  log "fetching Apache Kafka $version from Maven Central into $cache (once; later runs use the cache)"
  local start=$SECONDS
  if ! mvn -B -q -f "$work/pom.xml" -Dmaven.repo.local="$cache/m2" \
      org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$work/libs" >"$work/mvn.log" 2>&1; then
    tail -n 40 "$work/mvn.log" >&2
    rm -rf "$work"
    die "could not fetch Apache Kafka $version with Maven"
  fi
  rm -rf "$libs"
  mv "$work/libs" "$libs"
  rm -rf "$work"
  touch "$libs/.complete"
  log "Apache Kafka $version fetched in $((SECONDS - start))s: $(ls "$libs" | wc -l) jars"
  echo "$libs"
}

case "${1:-}" in
  fetch) fetch ;;
  libs) [ -f "$libs/.complete" ] || exit 1; echo "$libs" ;;
  version) echo "$version" ;;
  *) die "usage: $0 fetch|libs|version" ;;
esac
