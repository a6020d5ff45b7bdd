"""Configuration: presets validate, overrides apply, and bad values fail before anything starts."""

import pytest

from schemas.presets import PRESETS, RECIPES, ConfigError, load_config, load_recipe, parse_overrides


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate(name):
    cfg = load_config(name)
    assert cfg.preset == name and cfg.grpo.global_batch_size >= 2


def test_overrides_apply_with_types():
    cfg = load_config("mini", ["grpo.prompts_per_step=4", "seed=7", "sandbox.backend=docker",
                               "agent.training.temperature=0.7"])
    assert (cfg.grpo.prompts_per_step, cfg.seed, cfg.sandbox.backend, cfg.agent.training.temperature) == \
        (4, 7, "docker", 0.7)


@pytest.mark.parametrize("override,needle", [
    (["grpo.generations_per_prompt=1"], "grpo.generations_per_prompt"),
    (["sandbox.backend=podman"], "sandbox.backend"),
    (["agent.max_turn=3"], "agent.max_turn"),
    (["eval.samples_per_task=2"], "samples_per_task (2) must be >= k (4)"),
    (["agent.max_context_tokens=100000"], "exceeds inference.max_model_len"),
    (["grpo.prompts_per_step"], "not of the form"),
    (["agent.training.temperature=0"], "agent.training.temperature (0.0) must be > 0"),
    # Loss-option pairings, checked once when the config is built (the loss no longer checks them).
    (["grpo.use_importance_sampling_correction=false"], "needs use_importance_sampling_correction"),
    (["grpo.truncated_importance_sampling_type=icepop", "grpo.truncated_importance_sampling_ratio_min=null"],
     "needs truncated_importance_sampling_ratio and truncated_importance_sampling_ratio_min set"),
    (["grpo.ratio_clip_c=1"], "ratio_clip_c must be > 1"),
    (['inference.speculative_config={"method": "ngram", "num_speculative_tokens": 4}'],
     "inference.speculative_config on CPU"),
])
def test_invalid_values_fail_clearly(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("mini", override)
    assert needle in str(e.value)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_config("huge")


@pytest.mark.parametrize("override,field", [
    ("grpo.prompts_per_step=true", "grpo.prompts_per_step"),  # ran as 1 before
    ("sandbox.cpus=false", "sandbox.cpus"),
    ("optimizer.lr=true", "optimizer.lr"),  # float | None
    ("optimizer.betas=[true, 0.9]", "optimizer.betas"),
    ("agent.validation.max_tokens_per_turn=true", "agent.validation.max_tokens_per_turn"),  # nested twice
])
def test_booleans_are_not_numbers(override, field):
    with pytest.raises(ConfigError) as e:
        load_config("mini", [override])
    assert f"{field}: " in str(e.value) and "not booleans" in str(e.value)


def test_json_numbers_and_lists_still_coerce():
    cfg = load_config("mini", ["sandbox.cpus=2", "optimizer.lr=1", "optimizer.betas=[0.9, 0.95]",
                               "inference.enforce_eager=true", "grpo.normalize_rewards=false"])
    assert cfg.sandbox.cpus == 2.0 and isinstance(cfg.sandbox.cpus, float) and cfg.optimizer.lr == 1.0
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.inference.enforce_eager is True
    assert cfg.grpo.normalize_rewards is False
    with pytest.raises(ValueError, match="takes numbers, not booleans"):
        cfg.grpo.prompts_per_step = True  # assignment is validated too


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_validate_and_unroll_into_their_stages(name):
    from schemas.recipe import stages

    recipe = load_recipe(name)
    names = [s.name for s in stages(recipe)]
    assert names[0] == "warm start" and len(names) == 1 + recipe.restart_cycles + bool(recipe.habit_steps) \
        + bool(recipe.clean_steps)


def test_the_recipe_is_make_bases_not_the_runs():
    with pytest.raises(ConfigError, match=r"sft\.\* is the warm-start recipe .*make base"):
        load_config("smoke", ["sft.max_steps=5"])
    assert load_recipe("smoke", parse_overrides(["sft.max_steps=5"])["sft"]).max_steps == 5
    with pytest.raises(ConfigError, match="sft.max_steps: .*not booleans"):
        load_recipe("smoke", {"max_steps": True})
    with pytest.raises(ConfigError, match="sft.demonstrations_per_task=0 needs sft.pool_tasks"):
        load_recipe("smoke", {"demonstrations_per_task": 0})
    with pytest.raises(ConfigError, match="preset 'qwen35_397b_grpo' has no warm-start recipe"):
        load_recipe("qwen35_397b_grpo")
