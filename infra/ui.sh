#!/usr/bin/env bash
# make ui / make ui-stop: a local Prefect server (UI + API) on 127.0.0.1, this project's deployments on a
# process work pool (flows/deployments.py, code from this checkout) and a Prefect worker that runs their
# flow runs. Server and worker run in their own sessions; their pids are in .rlvr/ui/.
#
#   infra/ui.sh start     RLVR_UI_PORT (4200), REPRO_BASELINE / REPRO_INTERVAL: schedule reproducibility reruns,
#                         RLVR_UI_DEPLOYMENTS=train,evaluate: deploy a subset, RLVR_UI_DIR (.rlvr/ui): pids and logs,
#                         RLVR_UI_POOL (rlvr): the work pool, RLVR_UI_LIMIT (1): flow runs at once,
#                         RLVR_UI_STORE=file://...: the store runs from the UI use (default: their preset's; tests
#                         set their own so that UI runs never land in the user's .rlvr/store)
#   infra/ui.sh stop      SIGTERM to the worker and its flow runs, SIGINT to the server, then SIGKILL whatever
#                         of ours is left
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${RLVR_UI_PORT:-4200}
DIR=${RLVR_UI_DIR:-.rlvr/ui}
PY=${PY:-.venv/bin/python}
POOL=${RLVR_UI_POOL:-rlvr}
# The history `make run` writes (flows/process.py): the UI shows the runs made before it, and a run
# started while it is up finds server.json and reports through this API instead of writing the file too.
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.rlvr/prefect}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-INFO}
export PREFECT_API_URL=http://127.0.0.1:$PORT/api
export HF_HUB_DISABLE_PROGRESS_BARS=1  # flow runs inherit the worker's environment (as flows.main sets it)
URL=http://127.0.0.1:$PORT

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

# Every process of ours: the leaders in the pid files, their sessions, and all their descendants
# (flow runs, vLLM servers and trainers start their own sessions, so a group kill alone misses them).
ours() {
  local pids="" p
  for name in worker server; do [ -f "$DIR/$name.pid" ] && pids="$pids $(cat "$DIR/$name.pid")"; done
  local all="$pids" frontier="$pids"
  while [ -n "${frontier// /}" ]; do
    local next=""
    for p in $frontier; do next="$next $(ps -o pid= --ppid "$p" 2>/dev/null | tr '\n' ' ')"; done
    all="$all $next"; frontier="$next"
  done
  for p in $pids; do all="$all $(ps -o pid= -s "$p" 2>/dev/null | tr '\n' ' ')"; done
  echo "$all" | tr ' ' '\n' | grep -E '^[0-9]+$' | sort -un | tr '\n' ' '
}

start() {
  mkdir -p "$DIR" "$PREFECT_HOME"
  if alive server || alive worker; then echo "already running: $URL (make ui-stop first)"; return 0; fi
  setsid .venv/bin/prefect server start --host 127.0.0.1 --port "$PORT" >"$DIR/server.log" 2>&1 </dev/null &
  echo $! >"$DIR/server.pid"
  # curl, not a Python process a poll: the server's start has the machine's cores to itself.
  for _ in $(seq 1 360); do
    curl -sf -m 2 "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
    alive server || { echo "the Prefect server exited; see $DIR/server.log" >&2; tail -20 "$DIR/server.log" >&2; exit 1; }
    sleep 0.5
  done
  printf '{"api_url": "%s", "prefect_home": "%s"}\n' "$PREFECT_API_URL" "$PREFECT_HOME" >"$DIR/server.json"
  local args=(--pool "$POOL")
  [ -n "${REPRO_BASELINE:-}" ] && args+=(--repro-baseline "$REPRO_BASELINE")
  [ -n "${REPRO_INTERVAL:-}" ] && args+=(--repro-interval "$REPRO_INTERVAL")
  [ -n "${RLVR_UI_DEPLOYMENTS:-}" ] && args+=(--only "$RLVR_UI_DEPLOYMENTS")
  if ! "$PY" -m flows.deployments "${args[@]}" >"$DIR/deploy.log" 2>&1 </dev/null; then
    echo "deploying to work pool $POOL failed; see $DIR/deploy.log" >&2; tail -20 "$DIR/deploy.log" >&2; stop; exit 1
  fi
  # One flow run at a time by default: a training run fills a small machine. `trap - INT`: a script's
  # background job ignores SIGINT, and the worker stops on SIGTERM by sending itself SIGINT.
  ( trap - INT; exec setsid .venv/bin/prefect worker start --pool "$POOL" --type process \
      --limit "${RLVR_UI_LIMIT:-1}" ) >"$DIR/worker.log" 2>&1 </dev/null &
  echo $! >"$DIR/worker.pid"
  for _ in $(seq 1 240); do
    grep -q "started!" "$DIR/worker.log" 2>/dev/null && break
    alive worker || { echo "the worker for pool $POOL exited; see $DIR/worker.log" >&2; tail -20 "$DIR/worker.log" >&2
                      stop; exit 1; }
    sleep 0.5
  done
  cat <<MSG

Prefect UI         $URL   (deployments: $URL/deployments)
deployments        ${RLVR_UI_DEPLOYMENTS:-train, evaluate, prepare, reproducibility} on work pool $POOL ($( [ -n "${REPRO_BASELINE:-}" ] && echo "scheduled: rerun $REPRO_BASELINE every ${REPRO_INTERVAL:-604800} s" || echo "unscheduled: REPRO_BASELINE=<run id> make ui"))
worker             pid $(cat "$DIR/worker.pid"), runs ${RLVR_UI_LIMIT:-1} flow run(s) at once in $PWD
logs               $DIR/server.log, $DIR/deploy.log, $DIR/worker.log
store              ${RLVR_UI_STORE:-storage.root of each preset (override storage.root=... per run)}
history            $PREFECT_HOME (runs made before: listed; make run while this is up: reports here live)
stop               make ui-stop

MSG
}

stop() {
  local pids; pids=$(ours)
  rm -f "$DIR/server.json"  # first: a run starting now uses its own temporary server
  [ -z "${pids// /}" ] && { rm -f "$DIR"/*.pid; echo "not running"; return 0; }
  # The worker and its flow runs first (SIGTERM: the worker stops taking runs; a run fails and stops its
  # servers, trainer and sandboxes, and leads its own session, so a group kill of the worker misses it),
  # then the server (SIGINT: it ignores SIGTERM).
  if alive worker; then
    local w runs; w=$(cat "$DIR/worker.pid")
    runs=$(ps -o pid= --ppid "$w" | tr '\n' ' ' || true)
    kill -TERM -- "-$w" $runs 2>/dev/null || true
    for _ in $(seq 1 150); do alive worker || break; sleep 0.2; done
    # A second interrupt is the worker's own hard stop (it SIGKILLs itself): for a run that would not end.
    if alive worker; then kill -TERM "$w" 2>/dev/null || true; sleep 2; fi
  fi
  if alive server; then
    kill -INT -- "-$(cat "$DIR/server.pid")" 2>/dev/null || true
    for _ in $(seq 1 150); do alive server || break; sleep 0.2; done
  fi
  sleep 0.5
  local left=""
  for p in $pids; do kill -0 "$p" 2>/dev/null && left="$left $p"; done
  if [ -n "$left" ]; then echo "killing what did not stop:$left"; kill -KILL $left 2>/dev/null || true; fi
  rm -f "$DIR"/*.pid
  echo "stopped"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
