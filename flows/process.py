"""The process a flow runs in: what every entry point (`flows.main`, `flows.offline_eval`,
`flows.base`, `flows.deployments`) sets up before Prefect loads, and how a stop arrives and is
recognised. Light on purpose: nothing heavy is imported here, so `--help` and a bad argument
answer at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


PREFECT_HOME = ".rlvr/prefect"  # one history: `make run` writes it, `make ui` serves it
UI_DIR = ".rlvr/ui"  # infra/ui.sh: pids, logs, and the API address while the UI is up


def prefect_defaults() -> None:
    """A project-local Prefect home, no telemetry, time for the ephemeral API to start on a busy machine,
    and, while `make ui` serves this home, its API: a run started then shows up live, and the UI's
    server stays the one writer of the history's SQLite file."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(PREFECT_HOME))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect makes only the last level
    if not os.environ.get("PREFECT_API_URL"):
        url = ui_api_url(os.environ["PREFECT_HOME"], os.environ.get("RLVR_UI_DIR", UI_DIR))
        if url:
            os.environ["PREFECT_API_URL"] = url
            print(f"reporting to the Prefect UI's server: {url.removesuffix('/api')}", flush=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # The run's progress lines go to the UI's log view (the run logger at INFO, to the API), but the
    # terminal shows them once, as printed: Prefect's console handler keeps to warnings.
    for logger in ("FLOW_RUNS", "TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_PREFECT_{logger}_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    # A line logged outside a flow run (a grader's thread) is printed, not sent: no warning for it.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # One model file: transformers' per-shard progress bars only add noise to the first screen.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torchao on import: a failed load per CUDA kernel library and a torch deprecation line per
    # enum it registers. Not ours, not actionable on a CPU machine; real errors still show.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def ui_api_url(prefect_home: str, ui_dir: str) -> str | None:
    """The API of a `make ui` server that serves `prefect_home` and answers now, else None."""
    import json
    import urllib.request

    try:
        with open(os.path.join(ui_dir, "server.json")) as f:
            ui = json.load(f)
    except (OSError, ValueError):
        return None
    if os.path.realpath(ui.get("prefect_home", "")) != os.path.realpath(prefect_home):
        return None
    try:
        with urllib.request.urlopen(ui["api_url"] + "/health", timeout=3) as r:
            return ui["api_url"] if r.status == 200 else None
    except (OSError, ValueError, KeyError):  # a stale file: the server is gone
        return None


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt in the main thread, so every `finally` stops the
    run's servers and sandboxes; a process started in the background inherits SIGINT ignored.
    While a flow runs, Prefect's own SIGTERM handler raises TerminationSignal instead: both are
    a stop (`stop_signal`)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def stop_signal(exc: BaseException) -> str | None:
    """The signal a run was stopped by ("SIGINT", "SIGTERM"), None for any other exception:
    KeyboardInterrupt from `stop_on_signals` (named) or Python's own (Ctrl-C), and Prefect's
    TerminationSignal (its SIGTERM handler, installed while a flow runs)."""
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "SIGINT"
    from prefect.exceptions import TerminationSignal  # heavy: only on the way out of a failed run

    if isinstance(exc, TerminationSignal):
        return signal.Signals(exc.signal).name
    return None


class TemporaryAPI:
    """Prefect's temporary API server, started by the run at once instead of by Prefect at the run's first
    API call: the app Prefect's ephemeral mode serves (prefect.server.api.server:create_app under uvicorn,
    UI off, ephemeral services), on 127.0.0.1, its database in PREFECT_HOME. It loads while vLLM does and
    the run imports its flows, and the run's process never imports Prefect's server (4 s) to manage it.
    Its own session: a terminal's Ctrl-C or a SIGTERM to the run's group does not stop the API the run
    reports its stop to. Stopped when the run's process exits (its SQLite database is transactional);
    the run's watchdog (tasks/supervise.py) ends it if the run is killed outright.

        api = TemporaryAPI().start()   # sets PREFECT_API_URL: call before Prefect is imported
        ...
        api.wait_ready()               # before the first flow runs
    """

    def __init__(self, home: str | os.PathLike | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.home = str(home or os.environ.get("PREFECT_HOME", PREFECT_HOME))  # its database's directory
        self.log_path = os.path.join(self.home, "temporary-api.log")
        self.proc: subprocess.Popen | None = None

    def start(self, export: bool = True) -> "TemporaryAPI":
        """export: this process's flows report to it (PREFECT_API_URL)."""
        env = dict(os.environ, PREFECT_HOME=self.home, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1",
                   PREFECT__SERVER_FINAL="1")
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        atexit.register(self.stop)
        if export:
            os.environ["PREFECT_API_URL"] = self.url
        return self

    def wait_ready(self) -> None:
        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Prefect's temporary API server exited with {self.proc.returncode} while starting; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's temporary API server did not answer within {timeout:.0f} s; "
                                   f"see {self.log_path}")
            time.sleep(0.1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
