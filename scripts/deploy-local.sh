#!/usr/bin/env bash
# Deploy the fedfusion App with Flower's deployment engine on this machine: one SuperLink and
# N SuperNodes on 127.0.0.1 (free ports), then `flwr run` against them. The commands are those
# of a real deployment (docs/deploy.md); only the addresses are loopback. Every process started
# here is stopped by pid on exit, also on failure or Ctrl-C, with the SuperExecs, ServerApps
# and ClientApps Flower started from it, and waited for until gone. Success is judged from
# <output-dir>/<run-name>/results.json (`flwr run` exits 0 even when the run fails).
#
#   bash scripts/deploy-local.sh [--mode insecure|tls|auth] [--num-clients N]
#        [--run-config "k=v ..."] [--node I "k=v ..."]... [--work-dir DIR]
#        [--intruders] [--measure] [--timeout SECONDS]
#
#   --mode insecure  plain HTTP everywhere (--insecure)
#          tls       a CA and a server certificate generated here; SuperNodes and the flwr CLI
#                    verify the SuperLink against the CA
#          auth      tls + SuperNode authentication: each SuperNode has its own EC key, whose
#                    public half is registered with `flwr supernode register` before it starts
#   --run-config     run-config overrides, as for `python -m fedfusion.app.launch`; default
#                    output-dir WORK/outputs, run-name deploy-<mode>, num-clients N (3)
#   --node I "k=v"   more node config for SuperNode I (fedfusion.app.config.NODE_OVERRIDES,
#                    e.g. "num-members=2 local-epochs=5"; TOML values: strings in quotes)
#   --work-dir DIR   logs/, certs/, keys/, flwr-home/, outputs/ (default: a new temp dir, kept)
#   --intruders      also start SuperNodes the SuperLink must refuse (tls: one that lacks the
#                    CA; auth: one with an unregistered key and one with no key) and fail
#                    unless each exits refused before the run starts
#   --measure        sample the peak memory and CPU time of every Flower process into
#                    WORK/memory.json (the ClientApp runs in its own flwr-clientapp process)
#   --timeout S      limit of the run (default 1800 s)
#
# Needs bash >= 4.4 and flwr, flower-superlink, flower-supernode next to $PYTHON
# (default: .venv/bin/python of this checkout, else python3).
set -euo pipefail

APP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  PYTHON="$APP_DIR/.venv/bin/python"
  [ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
fi
BIN="$(dirname "$PYTHON")"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
fail() { echo "deploy-local: $*" >&2; exit 1; }
need() { [ "$2" -ge 2 ] || { usage >&2; fail "$1 needs a value"; }; }

MODE=insecure NUM_CLIENTS_ARG="" RUN_CONFIG="" WORK="" INTRUDERS=0 MEASURE=0 TIMEOUT=1800
declare -A NODE_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) need "$1" $#; MODE="$2"; shift 2 ;;
    --num-clients) need "$1" $#; NUM_CLIENTS_ARG="$2"; shift 2 ;;
    --run-config) need "$1" $#; RUN_CONFIG="$2"; shift 2 ;;
    --node) [ $# -ge 3 ] || fail "--node needs an index and a node config"
            [[ "$2" =~ ^[0-9]+$ ]] || fail "--node index must be a number, got '$2'"
            NODE_EXTRA[$2]="${NODE_EXTRA[$2]:+${NODE_EXTRA[$2]} }$3"; shift 3 ;;
    --work-dir) need "$1" $#; WORK="$2"; shift 2 ;;
    --intruders) INTRUDERS=1; shift ;;
    --measure) MEASURE=1; shift ;;
    --timeout) need "$1" $#; TIMEOUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; fail "unknown argument '$1'" ;;
  esac
done
case "$MODE" in
  insecure|tls|auth) ;;
  *) fail "--mode must be insecure, tls or auth, got '$MODE'" ;;
esac
[ "$INTRUDERS" = 0 ] || [ "$MODE" != insecure ] \
  || fail "--intruders needs --mode tls or auth: an insecure SuperLink accepts any SuperNode"
for tool in flwr flower-superlink flower-supernode; do
  [ -x "$BIN/$tool" ] || fail "$tool not found next to $PYTHON (set PYTHON to the env's python)"
done

WORK="${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fedfusion-deploy.XXXXXX")}"
mkdir -p "$WORK/logs"
WORK="$(cd "$WORK" && pwd)"
helper() {
  "$PYTHON" "$APP_DIR/scripts/deploy_tools.py" "$@"
}

# NUM_CLIENTS, RESULTS, RUN_CONFIG_ARGS (relative paths resolve against the caller's folder)
plan="$(helper plan "$RUN_CONFIG" --output-dir "$WORK/outputs" --run-name "deploy-$MODE" \
        ${NUM_CLIENTS_ARG:+--num-clients "$NUM_CLIENTS_ARG"})"
eval "$plan"
for i in "${!NODE_EXTRA[@]}"; do
  [ "$i" -lt "$NUM_CLIENTS" ] || fail "--node $i: there are SuperNodes 0..$((NUM_CLIENTS - 1))"
