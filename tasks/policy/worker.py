"""The trainer worker: the one process (or torchrun job) that trains the policy, and its client.

A `grpo` worker loads the policy and its AdamW state once and serves GRPO updates
(grpo.py: PolicyTrainer), saving every new checkpoint dir (vLLM reloads weights from it;
the run resumes from it). An `sft` worker runs warm-start requests (sft.py).

    python -m tasks.policy.worker --mode grpo|sft --model DIR --config run.json [--reference DIR] [--precision fp32|bf16]
    torchrun --standalone --nproc_per_node 2 -m tasks.policy.worker ...

Protocol, one JSON object per line. Rank 0 reads requests on stdin and broadcasts each
to the other ranks; every rank runs it; rank 0 answers on stdout. Nothing else goes to
stdout: the worker points its stdout at stderr (the log) and keeps a private copy of the
original for replies.

    <- {"ok": true, "op": "ready", "policy_version": k, "world_size": n, ...}     once loaded
    -> {"op": "grpo", "trajectories": PATH, "advantages": PATH, "out": DIR,
        "policy_version": k (default: current + 1), "optimizer_steps": 1, "save_optimizer": true}
    -> {"op": "sft", "demonstrations": PATH, "out": DIR, "stage": {...} (schemas/recipe.py: SFTStage),
        "max_steps": n, "policy_version": 0}
    <- {"op": "progress", "text": "..."}      (sft, any number, before the answer)
    <- {"ok": true, "metrics": {...}}
    <- {"ok": false, "error_type": "BadBatchError" | "JoinError" | "UpdateAborted" | ..., "message": ...,
        "fatal": false}
    -> {"op": "stop"}                         (end of stdin counts as a stop: a vanished client leaves no worker)
    <- {"ok": true, "op": "stop", "optimizer_saved": bool}, exit 0

After a non-fatal error the in-memory policy and optimizer are exactly as before the
request, so the previous checkpoint stands and the worker takes the next request. After
a fatal one (an error while stepping or saving: the state may be ahead of the last
checkpoint) the worker exits; start a new one from the last checkpoint dir.

`TrainerWorker` is the client: it starts the worker (torchrun for N ranks), waits for it
with a bound, sends requests, turns error replies into BadBatchError / UpdateAborted /
WorkerError, and stops or kills the whole process tree.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from schemas.config import RunConfig
from schemas.recipe import SFTStage

OPS = {"grpo": ("trajectories", "advantages", "out"), "sft": ("demonstrations", "out", "stage"), "stop": ()}  # op -> fields
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the worker (every rank)


def _error(e: BaseException, error_type: str | None = None, fatal: bool = False) -> dict:
    return {"ok": False, "error_type": error_type or type(e).__name__, "message": str(e), "fatal": fatal}


def _reply(out, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _read_request(inp, out) -> dict:
    """Rank 0: the next valid request; malformed lines are answered here and skipped."""
    while True:
        line = inp.readline()
        if not line:
            return {"op": "stop", "eof": True}
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or req.get("op") not in OPS:
                raise ValueError(f"expected a JSON object with op in {sorted(OPS)}, got {line.strip()[:200]}")
            missing = [k for k in OPS[req["op"]] if k not in req]
            if missing:
                raise ValueError(f"{req['op']} request lacks {', '.join(missing)}")
            return req
        except ValueError as e:  # json.JSONDecodeError is one
            _reply(out, _error(e, "BadRequest"))


def _handle_grpo(trainer, req: dict) -> dict:
    import pyarrow.parquet as pq

    from tasks.policy.runtime import UpdateAborted, all_reduce

    t0 = time.perf_counter()
    # Input phase: nothing in memory changes, so any error here is harmless.
    err, samples, masked = None, [], 0
    try:
        steps, version = req.get("optimizer_steps"), req.get("policy_version")
        steps, version = (None if x is None else int(x) for x in (steps, version))
        if steps is not None and steps < 1:
            raise ValueError("optimizer_steps must be >= 1")
        samples, masked = trainer.prepare(pq.read_table(req["trajectories"]), pq.read_table(req["advantages"]))
    except Exception as e:
        err = e
        print(f"[worker rank {trainer.rt.rank}] rejected: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    # Every rank must agree before the update's collectives (say, a file one rank cannot read).
    if all_reduce([float(err is not None)], "max")[0]:
        if err is None:
            err = RuntimeError("the input failed on another rank (see the log)")
            return _error(err, "InputError")
        return _error(err)
    try:
        metrics = trainer.grpo_update(samples, masked, req["out"], optimizer_steps=steps, policy_version=version,
                                      save_optimizer=bool(req.get("save_optimizer", True)), t0=t0)
    except UpdateAborted as e:  # all ranks abort together; the trainer put its state back
        return _error(e)
    except Exception as e:  # the policy may have moved past its last checkpoint: not safe to go on
        import traceback

        traceback.print_exc(file=sys.stderr)
        return _error(e, fatal=True)
    return {"ok": True, "metrics": metrics}


def _handle_sft(cfg: RunConfig, model_dir: str, precision: str | None, req: dict, out) -> dict:
    import pyarrow.parquet as pq

    from tasks.policy.runtime import init_runtime
    from tasks.policy.sft import sft_train


    main = init_runtime(precision).main
    try:
        metrics = sft_train(req.get("model") or model_dir, pq.read_table(req["demonstrations"]), cfg,
                            SFTStage.model_validate(req["stage"]), req["out"],
                            max_steps=req.get("max_steps"), policy_version=int(req.get("policy_version") or 0),
                            precision=precision,
                            progress=(lambda text: _reply(out, {"op": "progress", "text": text})) if main else None)
    except Exception as e:  # nothing in memory outlives the request: the worker may go on
        print(f"[worker] sft rejected: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return _error(e)
    return {"ok": True, "metrics": metrics}


def serve(trainer, inp, out, rt=None, handlers: dict | None = None) -> int:
    """The request loop, on every rank (only rank 0 touches inp/out). Returns the exit code.
    handlers: op -> fn(request) -> reply; default: GRPO updates of `trainer`."""
    rt = rt or trainer.rt
    handlers = handlers or {"grpo": lambda req: _handle_grpo(trainer, req)}
    import torch.distributed as dist

    from tasks.policy.runtime import collective_device

    while True:
        req = _read_request(inp, out) if rt.main else None
        if rt.world > 1:
            box = [req]
            dist.broadcast_object_list(box, src=0, device=collective_device())
            req = box[0]
        if req["op"] == "stop":
            saved = trainer.save_optimizer_state() if trainer is not None else False  # optimizer.pt an update skipped
            if rt.main:
                _reply(out, {"ok": True, "op": "stop", "optimizer_saved": saved, "eof": bool(req.get("eof"))})
            return 0
        if req["op"] in handlers:
            reply = handlers[req["op"]](req)
        else:
            reply = _error(ValueError(f"this worker does not take {req['op']} requests"), "BadRequest")
        if rt.main:
            m = reply.get("metrics", {})
            print(f"[worker] {req['op']} -> {req.get('out')}: " + (
                f"v{m.get('policy_version')} loss {m.get('loss', float('nan')):.4g} in {m.get('seconds', 0):.2f} s"
                if reply["ok"] else f"{reply['error_type']}: {reply['message']}"), file=sys.stderr, flush=True)
            _reply(out, reply)
        if reply.get("fatal"):
            return 1


def _die_with_launcher() -> None:
    """Under torchrun: if the launcher is SIGKILLed (no chance to stop its ranks), the ranks go too."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # a 1-rank worker stops on end of stdin when its client goes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher was already gone
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.policy.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["grpo", "sft"], default="grpo")
    p.add_argument("--model", required=True, help="checkpoint dir to start from")
    p.add_argument("--config", help="RunConfig as a JSON file (default: RunConfig())")
    p.add_argument("--reference", help="reference policy dir (needed for a KL penalty); kept in memory")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--fresh-optimizer", action="store_true", help="ignore the optimizer.pt of --model")
    a = p.parse_args(argv)
    # The protocol owns the real stdout; everything else written to fd 1 (libraries, C code) goes to the log.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _die_with_launcher()

    from transformers.utils import logging as hf_logging

    from tasks.policy.grpo import PolicyTrainer
    from tasks.policy.runtime import init_runtime

    hf_logging.disable_progress_bar()
    cfg = RunConfig.model_validate_json(Path(a.config).read_text()) if a.config else RunConfig()
    t0 = time.perf_counter()
    trainer = None
    try:
        if a.mode == "grpo":
            trainer = PolicyTrainer(a.model, cfg, reference_dir=a.reference,
                                    keep_optimizer_state=not a.fresh_optimizer, precision=a.precision)
        rt = trainer.rt if trainer is not None else init_runtime(a.precision)
    except Exception as e:
        if os.environ.get("RANK", "0") == "0":
            _reply(out, {**_error(e, fatal=True), "op": "ready"})
        raise
    if rt.main:
        _reply(out, {"ok": True, "op": "ready", "mode": a.mode, "world_size": rt.world, "pid": os.getpid(),
                     "policy_version": trainer.version if trainer is not None else None,
                     "optimizer_resumed": bool(trainer.resumed) if trainer is not None else False,
                     "load_seconds": time.perf_counter() - t0})
    sft = {"sft": lambda req: _handle_sft(cfg, a.model, a.precision, req, out)}
    code = serve(trainer, sys.stdin, out, rt, None if trainer is not None else sft)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def worker_command(args: list[str], num_ranks: int = 1) -> list[str]:
    """The command line of a worker in `num_ranks` processes (torchrun when > 1)."""
    cmd = ["-m", "tasks.policy.worker", *args]
    if num_ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_ranks}", *cmd]
    return [sys.executable, *cmd]


