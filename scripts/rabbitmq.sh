#!/usr/bin/env bash
# Starts or stops a throwaway RabbitMQ node for the tests.
#
#   scripts/rabbitmq.sh start DIR   start a node whose every file lives under
#                                   DIR, wait until it accepts AMQP
#                                   connections, then print on stdout:
#                                     export AMQP_URL=amqp://guest:guest@127.0.0.1:PORT/
#                                     export ONCE_RABBITMQ_DIR=DIR
#                                     export ONCE_RABBITMQ_NODE=NODE
#   scripts/rabbitmq.sh stop DIR    stop that node (and epmd, if start
#                                   started it) and remove DIR.
#
# The node listens on free loopback ports only (AMQP and Erlang
# distribution), has a unique node name and no plugins, so it never collides
# with a system node. Logs go to stderr and DIR/log. Works as root: HOME is
# DIR, where the Erlang cookie lives. To drive the node with rabbitmqctl:
#   HOME=$ONCE_RABBITMQ_DIR rabbitmqctl -n $ONCE_RABBITMQ_NODE stop_app
set -euo pipefail

log() { echo "rabbitmq.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# The Debian wrappers in /usr/sbin switch to the rabbitmq user when run as
# root; the real scripts do not.
bindir=/usr/lib/rabbitmq/bin
[ -x "$bindir/rabbitmq-server" ] || bindir=$(dirname "$(command -v rabbitmq-server || echo /usr/sbin/rabbitmq-server)")

port_in_use() {
  ss -Htan "( sport = :$1 )" 2>/dev/null | grep -q .
}

# free_port LO HI: a random port in [LO, HI) that nothing listens on or uses,
# outside the CLI tools' distribution range 35672-35682.
free_port() {
  local lo=$1 hi=$2 p i
  for i in $(seq 1 200); do
    p=$((lo + RANDOM % (hi - lo)))
    if [ "$p" -ge 35672 ] && [ "$p" -le 35682 ]; then continue; fi
    if ! port_in_use "$p"; then echo "$p"; return 0; fi
  done
  return 1
}

# env_for DIR: the environment of every RabbitMQ command for the node in DIR.
env_for() {
  local dir=$1
  # shellcheck disable=SC1091
  . "$dir/node.env"
  export HOME="$dir"
  export RABBITMQ_NODENAME="$NODE"
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_PORT="$AMQP_PORT"
  export RABBITMQ_DIST_PORT="$DIST_PORT"
  export RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf"
  export RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf"
  export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
  export RABBITMQ_MNESIA_BASE="$dir/mnesia"
  export RABBITMQ_MNESIA_DIR="$dir/mnesia/$NODE"
  export RABBITMQ_PLUGINS_EXPAND_DIR="$dir/mnesia/$NODE-plugins-expand"
  export RABBITMQ_FEATURE_FLAGS_FILE="$dir/mnesia/$NODE-feature_flags"
  export RABBITMQ_LOG_BASE="$dir/log"
  export RABBITMQ_LOGS="$dir/log/$NODE.log"
  export RABBITMQ_PID_FILE="$dir/$NODE.pid"
}

start() {
  local dir=$1
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ -e "$dir/node.env" ] && die "$dir already holds a node; stop it first"
  mkdir -p "$dir/mnesia" "$dir/log"

  local amqp_port dist_port node
  amqp_port=$(free_port 20000 30000) || die "no free port for AMQP"
  dist_port=$(free_port 40000 50000) || die "no free port for distribution"
  [ "$dist_port" != "$amqp_port" ] || die "port clash, try again"
  node="once-$(date +%s)-$$-$RANDOM@localhost"
  cat >"$dir/node.env" <<EOF
NODE=$node
AMQP_PORT=$amqp_port
DIST_PORT=$dist_port
EOF
  : >"$dir/rabbitmq-env.conf"
  echo '[].' >"$dir/enabled_plugins"
  echo '[].' >"$dir/advanced.config"
  cat >"$dir/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$amqp_port
distribution.listener.interface = 127.0.0.1
distribution.listener.port_range.min = $dist_port
distribution.listener.port_range.max = $dist_port
log.file.level = info
log.console = false
EOF
  head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/.erlang.cookie"
  chmod 400 "$dir/.erlang.cookie"

  # epmd: use a running one; otherwise start one and remember its pid, so
  # that stop ends only what start began.
  if ! epmd -names >/dev/null 2>&1; then
    setsid epmd >"$dir/log/epmd.log" 2>&1 </dev/null &
    echo $! >"$dir/epmd.pid"
    local i
    for i in $(seq 1 50); do
      epmd -names >/dev/null 2>&1 && break
      sleep 0.1
    done
    epmd -names >/dev/null 2>&1 || die "epmd did not start"
    log "started epmd (pid $(cat "$dir/epmd.pid"))"
  fi

  (
    env_for "$dir"
    log "starting $node: AMQP 127.0.0.1:$amqp_port, distribution $dist_port, files in $dir"
    setsid "$bindir/rabbitmq-server" >"$dir/log/server.out" 2>&1 </dev/null &
    echo $! >"$dir/server.sh.pid"
  )

  # Wait for the node: await_startup fails with 69 until the node registered
  # with epmd, so retry it within an overall deadline.
  local deadline=$((SECONDS + 90)) ok=""
  while [ $SECONDS -lt $deadline ]; do
    if ! kill -0 "$(cat "$dir/server.sh.pid")" 2>/dev/null; then
      tail -n 30 "$dir/log/server.out" >&2 || true
      die "rabbitmq-server exited during startup; see $dir/log"
    fi
    if (env_for "$dir" && timeout 30 "$bindir/rabbitmqctl" -n "$node" await_startup --timeout 25) >>"$dir/log/await.out" 2>&1; then
      ok=1
      break
    fi
    sleep 0.5
  done
  [ -n "$ok" ] || { tail -n 30 "$dir/log/server.out" >&2 || true; die "node $node did not start within 90s; see $dir/log"; }

  ok=""
  while [ $SECONDS -lt $deadline ]; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$amqp_port") 2>/dev/null; then ok=1; break; fi
    sleep 0.2
  done
  [ -n "$ok" ] || die "node $node runs but 127.0.0.1:$amqp_port does not accept connections"
  log "node $node is ready"

  echo "export AMQP_URL=amqp://guest:guest@127.0.0.1:$amqp_port/"
  echo "export ONCE_RABBITMQ_DIR=$dir"
  echo "export ONCE_RABBITMQ_NODE=$node"
}