done
# a results.json left by an earlier run of the same name would pass for this run's
rm -f "$RESULTS"

# A private Flower home: the CLI's connection config, the SuperNodes' installed App.
export FLWR_HOME="$WORK/flwr-home"
mkdir -p "$FLWR_HOME"
# The environment is set up already (no `uv sync`); no update check (offline).
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_DISABLE_UPDATE_CHECK=1
# numpy's OpenBLAS pool spun on idle cores in Flower's processes (fedfusion/app/launch.py)
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export PATH="$BIN:$PATH"  # the SuperLink and SuperNodes start flower-superexec by name
# The processes run in WORK, not in the checkout: the ClientApp and ServerApp must import
# fedfusion from the App bundle (FAB) `flwr run` ships, as on a real device.
cd "$WORK"

PIDS=() WATCH_PID=""
started() { PIDS+=("$1"); echo "$1 $2" >> "$WORK/pids"; }
alive() {  # a zombie (exited, not yet reaped) counts as gone
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [ "${stat%% *}" != Z ]
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$WATCH_PID" ]; then  # it writes memory.json on SIGTERM
    kill -TERM "$WATCH_PID" 2> /dev/null || true
    wait "$WATCH_PID" || true
  fi
  # returns once they are gone (SIGKILL after a grace period): a SuperNode's SuperExec
  # outlives it by seconds, and the check below must not see one that is still exiting
  helper stop "${PIDS[@]}" --flwr-home "$FLWR_HOME" || true
  if ! left="$(helper leftovers "$FLWR_HOME")"; then
    echo "deploy-local: processes left running after the stop:" >&2
    echo "$left" >&2
    rc=1
  fi
  [ "$rc" -eq 0 ] || echo "deploy-local: failed (exit $rc); logs in $WORK/logs" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
: > "$WORK/pids"

# ---------------------------------------------------------------------------------- SuperLink
ports="$(helper free-ports $((NUM_CLIENTS + 3)))"  # SuperLink, 2 intruders, N SuperNodes
mapfile -t PORTS <<< "$ports"
SUPERLINK="127.0.0.1:${PORTS[0]}"
case "$MODE" in
  insecure)
    LINK_TLS=(--insecure); NODE_TLS=(--insecure); CLI_TLS="insecure = true" ;;
  tls|auth)
    helper tls "$WORK/certs" > /dev/null
    LINK_TLS=(--ssl-ca-certfile "$WORK/certs/ca.pem" --ssl-certfile "$WORK/certs/server.pem"
              --ssl-keyfile "$WORK/certs/server.key")
    NODE_TLS=(--root-certificates "$WORK/certs/ca.pem")
    CLI_TLS="root-certificates = \"$WORK/certs/ca.pem\"" ;;
esac
LINK_AUTH=()
if [ "$MODE" = auth ]; then
  LINK_AUTH=(--enable-supernode-auth)
  # one EC key pair per SuperNode (on a real device: generated there, private key kept there)
  KEY_NAMES=()
  for ((i = 0; i < NUM_CLIENTS; i++)); do KEY_NAMES+=("supernode-$i"); done
  if [ "$INTRUDERS" = 1 ]; then KEY_NAMES+=(unregistered); fi
  helper node-key "$WORK/keys" "${KEY_NAMES[@]}" > /dev/null
fi

if [ "$MEASURE" = 1 ]; then
  helper watch "$FLWR_HOME" "$WORK/memory.json" &
  WATCH_PID=$!
fi

echo "+ flower-superlink ${LINK_TLS[*]} ${LINK_AUTH[*]} --host 127.0.0.1 --port ${PORTS[0]}"
flower-superlink "${LINK_TLS[@]}" "${LINK_AUTH[@]}" --host 127.0.0.1 --port "${PORTS[0]}" \
  > "$WORK/logs/superlink.log" 2>&1 &
LINK_PID=$!
started "$LINK_PID" superlink

# The flwr CLI's connection to it (flwr 1.41: [superlink.<name>] in $FLWR_HOME/config.toml)
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "local-deploy"

[superlink.local-deploy]
address = "$SUPERLINK"
$CLI_TLS
EOF

deadline=$((SECONDS + 60))
until (exec 3<> "/dev/tcp/127.0.0.1/${PORTS[0]}") 2> /dev/null; do
  alive "$LINK_PID" || fail "the SuperLink exited: $(tail -5 "$WORK/logs/superlink.log")"
  [ "$SECONDS" -lt "$deadline" ] || fail "the SuperLink did not open ${PORTS[0]} within 60 s"
  sleep 0.2
done

if [ "$MODE" = auth ]; then
  for ((i = 0; i < NUM_CLIENTS; i++)); do
    echo "+ flwr supernode register $WORK/keys/supernode-$i.pub local-deploy --name supernode-$i"
    flwr supernode register "$WORK/keys/supernode-$i.pub" local-deploy --name "supernode-$i"
  done
fi

