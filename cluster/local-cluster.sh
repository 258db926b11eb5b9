#!/usr/bin/env bash
# A Ray cluster of one head plus N "RAM nodes" (raylets offering the custom resource
# megatrain_ram) on THIS machine, to try the multi-node path of megatrain-ray without a cluster.
# Every node's IP is 127.0.0.1 (Ray's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps a loopback
# node IP), and so every server listens on 127.0.0.1 only (measured with `ss -ltnp`, Ray 2.60):
# the GCS, the raylets and object managers, the workers' and drivers' gRPC servers, the dashboard
# and its agents, the runtime-env agents, the metrics exporters and the Ray client server. Drivers
# join with that setting too (cluster.env has it). Every port is picked free at start, so it does not
# collide with another Ray instance on the machine (nor with the default 6379/8265/10001). The
# RAM nodes start through cluster/loopback_node.py: `ray start` refuses a joining node under that
# setting.
#
#   cluster/local-cluster.sh start [N] [--num-cpus C] [--ram-node-cpus C] [--num-gpus G]
#                                      [--memory-per-node BYTES] [--object-store-memory BYTES]
#   cluster/local-cluster.sh status
#   cluster/local-cluster.sh stop [--keep-logs]
#
#   N                       RAM nodes besides the head (default 2)
#   --num-cpus C            CPUs the head offers (default: all cores)
#   --ram-node-cpus C       CPUs each RAM node offers (default 1: a store actor needs one)
#   --num-gpus G            GPUs the head offers (default: what Ray detects); RAM nodes get 0,
#                           so the GPU actor always lands on the head
#   --memory-per-node BYTES Ray's logical `memory` resource of each node (default: Ray's own)
#   --object-store-memory BYTES
#                           plasma store size of each node (default: 30% of free /dev/shm split
#                           over the nodes, at most 2 GiB each, at least 100 MB)
#
# Environment: MEGATRAIN_CLUSTER_DIR (state, logs, Ray temp dirs, cluster.env; default
# /tmp/megatrain-cluster-$(id -un): one per user, made readable by that user only),
# RAY (the ray executable; default .venv/bin/ray of this checkout, else `ray` on PATH).
#
# Each node runs in a session of its own (the head as `ray start --block`, a RAM node as
# cluster/loopback_node.py); `stop` ends exactly those process groups (never `ray stop`, which would
# also stop any other Ray on the machine).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
state=${MEGATRAIN_CLUSTER_DIR:-/tmp/megatrain-cluster-$(id -un)}
if [[ -n ${RAY:-} ]]; then
  ray_bin=$RAY
elif [[ -x $repo/.venv/bin/ray ]]; then
  ray_bin=$repo/.venv/bin/ray
else
  ray_bin=$(command -v ray || true)
fi
[[ -n $ray_bin && -x $ray_bin ]] || { echo "error: no ray executable (set RAY=/path/to/ray)" >&2; exit 1; }
py_bin=$(dirname "$ray_bin")/python
# Ray job entrypoints (`ray job submit -- megatrain-ray train ...`) run with the nodes' PATH: put
# the environment that holds ray (and megatrain-ray) first.
export PATH="$(cd "$(dirname "$ray_bin")" && pwd):$PATH"
[[ -x $py_bin ]] || py_bin=$(command -v python3)
export RAY_USAGE_STATS_ENABLED=0
# Node IPs stay 127.0.0.1, and Ray's servers listen on it only (header).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Token authentication (Ray >= 2.52) is on: every node and every driver must agree on it, and Ray
# turns it on by itself only for some of them (a head started while ~/.ray/auth_token exists, not
# the nodes that join). The token is Ray's default one (~/.ray/auth_token, generated if missing),
# or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH when set. RAY_AUTH_MODE=disabled turns it off.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# `stop` sends SIGTERM; a node would then "drain" for up to 30 s. Nothing here needs that.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

