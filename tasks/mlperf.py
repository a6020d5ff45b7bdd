"""MLPerf Training logging for `qwen35_397b_grpo` (mlperf_logging.mllog), and the compliance check.

`hyperparameters(cfg)` is the one place that maps our configuration onto the
benchmark's keys; `RunLog` writes them and the timed-run events to a log file
in mllog's format; `check(path)` runs the official compliance checker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import uuid

from mlperf_logging.mllog.mllog import MLLogger
from mlperf_logging.mllog import constants as C

BENCHMARK = "qwen35_397b_grpo"
EVAL_SAMPLES = 251
MAX_SEQUENCE_LENGTH = 65536


def hyperparameters(cfg) -> dict:
    """The benchmark's hyperparameter keys for a RunConfig, as the checker reads them.

    Fixed benchmark facts (eval_samples, max_sequence_length) are logged as the benchmark
    defines them: a preset that evaluates on fewer tasks or a shorter context is not a
    compliant run, and `deviations(cfg)` says so.
    """
    gbs = cfg.grpo.global_batch_size
    cpu = cfg.inference.device == "cpu"
    precision = "bfloat16" if (cfg.optimizer.precision or ("fp32" if cpu else "bf16")) == "bf16" else "fp32"
    micro = max(1, cfg.optimizer.micro_batch_tokens // max(1, cfg.agent.max_context_tokens))
    return {
        "global_batch_size": gbs,
        "num_prompts_per_step": cfg.grpo.prompts_per_step,
        "num_generations_per_prompt": cfg.grpo.generations_per_prompt,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "eval_samples": EVAL_SAMPLES,
        "train_samples": cfg.dataset.num_train,
        "init_checkpoint_step": 0,
        "max_steps": cfg.max_steps,
        "opt_name": cfg.optimizer.name,
        "opt_base_learning_rate": cfg.effective_lr,
        "opt_adamw_beta_1": cfg.optimizer.betas[0],
        "opt_adamw_beta_2": cfg.optimizer.betas[1],
        "opt_adamw_epsilon": cfg.optimizer.eps,
        "opt_adamw_weight_decay": cfg.optimizer.weight_decay,
        "opt_gradient_clip_norm": cfg.effective_grad_clip,
        "opt_learning_rate_warmup_steps": 0,
        "opt_learning_rate_decay_schedule": "constant",
        "generation_training_rollout_temperature": cfg.agent.training.temperature,
        "generation_training_rollout_top_p": cfg.agent.training.top_p,
        "generation_validation_rollout_temperature": cfg.agent.validation.temperature,
        "generation_validation_rollout_top_p": cfg.agent.validation.top_p,
        "lowest_numerical_precision_in_linear": precision,
        "lowest_numerical_precision_in_attn": precision,
        "lowest_numerical_precision_in_comm": precision,
        "tensor_parallelism": cfg.inference.tensor_parallel_size,
        "pipeline_parallelism": 1,
        "context_parallelism": 1,
        "expert_parallelism": cfg.inference.tensor_parallel_size if cfg.inference.enable_expert_parallel else 1,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": max(1, math.ceil(gbs / micro)),
        "config_filename": f"{cfg.preset}.json",
    }


def deviations(cfg) -> list[str]:
    """Where a configuration departs from the benchmark's fixed definition (open-division notes)."""
    out = []
    if cfg.dataset.num_validation != EVAL_SAMPLES:
        out.append(f"validation set has {cfg.dataset.num_validation} tasks, the benchmark {EVAL_SAMPLES}")
    if cfg.agent.max_context_tokens != MAX_SEQUENCE_LENGTH:
        out.append(f"context is {cfg.agent.max_context_tokens} tokens, the benchmark {MAX_SEQUENCE_LENGTH}")
    if cfg.dataset.source != "r2e":
        out.append("tasks are the generated mini benchmark, not R2E-Gym")
    return out


def first_eval_samples(gbs: int) -> int:
    """Closed division: the first evaluation happens at GBS * ceil(2.5 + 3840 / GBS) samples, then every GBS."""
    return gbs * math.ceil(2.5 + 3840 / gbs)


