"""Policy checkpoints: Hugging Face safetensors directories that vLLM can load as they are.

A checkpoint dir holds `config.json`, `generation_config.json`, `model.safetensors`,
the tokenizer files of its parent (when it had them), `rlvr_version.json` (which
policy version this is and where it came from) and, for GRPO steps,
`optimizer.pt` (AdamW moments, so the next step continues the same optimizer).
It is written to a temporary sibling and renamed into place: a reader never sees
half a checkpoint, and a failed update leaves no new directory behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

VERSION_FILE = "rlvr_version.json"
OPTIMIZER_FILE = "optimizer.pt"
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "chat_template*", "*.tiktoken")


def load_policy(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The Hugging Face causal LM saved in `path` (fp32 master weights by default)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


def read_policy_version(path: str | os.PathLike) -> int:
    """The policy version recorded in a checkpoint dir; 0 for a dir we did not write."""
    f = Path(path) / VERSION_FILE
    return int(json.loads(f.read_text())["policy_version"]) if f.exists() else 0


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copy of the weights. Collective under FSDP2: every rank must call it;
    only rank 0 gets the tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded optimizer state keyed by parameter name (collective under FSDP2, rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> bool:
    """Restore AdamW state saved next to a checkpoint; False when there is none.
    Collective under FSDP2 (rank 0 reads the file and broadcasts)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    f = Path(path) / OPTIMIZER_FILE
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    present = f.exists()
    if distributed:  # every rank must take the same branch
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([int(present)], device=on)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        present = bool(flag.item())
    if not present:
        return False
    rank0 = not distributed or dist.get_rank() == 0
    state = torch.load(f, map_location="cpu", weights_only=True) if rank0 else {}
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed))
    return True


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for f in sorted(Path(src).glob(pattern)):
            if f.is_file():
                shutil.copy2(f, Path(dst) / f.name)
                copied.append(f.name)
    return copied


def save_policy(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    policy_version: int,
    source_dir: str | os.PathLike | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
    info: dict | None = None,
) -> Path:
    """Write a checkpoint dir atomically (rank 0 only; gather `state_dict` first under FSDP2).

    An existing `out_dir` (an earlier attempt at the same version) is replaced.
    """
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
        if source_dir is not None:
            copy_tokenizer_files(source_dir, tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        meta = {"policy_version": int(policy_version), "created_unix": time.time(),
                "parent": str(source_dir) if source_dir is not None else None,
                "parent_version": read_policy_version(source_dir) if source_dir is not None else None}
        (tmp / VERSION_FILE).write_text(json.dumps({**meta, **(info or {})}, indent=1, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
