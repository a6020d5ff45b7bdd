"""The frozen base checkpoint a run starts from, and its manifest.

MLPerf hands every submitter the same base checkpoint and times training from it. The
mini benchmark's base is built once by `make base` (flows/base.py) and shipped in the
repository (models/mini-base/): a Hugging Face checkpoint directory stored in bf16
(the trainer loads fp32 master weights from it, vLLM serves it at its own dtype) with a
`manifest.json` that says where it came from:

    format         "rlvr-base/1"
    built_by       the command and recipe that made it
    code_version   git commit of the code that built it
    dataset        {"id", "tasks_sha256", "num_tasks"}: the tasks it was trained for
    recipe         the config sections that built it (model, sft, agent prompt style)
    files          {name: {"sha256", "bytes"}} for every file the trainer and vLLM load
    evaluation     k, pass_at_k, pass_at_1, pass_hat_k on the validation split when frozen, the
                   sampling, and the machine it was measured on

`check_base` is what a run does before it starts: every listed file present with its
sha256, and the run's dataset the one the base was trained for. Each failure is a
`BaseCheckpointError` that names the file or both datasets.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

from schemas.presets import PermanentError

MANIFEST = "manifest.json"
FORMAT = "rlvr-base/1"
# What the trainer and vLLM read; optimizer state and our version file stay behind.
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


class BaseCheckpointError(PermanentError, ValueError):
    """The base checkpoint is incomplete, altered, or was built for another dataset."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(model_dir: str | os.PathLike) -> dict | None:
    """The manifest of a base checkpoint directory; None for a checkpoint without one (a real Qwen)."""
    f = pathlib.Path(model_dir) / MANIFEST
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text())
    except ValueError as e:
        raise BaseCheckpointError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BaseCheckpointError(f"{f}: unknown manifest format {m.get('format') if isinstance(m, dict) else m!r}, "
                                  f"expected {FORMAT!r}")
    return m


def weights_digest(manifest: dict) -> str:
    """A short id of the checkpoint's content (its files' hashes): what a cached evaluation is keyed by."""
    files = json.dumps(sorted((n, f["sha256"]) for n, f in manifest["files"].items()))
    return hashlib.sha256(files.encode()).hexdigest()[:12]


def check_files(model_dir: str | os.PathLike, manifest: dict) -> None:
    """Every file the manifest lists exists with its size and sha256."""
    root = pathlib.Path(model_dir)
    for name, want in sorted(manifest["files"].items()):
        f = root / name
        if not f.is_file():
            raise BaseCheckpointError(f"base checkpoint {root}: {name} is missing (listed in {MANIFEST})")
        if f.stat().st_size != want["bytes"] or sha256_file(f) != want["sha256"]:
            raise BaseCheckpointError(
                f"base checkpoint {root}: {name} does not match {MANIFEST} (sha256 {sha256_file(f)[:16]}..., "
                f"{f.stat().st_size} bytes; the manifest records {want['sha256'][:16]}..., {want['bytes']} bytes). "
                "Restore it (git checkout models/) or rebuild the base with `make base`.")


def check_dataset(model_dir: str | os.PathLike, manifest: dict, dataset_config: dict,
                  tasks_sha256: str | None = None) -> None:
    """The run's dataset is the one the base was trained for: the same dataset config before it is
    built, the same tasks (the table's sha256) after. The recorded id (a digest of the generator's
    code and the config: a cache key) is not compared, so an edit of the generator that changes no
    task (a rename, a comment) keeps the base, and one that changes a task is caught by the content."""
    rec = manifest["dataset"]
    recorded = rec.get("config") or {}
    differ = {k: (v, dataset_config.get(k)) for k, v in sorted(recorded.items()) if dataset_config.get(k) != v}
    if differ:
        raise BaseCheckpointError(
            f"base checkpoint {model_dir} was trained for dataset {rec['id']} with "
            + ", ".join(f"dataset.{k}={a!r}" for k, (a, _) in differ.items()) + ", but this run has "
            + ", ".join(f"dataset.{k}={b!r}" for k, (_, b) in differ.items()) + ". Use the dataset config the "
            "base was built for, rebuild the base with `make base`, or set model.path to a base built for it.")
    if tasks_sha256 is not None and rec["tasks_sha256"] != tasks_sha256:
        raise BaseCheckpointError(
            f"base checkpoint {model_dir} was trained for dataset {rec['id']} with tasks table sha256 "
            f"{rec['tasks_sha256']}, but this run's tasks table has sha256 {tasks_sha256}: the generator or the "
            "stored dataset changed. Rebuild the dataset from a clean store, or rebuild the base with `make base`.")


def freeze(src_dir: str | os.PathLike, out_dir: str | os.PathLike, provenance: dict) -> dict:
    """Write a base checkpoint to `out_dir`: the shipped files of `src_dir` with the weights in bf16,
    and a manifest of `provenance` (built_by, code_version, dataset, recipe) plus every file's hash.
    Replaces `out_dir`; returns the manifest."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = pathlib.Path(src_dir), pathlib.Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weights = load_file(str(src / "model.safetensors"))
        save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((src / "config.json").read_text())
        config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in SHIPPED_FILES:
            if name not in ("model.safetensors", "config.json") and (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        files = {f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size} for f in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, **provenance, "dtype": "bfloat16", "files": files, "evaluation": None}
        write_manifest(tmp, manifest)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def write_manifest(model_dir: str | os.PathLike, manifest: dict) -> None:
    path = pathlib.Path(model_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