# ---------------------------------------------------------------------------- the client


class WorkerError(RuntimeError):
    """The worker died, timed out, broke the protocol or failed fatally: it is gone.
    Start a new one from the last checkpoint dir."""


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(d)] = (int(fields[1]), fields[0])
    return table


def live_descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun's ranks run in sessions of their own, so a
    process-group kill would miss them)."""
    table = _process_table()
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, state) in table.items():
            if ppid == parent and state not in "ZX":
                out.append(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    state = _process_table().get(pid, (0, "X"))[1]
    return state not in "ZX"


def _kill_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End the worker and everything it started: SIGTERM (torchrun passes it on to its ranks),
    then SIGKILL what is left. Only the processes found below our own child."""
    if proc.stdin and not proc.stdin.closed:
        try:
            proc.stdin.close()  # end of input: a worker between requests stops by itself
        except OSError:
            pass
    pids = [proc.pid, *live_descendants(proc.pid)] if proc.poll() is None else live_descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        left = [p for p in pids if (proc.poll() is None if p == proc.pid else alive(p))]
        if not left:
            break
        for p in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(
                (proc.poll() is None if p == proc.pid else alive(p)) for p in left):
            time.sleep(0.05)
    proc.wait()


class TrainerWorker:
    """Client of a persistent trainer worker (see the module docstring for the protocol).

        with TrainerWorker(model_dir, cfg) as w:
            metrics = w.train_step(traj_path, adv_path, out_dir, policy_version=1)

    num_ranks: None = cfg.optimizer.num_ranks (torchrun when > 1). The worker's stderr
    (all ranks) goes to `log_path` (a temp file unless given). Errors: BadBatchError for
    rejected input and UpdateAborted for a non-finite update (the worker goes on, state
    unchanged); WorkerError when the worker is gone (died, timed out, fatal error).
    """

    def __init__(self, model_dir, cfg: RunConfig, num_ranks: int | None = None, precision: str | None = None, *,
                 reference_dir=None, fresh_optimizer: bool = False, log_path=None, start_timeout: float = 600.0,
                 env: dict | None = None, mode: str = "grpo"):
        self.mode = mode
        # Absolute paths: the worker runs in the repository root, not in the caller's directory.
        self.model_dir, self.cfg, self.precision = Path(model_dir).absolute(), cfg, precision
        self.num_ranks = num_ranks or cfg.optimizer.num_ranks
        self.reference_dir = Path(reference_dir).absolute() if reference_dir is not None else None
        self.fresh_optimizer = fresh_optimizer
        self.log_path = Path(log_path).absolute() if log_path else None
        self.start_timeout, self.env = start_timeout, env
        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None
        self.policy_version: int | None = None
        self._lines: queue.Queue = queue.Queue()
        self._lock = threading.Lock()

    # -- life cycle

    def start(self) -> TrainerWorker:
        """Launch the worker and wait until it has loaded its model."""
        return self.launch().wait_ready()

    def launch(self) -> TrainerWorker:
        """Start the worker's process and return at once: it loads its model while the caller does
        other work (a run's first rollouts); `wait_ready`, or the first request, waits for it."""
        if self.proc is not None:
            raise RuntimeError("worker already started")
        root = Path(__file__).resolve().parents[2]
        self._tmp = tempfile.TemporaryDirectory(prefix="rlvr-worker-")
        config = Path(self._tmp.name) / "run.json"
        config.write_text(self.cfg.model_dump_json())
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="rlvr-trainer-worker-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        args = ["--mode", self.mode, "--model", str(self.model_dir), "--config", str(config)]
        args += ["--reference", str(self.reference_dir)] if self.reference_dir is not None else []
        args += ["--precision", self.precision] if self.precision else []
        args += ["--fresh-optimizer"] if self.fresh_optimizer else []
        env = {**os.environ, **(self.env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as logf:
            # A session of its own: a terminal's Ctrl-C reaches the client, which then stops the worker.
            self.proc = subprocess.Popen(
                worker_command(args, self.num_ranks), cwd=root, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, text=True, start_new_session=True)
        self._launched_at = time.monotonic()
        # Killed on garbage collection / interpreter exit if nobody stopped it.
        self._finalizer = weakref.finalize(self, _kill_tree, self.proc, 2.0)
        threading.Thread(target=self._read_stdout, args=(self.proc.stdout, self._lines), daemon=True).start()
        log.info("trainer worker pid %s (%d ranks), log %s", self.proc.pid, self.num_ranks, self.log_path)
        return self

    def wait_ready(self) -> TrainerWorker:
        """Wait (start_timeout from the launch) until the worker has loaded its model; a worker that
        failed to is killed and named."""
        if self.ready is not None:
            return self
        if self.proc is None:
            raise RuntimeError("worker not launched")
        try:
            ready = self._receive(self.start_timeout, "start-up", since=self._launched_at)
            if not ready.get("ok"):
                raise WorkerError(f"trainer worker failed to load {self.model_dir}: {ready.get('error_type')}: "
                                  f"{ready.get('message')}\n{self.log_tail()}")
        except BaseException:
            self.kill()
            raise
        self.ready, self.policy_version = ready, ready["policy_version"]
        return self

    def stop(self, timeout: float = 300.0) -> dict | None:
        """Ask the worker to stop (it writes optimizer.pt into the latest checkpoint dir if an
        update skipped it), wait for it, then make sure the whole tree is gone. Returns the reply."""
        if self.proc is None:
            return None
        reply = None
        try:
            if self.proc.poll() is None and self.ready is not None:  # still loading: nothing to save
                reply = self._request({"op": "stop"}, timeout, "stop")
                self.proc.wait(timeout)
        finally:
            self.kill()
        return reply

    def kill(self) -> None:
        """End the worker now (SIGTERM, then SIGKILL), torchrun ranks included."""
        if self.proc is not None:
            self._finalizer()  # runs _kill_tree once
            self._tmp.cleanup()

    def __enter__(self) -> TrainerWorker:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.stop()
        else:  # an error or Ctrl-C: do not wait on a worker that may be mid-update
            self.kill()

    def pids(self) -> list[int]:
        """The worker and its descendants (torchrun ranks), while it runs."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return [self.proc.pid, *live_descendants(self.proc.pid)]

    def log_tail(self, chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- tail of {self.log_path} ---\n{text[-chars:]}"

    # -- requests

    def train_step(self, trajectories_path, advantages_path, out_dir, policy_version: int | None = None,
                   optimizer_steps: int | None = None, *, save_optimizer: bool = True,
                   timeout: float | None = None) -> dict:
        """One GRPO update in the worker (a `grpo` request: `_handle_grpo`, then
        `PolicyTrainer.grpo_update`); returns its metrics. save_optimizer=False skips writing
        optimizer.pt (the AdamW state stays in memory; stop() writes it into the latest dir)."""
        reply = self._request({"op": "grpo", "trajectories": os.path.abspath(trajectories_path),
                               "advantages": os.path.abspath(advantages_path), "out": os.path.abspath(out_dir),
                               "policy_version": policy_version, "optimizer_steps": optimizer_steps,
                               "save_optimizer": save_optimizer}, timeout, "update")
        metrics = self._result(reply)
        self.policy_version = metrics["policy_version"]
        return metrics

    def sft(self, demonstrations_path, out_dir, stage, *, max_steps: int | None = None, policy_version: int = 0,
            model_dir=None, timeout: float | None = None) -> dict:
        """One warm-start stage (schemas/recipe.py: SFTStage) of `model_dir` (default: the worker's --model)
        on the demonstrations into `out_dir` (an `sft` worker); its progress lines go to our stderr as
        they come. Returns its metrics."""
        reply = self._request({"op": "sft", "demonstrations": os.path.abspath(demonstrations_path),
                               "out": os.path.abspath(out_dir), "stage": stage.model_dump(),
                               "max_steps": max_steps, "policy_version": policy_version,
                               "model": os.path.abspath(model_dir) if model_dir else None}, timeout, "warm start")
        return self._result(reply)

    def _result(self, reply: dict) -> dict:
        """The metrics of a reply, or its error as BadBatchError / UpdateAborted / WorkerError (one format for all ops)."""
        if reply.get("ok"):
            return reply["metrics"]
        from tasks.policy.batch import BadBatchError
        from tasks.policy.runtime import UpdateAborted

        kind, msg = reply.get("error_type"), reply.get("message")
        if reply.get("fatal"):
            self.kill()
            raise WorkerError(f"trainer worker failed and exited: {kind}: {msg}\n{self.log_tail()}")
        if kind == "UpdateAborted":
            raise UpdateAborted(msg)
        raise BadBatchError(f"{kind}: {msg}")

    def _request(self, req: dict, timeout: float | None, what: str) -> dict:
        self.wait_ready()
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                raise WorkerError(f"trainer worker is not running\n{self.log_tail() if self.log_path else ''}")
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except OSError:  # broken pipe: it died; _receive reports how
                pass
            return self._receive(timeout, what)

    @staticmethod
    def _read_stdout(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    def _receive(self, timeout: float | None, what: str, since: float | None = None) -> dict:
        """The next reply, within `timeout` seconds of `since` (default: now)."""
        deadline = None if timeout is None else (since or time.monotonic()) + timeout
        while True:
            try:
                line = self._lines.get(timeout=1.0 if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    self.kill()
                    raise WorkerError(f"no reply from the trainer worker within {timeout} s ({what}); "
                                      f"killed it\n{self.log_tail()}") from None
                continue
            if line is None:  # stdout closed: the worker is gone
                try:
                    code = self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    code = None
                self.kill()
                raise WorkerError(f"trainer worker exited (code {code}) during {what}\n{self.log_tail()}")
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and msg.get("op") == "progress":
                print(msg.get("text", ""), file=sys.stderr, flush=True)
                continue
            if isinstance(msg, dict) and "ok" in msg:
                return msg
            log.warning("trainer worker wrote a non-protocol line to stdout: %r", line[:200])


if __name__ == "__main__":
    sys.exit(main())
