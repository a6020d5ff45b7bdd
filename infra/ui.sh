#!/usr/bin/env bash
# make ui / make ui-stop: a local Prefect server (UI + API) on 127.0.0.1 and this project's deployments,
# served by one process (flows/deployments.py). Both run in their own sessions; their pids are in .rlvr/ui/.
#
#   infra/ui.sh start     RLVR_UI_PORT (4200), REPRO_BASELINE / REPRO_INTERVAL: schedule reproducibility reruns,
#                         RLVR_UI_DEPLOYMENTS=train,evaluate: serve a subset, RLVR_UI_DIR (.rlvr/ui): pids and logs,
#                         RLVR_UI_STORE=file://...: the store runs from the UI use (default: their preset's; tests
#                         set their own so that UI runs never land in the user's .rlvr/store)
#   infra/ui.sh stop      SIGTERM to the deployments, SIGINT to the server, then SIGKILL whatever of ours is left
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${RLVR_UI_PORT:-4200}
DIR=${RLVR_UI_DIR:-.rlvr/ui}
PY=${PY:-.venv/bin/python}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.rlvr/prefect-ui}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-INFO}
export PREFECT_API_URL=http://127.0.0.1:$PORT/api
URL=http://127.0.0.1:$PORT

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

# Every process of ours: the leaders in the pid files, their sessions, and all their descendants
# (flow runs, vLLM servers and trainers start their own sessions, so a group kill alone misses them).
ours() {
  local pids="" p
  for name in serve server; do [ -f "$DIR/$name.pid" ] && pids="$pids $(cat "$DIR/$name.pid")"; done
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
  if alive server || alive serve; then echo "already running: $URL (make ui-stop first)"; return 0; fi
  setsid .venv/bin/prefect server start --host 127.0.0.1 --port "$PORT" >"$DIR/server.log" 2>&1 </dev/null &
  echo $! >"$DIR/server.pid"
  for _ in $(seq 1 180); do
    if $PY -c "import httpx,sys; sys.exit(httpx.get('$PREFECT_API_URL/health', timeout=2).status_code != 200)" \
        2>/dev/null; then break; fi
    alive server || { echo "the Prefect server exited; see $DIR/server.log" >&2; tail -20 "$DIR/server.log" >&2; exit 1; }
    sleep 1
  done
  local args=()
  [ -n "${REPRO_BASELINE:-}" ] && args+=(--repro-baseline "$REPRO_BASELINE")
  [ -n "${REPRO_INTERVAL:-}" ] && args+=(--repro-interval "$REPRO_INTERVAL")
  [ -n "${RLVR_UI_DEPLOYMENTS:-}" ] && args+=(--only "$RLVR_UI_DEPLOYMENTS")
  setsid "$PY" -m flows.deployments "${args[@]}" >"$DIR/serve.log" 2>&1 </dev/null &
  echo $! >"$DIR/serve.pid"
  for _ in $(seq 1 120); do
    grep -q "deployments are being served\|Your deployments" "$DIR/serve.log" 2>/dev/null && break
    alive serve || { echo "serving the deployments failed; see $DIR/serve.log" >&2; tail -20 "$DIR/serve.log" >&2; stop; exit 1; }
    sleep 1
  done
  cat <<MSG

Prefect UI         $URL   (deployments: $URL/deployments)
deployments        ${RLVR_UI_DEPLOYMENTS:-train, evaluate, prepare, reproducibility} ($( [ -n "${REPRO_BASELINE:-}" ] && echo "scheduled: rerun $REPRO_BASELINE every ${REPRO_INTERVAL:-604800} s" || echo "unscheduled: REPRO_BASELINE=<run id> make ui"))
logs               $DIR/server.log, $DIR/serve.log
store              ${RLVR_UI_STORE:-storage.root of each preset (override storage.root=... per run)}
runs from the CLI  export PREFECT_API_URL=$PREFECT_API_URL   (then make run / python -m flows.main shows up here)
stop               make ui-stop

MSG
}

stop() {
  local pids; pids=$(ours)
  [ -z "${pids// /}" ] && { rm -f "$DIR"/*.pid; echo "not running"; return 0; }
  # The serve process first (SIGTERM: it pauses its deployments and stops its flow runs; a process
  # started in the background by a script ignores SIGINT), then the server (SIGINT: it ignores SIGTERM).
  for sig_name in TERM:serve INT:server; do
    local sig=${sig_name%%:*} name=${sig_name#*:}
    alive "$name" && kill -"$sig" -- "-$(cat "$DIR/$name.pid")" 2>/dev/null || true
    for _ in $(seq 1 30); do alive "$name" || break; sleep 1; done
  done
  sleep 1
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
