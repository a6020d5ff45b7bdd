"""What a flow run holds while it runs: config, store, the policy's server and trainer, progress.

Flows pass object-store URIs between stages; the long-lived processes (the vLLM
server, the trainer worker) and the event loop that drives rollouts live here,
for the duration of one flow run, and are shut down with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from schemas.config import RunConfig
from tasks.storage import Store

REPO = pathlib.Path(__file__).resolve().parents[1]
# A stopped run's servers get this long to shut down before they are killed: what they hold is
# not needed (their clients are closed first).
STOP_GRACE_S = 3.0


def log(msg: str, logger=None) -> None:
    """Progress for people: one line, flushed, also shown in the Prefect UI's logs (through
    `logger`, the run logger, when called from a thread that is not the run's)."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    try:
        (logger or _run_logger()).info(msg)
    except Exception:
        pass  # outside a flow run


def _run_logger():
    from prefect.logging import get_run_logger

    return get_run_logger()


class Progress:
    """Counts for a long stage: "<what>: 120/951 tasks, 1.2 min, about 3.4 min left" (the time left
    once a tenth is done, at the rate since the first finished), logged at each quarter, at least
    every `every_s` seconds, and at the end. Thread-safe: graders call it from their pool.
    `resumed(n)` counts n items an earlier attempt finished (done, but not in this attempt's rate)."""

    def __init__(self, what: str, total: int, unit: str = "", every_s: float = 15.0, clock=time.monotonic):
        self.what, self.total, self.unit, self.every_s, self.clock = what, total, unit, every_s, clock
        self.start, self.done, self.t0, self.last, self.t_first = 0, 0, clock(), clock(), None
        self.lock = threading.Lock()
        try:
            self.logger = _run_logger()
        except Exception:
            self.logger = None

    def resumed(self, n: int):
        with self.lock:
            self.start = self.done = n

    def __call__(self, *_):
        with self.lock:
            self.done += 1
            now, done, new = self.clock(), self.done, self.done - self.start
            self.t_first = now if new == 1 else self.t_first
            quarter = done % max(1, self.total // 4) == 0
            if done < self.total and not quarter and now - self.last < self.every_s:
                return
            self.last = now
        took = now - self.t0
        eta = ""
        if done < self.total:  # items run many at once: the rate counts from the first one's end
            rate = (new - 1) / (now - self.t_first) if now > self.t_first else 0.0
            eta = (f", about {_minutes((self.total - done) / rate)} left" if new >= max(2, self.total // 10) and rate
                   else ", estimating the time left")
        log(f"{self.what}: {done}/{self.total}{' ' + self.unit if self.unit else ''}, {_minutes(took)}{eta}",
            self.logger)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class EventLoopThread:
    """One asyncio loop in a background thread: rollouts, evaluations and weight reloads all
    run on it, so one inference client (and its connection pool) serves them all, also while
    the main thread waits on a policy update (overlapped collection)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro):
        return self.submit(coro).result()

    def cancel_all(self, timeout: float = 5.0) -> None:
        """Cancel whatever runs on the loop (rollouts of a stopped run) and wait for it to unwind,
        so nothing of it commits after the stop."""
        async def cancel():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=timeout) if tasks else None

        try:
            self.call(cancel())
        except Exception:
            pass

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class RunContext:
    cfg: RunConfig
    store: Store
    run_id: str
    workdir: pathlib.Path
    tasks: dict[str, dict] = field(default_factory=dict)
    tokenizer: object = None
    server: object = None  # the first of `servers` (managed mode)
    servers: list = field(default_factory=list)
    client: object = None
    trainer: object = None
    loop: EventLoopThread | None = None
    policy_dir: pathlib.Path | None = None
    policy_version: int = 0

    def split_ids(self, split: str) -> list[str]:
        return sorted(i for i, t in self.tasks.items() if t["split"] == split)

    def start_policy(self, model_dir: pathlib.Path, version: int, trainer: bool = True,
                     servers: list | None = None) -> None:
        """Serve `model_dir` with vLLM (`servers` launched earlier by `launch_early`, or new ones, or the
        external servers) and, for training, launch the trainer: it loads while the servers do and while
        the first rollouts run, and its first update waits for it."""
        from tasks.inference import PolicyClient, VLLMServer
        from tasks.policy.tokenizer import IM_END

        if self.loop is None:
            self.loop = EventLoopThread()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.policy_dir, self.policy_version = model_dir, version
        if self.tokenizer is None:
            from tasks.policy.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(model_dir)
        if self.cfg.inference.mode == "external":
            urls = list(self.cfg.inference.base_urls)
        else:
            t0, n = time.monotonic(), self.cfg.inference.num_servers
            self.servers = list(servers or [])
            if self.servers:
                log(f"vLLM for policy v{version}: using the server launched at the start "
                    f"({', '.join(s.base_url for s in self.servers)})")
            else:
                log(f"starting {n} vLLM server{'s' if n > 1 else ''} for policy v{version} (about a minute each on CPU)")
            try:
                if not self.servers:
                    self.servers.append(VLLMServer(model_dir, self.cfg.inference, log_dir=self.workdir / "logs").launch())
                if trainer:
                    self._launch_trainer(model_dir)
                self.servers[0].wait_ready()
                # One after another: on CPU their start-ups compete for the same cores.
                for _ in range(n - len(self.servers)):
                    self.servers.append(VLLMServer(model_dir, self.cfg.inference, log_dir=self.workdir / "logs").start())
            except BaseException:
                self._stop_servers()
                raise
            self.server = self.servers[0]
            urls = [s.base_url for s in self.servers]
            log(f"vLLM serving policy v{version} at {', '.join(urls)} "
                f"(ready {time.monotonic() - t0:.0f} s after this run asked, logs "
                f"{', '.join(str(s.log_path) for s in self.servers)})")
        if trainer and self.trainer is None:
            self._launch_trainer(model_dir)
        self.client = PolicyClient(urls, stop_token_ids=[self.tokenizer.convert_tokens_to_ids(IM_END)],
                                   version=version)
        served = {s.model_dir for s in self.servers}
        if self.cfg.inference.mode == "external" or served != {pathlib.Path(model_dir).resolve()}:
            # Shared servers may hold anyone's weights, and early ones the base a resumed run moved past:
            # load ours (they must be able to read model_dir).
            self.loop.call(self.client.reload_weights(model_dir, version))
        elif self.cfg.cluster.address:
            # Episodes on other nodes stamp turns with the servers' own version: tell them which it is.
            self.loop.call(self.client.record_version(version))

    def _launch_trainer(self, model_dir: pathlib.Path) -> None:
        from tasks.policy.worker import TrainerWorker

        self.trainer = TrainerWorker(model_dir, self.cfg, num_ranks=self.cfg.optimizer.num_ranks,
                                     precision=self.cfg.optimizer.precision,
                                     log_path=self.workdir / "logs" / "trainer.log").launch()

    def _stop_servers(self, timeout: float = 30.0) -> None:
        for server in self.servers or ([self.server] if self.server is not None else []):
            try:
                server.stop(timeout=timeout)
            except Exception as e:  # keep closing the rest
                print(f"warning: stopping vLLM server {server} failed: {e}", file=sys.stderr)
        self.servers, self.server = [], None

    def close(self, graceful: bool = True) -> None:
        """Stop what the run started, users before what they use: the rollouts on the loop, the
        client (its open connections would hold each server's shutdown for its full timeout),
        the trainer, then the servers. graceful=False (a run stopped or failed) cancels the
        rollouts, kills the trainer instead of waiting for the update in progress, and gives the
        servers a few seconds to shut down: nothing will commit what any of them is doing."""
        if self.loop is not None and not graceful:
            self.loop.cancel_all()
        if self.client is not None and self.loop is not None:
            try:
                self.loop.call(self.client.aclose())
            except Exception:
                pass
        if self.trainer is not None:
            try:
                self.trainer.stop() if graceful else self.trainer.kill()
            except Exception as e:  # keep closing the rest
                print(f"warning: stopping trainer failed: {e}", file=sys.stderr)
            self.trainer = None
        self._stop_servers(timeout=30.0 if graceful else STOP_GRACE_S)
        if self.loop is not None:
            self.loop.close()
            self.loop = None


def shipped_base_dir(path: str) -> pathlib.Path:
    """A local model.path as a directory: presets name the shipped base relative to the repository."""
    if not pathlib.Path(path).is_absolute() and not pathlib.Path(path).exists():
        return REPO / path
    return pathlib.Path(path)


def launch_early(cfg: RunConfig, run_id: str) -> list:
    """`make run`'s vLLM server, launched in the run's first seconds so that it loads while Prefect's API
    starts and prepare checks the dataset and the base: it serves the shipped base (a resumed run loads
    its checkpoint into it), and `RunContext.start_policy` adopts it. None (an empty list) where there is
    no local base before prepare, the servers are external or several, or the run has finished."""
    from tasks.inference import VLLMServer

    inf, path = cfg.inference, cfg.model.path
    if inf.mode != "managed" or inf.num_servers != 1 or not path or "://" in path:
        return []
    manifest = Store.from_config(cfg.storage).read_manifest(run_id)
    if manifest is not None and manifest.status in ("succeeded", "target_not_reached"):
        return []  # a rerun of a finished run only prints its summary
    server = VLLMServer(shipped_base_dir(path), inf, log_dir=work_root() / run_id / "logs").launch()
    print(f"vLLM server launched at {server.base_url}, loading {server.model_dir.name} while the run prepares "
          f"(log {server.log_path})", flush=True)
    return [server]


def load_tasks(store: Store, tasks_key: str) -> dict[str, dict]:
    rows = store.read_table(tasks_key, stage="tasks").to_pylist()
    return {r["instance_id"]: r for r in rows}


def config_json(cfg: RunConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True)


def code_version() -> str:
    """The checkout's commit (`git describe --always --dirty`), or "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                              text=True, cwd=pathlib.Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def work_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("RLVR_WORK", ".rlvr/work")).resolve()