stop() {
  local dir=$1
  [ -d "$dir" ] || { log "$dir does not exist"; return 0; }
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/node.env" ]; then
    (
      env_for "$dir"
      log "stopping $NODE"
      timeout 60 "$bindir/rabbitmqctl" -n "$NODE" stop "$RABBITMQ_PID_FILE" >>"$dir/log/stop.out" 2>&1 || log "rabbitmqctl stop failed; killing the node"
      if [ -f "$RABBITMQ_PID_FILE" ]; then
        pid=$(cat "$RABBITMQ_PID_FILE")
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
          kill "$pid" 2>/dev/null || true
          for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
          kill -9 "$pid" 2>/dev/null || true
        fi
      fi
    )
    if [ -f "$dir/server.sh.pid" ]; then
      local spid
      spid=$(cat "$dir/server.sh.pid")
      kill "$spid" 2>/dev/null || true
    fi
  fi
  if [ -f "$dir/epmd.pid" ]; then
    local epid
    epid=$(cat "$dir/epmd.pid")
    # Leave epmd running if another node still uses it.
    if epmd -names 2>/dev/null | grep -q '^name '; then
      log "epmd (pid $epid) still serves other nodes; leaving it running"
    else
      kill "$epid" 2>/dev/null || true
      log "stopped epmd (pid $epid)"
    fi
  fi
  rm -rf "$dir"
}

case "${1:-}" in
  start) [ $# -eq 2 ] || die "usage: $0 start DIR"; start "$2" ;;
  stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 start|stop DIR" ;;
esac
