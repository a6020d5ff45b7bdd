"""The process a flow runs in: what every entry point (`flows.main`, `flows.offline_eval`,
`flows.base`, `flows.deployments`) sets up before Prefect loads, and how a stop arrives and is
recognised. Light on purpose: nothing heavy is imported here, so `--help` and a bad argument
answer at once.
"""

from __future__ import annotations

import logging
import os
import signal


def prefect_defaults() -> None:
    """A project-local Prefect home, no telemetry, time for the ephemeral API to start on a busy machine."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(".rlvr/prefect"))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect makes only the last level
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # One model file: transformers' per-shard progress bars only add noise to the first screen.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torchao on import: a failed load per CUDA kernel library and a torch deprecation line per
    # enum it registers. Not ours, not actionable on a CPU machine; real errors still show.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


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