class RunLog:
    """One run's MLPerf log file. Appends, so a resumed run continues the same log."""

    def __init__(self, path: str, division: str = "open", org: str = "rlvr-flows", platform: str = "cpu"):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # A logger of our own per file: mllog's shared default would mix concurrent runs.
        self._logger = logging.getLogger(f"rlvr.mlperf.{uuid.uuid4().hex}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(path, mode="a")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)
        self.ml = MLLogger(logger=self._logger, default_stack_offset=2)
        self.division, self.org, self.platform = division, org, platform

    # time_ms: when the event happened, if not now (offline evaluation: run_stop is the passing
    # checkpoint's weight-update time, logged after the evaluations that found it).
    def event(self, key, value=None, metadata=None, time_ms=None):
        self.ml.event(key=key, value=value, metadata=metadata, time_ms=time_ms)
        self._handler.flush()

    def start(self, key, value=None, metadata=None, time_ms=None):
        self.ml.start(key=key, value=value, metadata=metadata, time_ms=time_ms)
        self._handler.flush()

    def end(self, key, value=None, metadata=None, time_ms=None):
        self.ml.end(key=key, value=value, metadata=metadata, time_ms=time_ms)
        self._handler.flush()

    def header(self, cfg):
        self.event(C.CACHE_CLEAR, True)
        self.start(C.INIT_START)
        self.event(C.SUBMISSION_BENCHMARK, BENCHMARK)
        self.event(C.SUBMISSION_ORG, self.org)
        self.event(C.SUBMISSION_DIVISION, self.division)
        self.event(C.SUBMISSION_STATUS, "research")
        self.event(C.SUBMISSION_PLATFORM, self.platform)
        self.event(C.SEED, cfg.seed)
        for k, v in hyperparameters(cfg).items():
            self.event(k, v)

    def close(self):
        self._logger.removeHandler(self._handler)
        self._handler.close()


def check(path: str, ruleset: str = "6.1.0") -> tuple[bool, str]:
    """Run the official compliance checker on a log; returns (passed, its output)."""
    # The checker writes compliance_checker.log into its working directory: give it a throwaway one.
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                               "--ruleset", ruleset, os.path.abspath(path)], capture_output=True, text=True,
                              timeout=300, cwd=cwd)
    out = proc.stdout + proc.stderr
    return proc.returncode == 0 and "SUCCESS" in out, out


def read_log_times(text: str) -> dict:
    """run_start/run_stop times (ms), the time to train in seconds (None while the run is open), the
    evaluations, and the blocks started but not stopped (first_epoch_num: a killed attempt's step)."""
    out: dict = {"evals": [], "blocks_open": set()}
    for line in text.splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        rec = json.loads(line[len(":::MLLOG "):])
        if rec["key"] == "run_start":
            out["run_start_ms"] = rec["time_ms"]
        elif rec["key"] == "run_stop":
            out["run_stop_ms"] = rec["time_ms"]
            out["status"] = rec["metadata"].get("status")
        elif rec["key"] == "block_start":
            out["blocks_open"].add(rec["metadata"].get("first_epoch_num"))
        elif rec["key"] == "block_stop":
            out["blocks_open"].discard(rec["metadata"].get("first_epoch_num"))
        elif rec["key"] == "eval_accuracy":
            out["evals"].append((rec["metadata"].get("samples_count"), rec["value"]))
    if "run_start_ms" in out and "run_stop_ms" in out:
        out["run_seconds"] = (out["run_stop_ms"] - out["run_start_ms"]) / 1000
    return out


def offline_clock(order: str) -> str:
    """Where an order's evaluations stand against MLPerf's clock (run_stop is the passing checkpoint's update)."""
    if order == "between_steps":
        return "between steps while training waited (a failing one's minutes count in the clock of later checkpoints)"
    return "outside the timed interval"


