"""MLPerf logging: the reference preset meets every closed-division constant; logs pass the official checker."""

import math

import pytest
from mlperf_logging.mllog import constants as C

from schemas.presets import load_config
from tasks.mlperf import RunLog, check, deviations, first_eval_samples, hyperparameters


def test_reference_preset_meets_closed_division_constants():
    cfg = load_config("qwen35_397b_grpo")
    hp = hyperparameters(cfg)
    gbs = hp["global_batch_size"]
    assert hp["num_generations_per_prompt"] == 16
    assert gbs == hp["num_prompts_per_step"] * 16
    assert hp["max_sequence_length"] == 65536 and hp["eval_samples"] == 251 and hp["init_checkpoint_step"] == 0
    assert hp["opt_name"] == "adamw"
    assert abs(hp["opt_base_learning_rate"] - 1e-6 * math.sqrt(gbs / 256)) < 1e-12
    assert abs(hp["opt_gradient_clip_norm"] - 0.125 * math.sqrt(256 / gbs)) < 1e-12
    assert (hp["opt_adamw_beta_1"], hp["opt_adamw_beta_2"], hp["opt_adamw_epsilon"]) == (0.9, 0.999, 1e-8)
    assert hp["opt_adamw_weight_decay"] == 0.0 and hp["opt_learning_rate_warmup_steps"] == 0
    assert hp["opt_learning_rate_decay_schedule"] == "constant"
    assert (hp["generation_training_rollout_temperature"], hp["generation_training_rollout_top_p"]) == (1.0, 1.0)
    assert (hp["generation_validation_rollout_temperature"], hp["generation_validation_rollout_top_p"]) == (0.1, 0.95)
    # the reference's other fixed choices (mlcommons/training llm_post_training: NeMo-RL ClippedPGLossFn)
    g = cfg.grpo
    assert (g.ratio_clip_min, g.ratio_clip_max, g.reference_policy_kl_penalty) == (0.2, 0.28, 0.0)
    assert g.leave_one_out_baseline and g.normalize_rewards and g.token_level_loss
    assert (g.truncated_importance_sampling_type, g.truncated_importance_sampling_ratio_min,
            g.truncated_importance_sampling_ratio) == ("seq-mask-tis", 0.999, 1.002)
    assert g.max_trajectory_age == 1 and g.async_rollouts
    # closed-division eval schedule: first eval at GBS * ceil(2.5 + 3840/GBS) samples = step 18 at GBS 256
    assert cfg.eval.start_step * gbs == first_eval_samples(gbs)
    assert deviations(cfg) == ["tasks are the generated mini benchmark, not R2E-Gym"] or deviations(cfg) == []


@pytest.mark.parametrize("gbs", [256, 512, 1024])
def test_scaled_batch_sizes_follow_the_formulas(gbs):
    cfg = load_config("qwen35_397b_grpo", [f"grpo.prompts_per_step={gbs // 16}"])
    hp = hyperparameters(cfg)
    assert abs(hp["opt_base_learning_rate"] - 1e-6 * (gbs / 256) ** 0.5) < 1e-9
    assert abs(hp["opt_gradient_clip_norm"] - 0.125 * (256 / gbs) ** 0.5) < 1e-9


def _write_log(path, cfg, division, accuracies):
    log = RunLog(str(path), division=division)
    log.header(cfg)
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    gbs = cfg.grpo.global_batch_size
    samples = first_eval_samples(gbs)
    for acc in accuracies:
        log.start(C.BLOCK_START, metadata={"samples_count": samples - gbs, "first_epoch_num": 0, "epoch_count": 1})
        log.end(C.BLOCK_STOP, metadata={"samples_count": samples, "first_epoch_num": 0})
        log.start(C.EVAL_START, metadata={"samples_count": samples})
        log.event(C.EVAL_ACCURACY, acc, metadata={"samples_count": samples})
        log.end(C.EVAL_STOP, metadata={"samples_count": samples})
        samples += gbs
    log.end(C.RUN_STOP, metadata={"status": "success" if max(accuracies) > 0.69 else "aborted"})
    log.close()


def test_checker_accepts_closed_log_and_rejects_a_miss(tmp_path):
    cfg = load_config("qwen35_397b_grpo")
    _write_log(tmp_path / "ok.log", cfg, "closed", [0.61, 0.7])
    ok, out = check(str(tmp_path / "ok.log"))
    assert ok, out
    _write_log(tmp_path / "miss.log", cfg, "closed", [0.61, 0.65])
    ok, out = check(str(tmp_path / "miss.log"))
    assert not ok


def test_checker_rejects_wrong_closed_hyperparameter(tmp_path):
    cfg = load_config("qwen35_397b_grpo", ["optimizer.lr=3e-6"])
    _write_log(tmp_path / "bad.log", cfg, "closed", [0.7])
    ok, out = check(str(tmp_path / "bad.log"))
    assert not ok and "opt_base_learning_rate" in out
