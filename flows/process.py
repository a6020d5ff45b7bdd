"""The process a flow runs in: what every entry point (`flows.main`, `flows.offline_eval`,
`flows.base`, `flows.deployments`) sets up before Prefect loads, and how a stop arrives and is
recognised. Light on purpose: nothing heavy is imported here, so `--help` and a bad argument
answer at once.
"""

from __future__ import annotations

import logging
import os
import signal


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