def rules_report(cfg, store, run_id: str) -> list[dict]:
    """Each closed-division rule that applies to a run, whether this run satisfies it, and the
    evidence (a count, a key, a value): what a submitter otherwise checks by hand."""
    import pyarrow.compute as pc

    from tasks.evaluation import describe_luck, run_luck
    from tasks.grpo.advantages import MASK_ZERO_VARIANCE, MASKED_FINISH_REASONS

    out = []

    def rule(name: str, ok: bool, evidence: str) -> None:
        out.append({"rule": name, "ok": bool(ok), "evidence": evidence})

    gbs, hp = cfg.grpo.global_batch_size, hyperparameters(cfg)
    closed = {"num_generations_per_prompt": 16, "opt_base_learning_rate": 1e-6 * math.sqrt(gbs / 256),
              "opt_gradient_clip_norm": 0.125 * math.sqrt(256 / gbs), "opt_adamw_beta_1": 0.9,
              "opt_adamw_beta_2": 0.999, "opt_adamw_epsilon": 1e-8, "opt_adamw_weight_decay": 0.0,
              "opt_learning_rate_warmup_steps": 0, "generation_training_rollout_temperature": 1.0,
              "generation_training_rollout_top_p": 1.0, "generation_validation_rollout_temperature": 0.1,
              "generation_validation_rollout_top_p": 0.95}
    off = [f"{k} {hp[k]:g} (closed {v:g})" for k, v in closed.items() if not math.isclose(hp[k], v, rel_tol=1e-9)]
    rule("hyperparameters are the closed-division constants", not off, "; ".join(off) or f"{len(closed)} keys match")
    rule("validation set of 251 tasks, 65,536-token context, R2E-Gym tasks", not deviations(cfg),
         "; ".join(deviations(cfg)) or "as the benchmark defines them")
    first = first_eval_samples(gbs)
    every = cfg.eval.offline_search == "step_order" if cfg.eval.mode == "offline" else cfg.eval.every_steps == 1
    rule("first evaluation at GBS * ceil(2.5 + 3840 / GBS) samples, then every step",
         cfg.eval.start_step * gbs == first and every,
         f"first at {cfg.eval.start_step * gbs} samples (step {cfg.eval.start_step}), closed {first}; "
         + (f"offline search {cfg.eval.offline_search}, order {cfg.eval.offline_order}" if cfg.eval.mode == "offline"
            else f"every {cfg.eval.every_steps} step(s)"))
    timeouts = {"agent.episode_timeout_s": (cfg.agent.episode_timeout_s, 1800),
                "sandbox.test_timeout_s": (cfg.sandbox.test_timeout_s, 60),
                "agent.command_timeout_s": (cfg.agent.command_timeout_s, 60)}
    bad = [f"{k} {v:g} (rule {want})" for k, (v, want) in timeouts.items() if v != want]
    rule("timeouts (#598): agent 1,800 s, tests 60 s, commands 60 s", not bad, "; ".join(bad) or "as the rule sets them")
    rule("the closed quality measure: k samples of every task (no early stop)", not cfg.eval.early_stop,
         "early stop (same pass@k distribution, fewer episodes)" if cfg.eval.early_stop else "k samples per task")

    steps = 0
    while store.exists(f"runs/{run_id}/checkpoints/step-{steps + 1:05d}.commit"):
        steps += 1
    start = max(1, cfg.eval.start_step)
    stamped = [s for s in range(start, steps + 1)
               if store.get_json(f"runs/{run_id}/checkpoints/step-{s:05d}.commit").get("weight_update_end_unix")]
    window = list(range(start, steps + 1))
    rule("offline evaluation (#596): a checkpoint with its weight-update time after every step from the first "
         "evaluation", cfg.eval.mode == "offline" and stamped == window,
         f"mode {cfg.eval.mode}; {len(stamped)} of {len(window)} checkpoints (steps {start}-{steps}) stamped")
    log_key = f"runs/{run_id}/mlperf.log"
    result_key = f"runs/{run_id}/offline_eval.json"
    if cfg.eval.mode == "offline" and store.exists(result_key) and store.exists(log_key):
        result = store.get_json(result_key)
        stop = [json.loads(ln[9:]) for ln in store.get_bytes(log_key).decode().splitlines()
                if ln.startswith(":::MLLOG") and '"run_stop"' in ln]
        want = int(1000 * result["weight_update_end_unix"])
        rule("run_stop is the passing checkpoint's weight-update time, its write excluded",
             bool(stop) and stop[-1]["time_ms"] == want,
             f"checkpoint {result['passed_step']}: run_stop {stop[-1]['time_ms'] if stop else None}, update {want}")

    luck = run_luck(store, run_id, range(1, steps + 1), cfg.eval.target)
    if luck is not None:  # reported beside the rules: no rule bounds it
        out.append({"rule": "luck risk of the pass", "ok": True, "info": True, "evidence": describe_luck(luck)})

    dropped = truncated = truncated_unmasked = infra = infra_unmasked = env = 0
    env_by_task: dict[str, set] = {}
    for s in range(1, steps + 1):
        if not store.stage_committed(run_id, s, "advantages"):
            continue
        adv = store.read_stage(run_id, s, "advantages", columns=["rollout_id", "masked", "mask_reason"])
        traj = store.read_stage(run_id, s, "trajectories", columns=["rollout_id", "finish_reason"])
        masked = dict(zip(adv["rollout_id"].to_pylist(), adv["masked"].to_pylist()))
        dropped += pc.sum(pc.equal(adv["mask_reason"], MASK_ZERO_VARIANCE)).as_py() or 0
        for rid, reason in zip(traj["rollout_id"].to_pylist(), traj["finish_reason"].to_pylist()):
            if reason in ("timeout", "context_limit"):
                truncated += 1
                truncated_unmasked += not masked.get(rid, False)
            elif reason in MASKED_FINISH_REASONS:
                infra += 1
                infra_unmasked += not masked.get(rid, False)
        rew = store.read_stage(run_id, s, "rewards", columns=["rollout_id", "instance_id", "grading_status"])
        for rid, iid, st in zip(rew["rollout_id"].to_pylist(), rew["instance_id"].to_pylist(),
                                rew["grading_status"].to_pylist()):
            env_by_task.setdefault(iid, set()).add(st == "env_error")
            if st != "graded":
                infra += 1
                env += st == "env_error"
                infra_unmasked += not masked.get(rid, False)
    # Tasks whose every grading in the run was an environment error: their tests never ran.
    lost = sorted(iid for iid, seen in env_by_task.items() if seen == {True})
    rule("every eligible sequence trained (#597): no dynamic filtering of groups",
         not cfg.grpo.filter_zero_variance_groups and dropped == 0,
         f"{dropped} samples dropped by the zero-variance filter in {steps} steps")
    rule("truncated rollouts are masked, not zeroed", truncated_unmasked == 0,
         f"{truncated} rollouts cut by a timeout or the context limit, {truncated_unmasked} of them not masked")
    rule("infrastructure failures are never scored as the model's 0", infra_unmasked == 0,
         f"{infra} rollouts or gradings failed for infrastructure reasons ({env} environment errors), "
         f"{infra_unmasked} of them not masked"
         + (f"; tasks whose tests never ran: {', '.join(lost[:10])}{' ...' if len(lost) > 10 else ''}" if lost else ""))
    return out