die() { echo "error: $*" >&2; exit 1; }
usage() { sed -n '2,/^[^#]/{/^#/p}' "${BASH_SOURCE[0]}"; }
log() { echo "[local-cluster] $*"; }

# free_ports K: K distinct free TCP ports on 127.0.0.1, one per line (all held while choosing).
free_ports() {
  "$py_bin" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print("\n".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
EOF
}

pgid_alive() { kill -0 -- "-$1" 2>/dev/null; }

# ensure_token: with token authentication on, a token every node and driver reads, private to us.
ensure_token() {
  [[ $RAY_AUTH_MODE == token ]] || return 0
  "$py_bin" -c "import ray._private.authentication.authentication_token_setup" 2>/dev/null \
    || die "RAY_AUTH_MODE=token needs Ray >= 2.52 (token authentication); upgrade Ray or export RAY_AUTH_MODE=disabled"
  if [[ -z ${RAY_AUTH_TOKEN:-} && -z ${RAY_AUTH_TOKEN_PATH:-} ]]; then
    "$ray_bin" get-auth-token --generate >/dev/null 2>&1 || die "could not generate a token (ray get-auth-token --generate)"
    chmod 600 "$HOME/.ray/auth_token"
  fi
}

# dashboard_available: Ray's dashboard (and with it the job API of `ray job submit`) needs the
# packages of ray[default]; a plain `pip install ray` lacks them and the head would not start.
dashboard_available() { "$py_bin" -c "import ray.dashboard.optional_deps" 2>/dev/null; }

# Pids of processes (ours) whose command line names our state directory: stragglers that left
# their node's process group (Ray workers, agents).
stray_pids() {
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [[ $p == "$$" || $p == "$BASHPID" ]] && continue
    if { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -qF -- "$state/"; then
      echo "$p"
    fi
  done
}

running() {
  [[ -f $state/cluster.env && -f $state/n0.pgid ]] && pgid_alive "$(cat "$state/n0.pgid")"
}

# count_ram_nodes GCS_ADDRESS: "ALIVE_NODES RAM_NODES" as Ray's GCS sees them.
count_nodes() {
  RAY_ADDRESS=$1 "$py_bin" - <<'EOF' 2>/dev/null
import logging, os, ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.ERROR, log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
print(len(alive), sum(1 for n in alive if n["Resources"].get("megatrain_ram", 0) > 0))
ray.shutdown()
EOF
}

stop_cluster() {
  local keep_logs=${1:-0} f pgid i
  [[ -d $state ]] || { log "not running (no $state)"; return 0; }
  # RAM nodes first, the head last.
  for f in $(ls -r "$state"/n*.pgid 2>/dev/null); do
    pgid=$(cat "$f")
    if pgid_alive "$pgid"; then
      log "stopping $(basename "$f" .pgid) (process group $pgid)"
      kill -TERM -- "-$pgid" 2>/dev/null || true
    fi
  done
  for f in "$state"/n*.pgid; do
    [[ -f $f ]] || continue
    pgid=$(cat "$f")
    for i in $(seq 1 200); do pgid_alive "$pgid" || break; sleep 0.2; done
    if pgid_alive "$pgid"; then
      log "process group $pgid still alive after 40 s: SIGKILL"
      kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  local strays
  strays=$(stray_pids)
  if [[ -n $strays ]]; then
    log "ending stray processes: $(echo $strays)"
    for i in $strays; do kill -TERM "$i" 2>/dev/null || true; done
    sleep 2
    for i in $(stray_pids); do kill -KILL "$i" 2>/dev/null || true; done
  fi
  rm -f "$state/cluster.env"
  if [[ $keep_logs == 1 ]]; then
    log "stopped; logs kept in $state"
  else
    rm -rf "$state"
    log "stopped"
  fi
}

start_cluster() {
  local n=2 head_cpus ram_cpus=1 gpus="" mem="" osm=""
  head_cpus=$(nproc)
  while [[ $# -gt 0 ]]; do
    case $1 in
      --num-cpus) head_cpus=$2; shift 2 ;;
      --num-cpus=*) head_cpus=${1#*=}; shift ;;
      --ram-node-cpus) ram_cpus=$2; shift 2 ;;
      --ram-node-cpus=*) ram_cpus=${1#*=}; shift ;;
      --num-gpus) gpus=$2; shift 2 ;;
      --num-gpus=*) gpus=${1#*=}; shift ;;
      --memory-per-node) mem=$2; shift 2 ;;
      --memory-per-node=*) mem=${1#*=}; shift ;;
      --object-store-memory) osm=$2; shift 2 ;;
      --object-store-memory=*) osm=${1#*=}; shift ;;
      -h|--help) usage; exit 0 ;;
      [0-9]*) n=$1; shift ;;
      *) die "unknown argument: $1" ;;
    esac
  done
  [[ $n =~ ^[0-9]+$ ]] || die "N must be a number, got $n"
  for v in "$head_cpus" "$ram_cpus"; do [[ $v =~ ^[0-9]+$ ]] || die "CPU counts must be integers"; done
  [[ -z $mem || $mem =~ ^[0-9]+$ ]] || die "--memory-per-node takes bytes"
  [[ -z $osm || $osm =~ ^[0-9]+$ ]] || die "--object-store-memory takes bytes"

  if running; then
    die "a local cluster is already running (RAY_ADDRESS=$(grep ^RAY_ADDRESS= "$state/cluster.env" | cut -d= -f2)); run '$0 stop' first"
  fi
  [[ -d $state ]] && stop_cluster 0 >/dev/null
  mkdir -p -m 700 "$state"
  [[ -O $state ]] || die "$state belongs to another user: set MEGATRAIN_CLUSTER_DIR to a directory of yours"

  if [[ -z $osm ]]; then
    osm=$("$py_bin" -c "
import os
s = os.statvfs('/dev/shm'); free = s.f_bavail * s.f_frsize
print(int(max(100_000_000, min(2 << 30, 0.3 * free / ($n + 1)))))")
  fi

  # Ports: head GCS, dashboard, client server, then per node: node manager, object manager,
  # dashboard agent http + grpc, runtime-env agent, metrics.
  local ports
  mapfile -t ports < <(free_ports $((3 + 6 * (n + 1))))
  local gcs_port=${ports[0]} dash_port=${ports[1]} client_port=${ports[2]}
  local address=127.0.0.1:$gcs_port

  ensure_token
  local dashboard=1
  if ! dashboard_available; then
    dashboard=0
    log "no dashboard: Ray's dashboard packages are missing (pip install 'ray[default]' for them and for ray job submit)"
  fi

  trap 'echo "[local-cluster] start failed; cleaning up" >&2; stop_cluster 1 >&2; exit 1' ERR

  local i k args
  for i in $(seq 0 "$n"); do
    k=$((3 + 6 * i))
    if [[ $i == 0 ]]; then
      args=("$ray_bin" start --block --disable-usage-stats
            --node-ip-address=127.0.0.1
            --temp-dir="$state/n$i"
            --node-manager-port="${ports[k]}" --object-manager-port="${ports[k + 1]}"
            --dashboard-agent-listen-port="${ports[k + 2]}" --dashboard-agent-grpc-port="${ports[k + 3]}"
            --runtime-env-agent-port="${ports[k + 4]}" --metrics-export-port="${ports[k + 5]}"
            --object-store-memory="$osm")
      [[ -n $mem ]] && args+=(--memory="$mem")
      args+=(--head --port="$gcs_port" --num-cpus="$head_cpus" --ray-client-server-port="$client_port")
      if [[ $dashboard == 1 ]]; then
        args+=(--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$dash_port")
      else
        args+=(--include-dashboard=false)
      fi
      [[ -n $gpus ]] && args+=(--num-gpus="$gpus")
      log "head: $address, $head_cpus CPUs, object store $osm bytes"
    else
      args=("$py_bin" "$here/loopback_node.py" --address="$address" --temp-dir="$state/n$i"
            --num-cpus="$ram_cpus" --num-gpus=0 --resources='{"megatrain_ram": 1}' --object-store-memory="$osm"
            --ports "${ports[@]:k:6}")
      [[ -n $mem ]] && args+=(--memory="$mem")
      log "RAM node $i: $ram_cpus CPU, megatrain_ram=1"
    fi
    setsid "${args[@]}" >"$state/n$i.log" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$state/n$i.pgid"
    # Wait for this node's `ray start` to report it is up before adding the next one.
    local t
    for t in $(seq 1 300); do
      grep -q -- "--block" "$state/n$i.log" 2>/dev/null && break
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "---- $state/n$i.log" >&2; tail -40 "$state/n$i.log" >&2
        false
      fi
      sleep 0.2
    done
    if ! grep -q -- "--block" "$state/n$i.log"; then
      echo "---- $state/n$i.log" >&2; tail -40 "$state/n$i.log" >&2
      log "node $i did not come up within 60 s"
      false
    fi
  done

  # Every node registered with the GCS? (Each look is a driver's connection, about a second.)
  local counts="" until=$((SECONDS + 60))
  while true; do
    counts=$(count_nodes "$address" || true)
    [[ $counts == "$((n + 1)) $n" || $SECONDS -ge $until ]] && break
    sleep 0.2
  done
  if [[ $counts != "$((n + 1)) $n" ]]; then
    log "expected $((n + 1)) nodes ($n RAM nodes), Ray reports '${counts:-nothing}'"
    false
  fi
  # `ray status` (the autoscaler's view) lags the GCS by a few seconds: wait for it too, so that
  # what `status` prints right after `start` is complete.
  if [[ $n -gt 0 ]]; then
    until=$((SECONDS + 30))
    until "$ray_bin" status --address "$address" 2>/dev/null | grep -q "/$n.0 megatrain_ram" \
        || [[ $SECONDS -ge $until ]]; do
      sleep 0.2
    done
  fi
  trap - ERR

  local auth="" auth_state=OFF job dash=""
  if [[ $RAY_AUTH_MODE == token ]]; then
    auth="export RAY_AUTH_MODE=token   # token authentication: the drivers and job clients too"
    auth_state=on
  fi
  job="(no job API without Ray's dashboard: pip install 'ray[default]', then start again)"
  if [[ $dashboard == 1 ]]; then
    dash=http://127.0.0.1:$dash_port
    job="ray job submit --address $dash --working-dir . -- megatrain-ray train examples/tiny.yaml"
  fi
  cat >"$state/cluster.env" <<EOF
RAY_ADDRESS=$address
RAY_DASHBOARD=$dash
RAY_AUTH_MODE=$RAY_AUTH_MODE
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
RAM_NODES=$n
EOF
  cat <<EOF

Local Ray cluster up: head + $n RAM nodes, listening on 127.0.0.1 only, token authentication $auth_state.
Settings: $state/cluster.env; logs: $state/n*.log, $state/n*/session_latest/logs

  # drive it from this machine:
  $auth
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # a driver's node IP is 127.0.0.1, as the nodes'
  export RAY_ADDRESS=$address
  megatrain-ray train examples/tiny.yaml

  # or as a Ray job (the dashboard's job API):
  $job

  dashboard: ${dash:-none}
  stop:      $0 stop
EOF
}

status_cluster() {
  if ! running; then
    log "not running (no cluster in $state)"
    return 1
  fi
  log "running; its settings, $state/cluster.env:"
  cat "$state/cluster.env"
  local address
  address=$(grep ^RAY_ADDRESS= "$state/cluster.env" | cut -d= -f2)
  "$ray_bin" status --address "$address"
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
  start) start_cluster "$@" ;;
  stop)
    keep=0
    [[ ${1:-} == --keep-logs ]] && keep=1
    stop_cluster "$keep" ;;
  status) status_cluster ;;
  *) usage; exit 2 ;;
esac
