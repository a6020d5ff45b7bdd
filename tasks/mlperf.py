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
    precision = "fp32" if cfg.inference.device == "cpu" else "bfloat16"
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

    def event(self, key, value=None, metadata=None):
        self.ml.event(key=key, value=value, metadata=metadata)
        self._handler.flush()

    def start(self, key, value=None, metadata=None):
        self.ml.start(key=key, value=value, metadata=metadata)
        self._handler.flush()

    def end(self, key, value=None, metadata=None):
        self.ml.end(key=key, value=value, metadata=metadata)
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