# ---------------------------------------------------------------------------------- intruders
if [ "$INTRUDERS" = 1 ]; then
  INTRUDER_NAMES=() INTRUDER_PIDS=()
  start_intruder() {  # name, port, flags...: a SuperNode that must be refused
    local name="$1" port="$2"
    shift 2
    echo "+ flower-supernode $* ...   (intruder '$name': must be refused)"
    flower-supernode "$@" --superlink "$SUPERLINK" --host 127.0.0.1 --port "$port" \
      --node-config "partition-id=0 num-partitions=$NUM_CLIENTS" \
      > "$WORK/logs/intruder-$name.log" 2>&1 &
    started $! "intruder-$name"
    INTRUDER_NAMES+=("$name") INTRUDER_PIDS+=($!)
  }
  if [ "$MODE" = tls ]; then
    start_intruder untrusted-ca "${PORTS[1]}"  # verifies the SuperLink with the system CAs
  else
    start_intruder unregistered-key "${PORTS[1]}" "${NODE_TLS[@]}" \
      --auth-supernode-private-key "$WORK/keys/unregistered"
    start_intruder no-key "${PORTS[2]}" "${NODE_TLS[@]}"
  fi
fi

# ---------------------------------------------------------------------------------- SuperNodes
NODE_PIDS=()
for ((i = 0; i < NUM_CLIENTS; i++)); do
  node_config="partition-id=$i num-partitions=$NUM_CLIENTS${NODE_EXTRA[$i]:+ ${NODE_EXTRA[$i]}}"
  node_auth=()
  if [ "$MODE" = auth ]; then node_auth=(--auth-supernode-private-key "$WORK/keys/supernode-$i"); fi
  echo "+ flower-supernode ${NODE_TLS[*]} ${node_auth[*]} --superlink $SUPERLINK" \
       "--host 127.0.0.1 --port ${PORTS[$((i + 3))]} --node-config \"$node_config\""
  flower-supernode "${NODE_TLS[@]}" "${node_auth[@]}" --superlink "$SUPERLINK" \
    --host 127.0.0.1 --port "${PORTS[$((i + 3))]}" --node-config "$node_config" \
    > "$WORK/logs/supernode-$i.log" 2>&1 &
  started $! "supernode-$i"
  NODE_PIDS+=($!)
done

# each intruder must have been refused (and exited) before the run starts
if [ "$INTRUDERS" = 1 ]; then
  for k in "${!INTRUDER_PIDS[@]}"; do
    name="${INTRUDER_NAMES[$k]}" pid="${INTRUDER_PIDS[$k]}"
    log="$WORK/logs/intruder-$name.log"
    deadline=$((SECONDS + 60))
    while alive "$pid"; do
      [ "$SECONDS" -lt "$deadline" ] || fail "intruder '$name' was not refused within 60 s: $log"
      sleep 0.2
    done
    rc=0
    wait "$pid" || rc=$?
    grep -q "Failed to initialize the connection to the SuperLink" "$log" && [ "$rc" -ne 0 ] \
      || fail "intruder '$name' exited $rc without the refusal message: $log"
    echo "deploy-local: intruder '$name' refused (exit $rc):" \
         "$(grep -A1 'Failed to initialize the connection' "$log" | tail -1)"
  done
fi

# ---------------------------------------------------------------------------------- the run
echo "+ flwr run $APP_DIR local-deploy --stream ${RUN_CONFIG_ARGS[*]}"
# in the background, so that a TERM/INT reaches the trap at once and a SuperNode that dies
# fails the run here instead of after the timeout (the ServerApp would wait for it)
RUN_DEADLINE=$((SECONDS + TIMEOUT))
timeout "$TIMEOUT" flwr run "$APP_DIR" local-deploy --stream "${RUN_CONFIG_ARGS[@]}" &
RUN_PID=$!
started "$RUN_PID" flwr-run
nodes_alive() {
  for i in "${!NODE_PIDS[@]}"; do
    alive "${NODE_PIDS[$i]}" || fail "SuperNode $i exited during the run:" \
      "$(tail -5 "$WORK/logs/supernode-$i.log")"
  done
}
while alive "$RUN_PID"; do
  nodes_alive
  sleep 0.5
done
rc=0
wait "$RUN_PID" || rc=$?
[ "$rc" -ne 124 ] || fail "the run did not finish within $TIMEOUT s"
[ "$rc" -eq 0 ] || fail "flwr run exited $rc"
# `flwr run --stream` can return while the run goes on: its log stream gives up when the
# SuperLink answers slowly (20 SuperNodes starting their ClientApps at once on 2 cores).
# The run ends when its ServerApp process does.
while helper serverapp-running "$FLWR_HOME"; do
  [ "$SECONDS" -lt "$RUN_DEADLINE" ] || fail "the run did not finish within $TIMEOUT s"
  nodes_alive
  sleep 1
done
helper check "$RESULTS" --clients "$NUM_CLIENTS"
echo "deploy-local: work dir $WORK (logs/, outputs/)"
