"""GRPO loss options NeMo-RL refuses are refused when the config is built, not met as a silent no-op."""

import pytest
import torch

from schemas.config import GRPOConfig
from schemas.presets import ConfigError, load_config
from tasks.grpo.loss import clipped_pg_loss

NO_TIS = ["grpo.truncated_importance_sampling_type=null"]


@pytest.mark.parametrize("override,needle", [
    (["grpo.truncated_importance_sampling_type=tis", "grpo.truncated_importance_sampling_ratio_min=null",
      "grpo.truncated_importance_sampling_ratio=0"], "truncated_importance_sampling_ratio must be > 0, got 0.0"),
    (["grpo.truncated_importance_sampling_ratio_min=-2", "grpo.truncated_importance_sampling_ratio=-1"],
     "truncated_importance_sampling_ratio must be > 0, got -1.0"),
    (NO_TIS, "are set but truncated_importance_sampling_type is None"),
    (NO_TIS + ["grpo.truncated_importance_sampling_ratio=null"], "are set but truncated_importance_sampling_type"),
    (NO_TIS + ["grpo.truncated_importance_sampling_ratio_min=null"], "are set but truncated_importance_sampling_type"),
])
def test_refused_pairings_name_the_field_and_nemo_rl(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("mini", override)
    assert needle in str(e.value) and "NeMo-RL refuses it" in str(e.value)


def test_correction_off_needs_every_tis_field_null():
    cfg = load_config("mini", ["grpo.use_importance_sampling_correction=false", *NO_TIS,
                               "grpo.truncated_importance_sampling_ratio_min=null",
                               "grpo.truncated_importance_sampling_ratio=null"])
    assert cfg.grpo.truncated_importance_sampling_type is None and not cfg.grpo.use_importance_sampling_correction


def test_tis_ratio_zero_would_train_on_nothing():
    """Why the first pairing is refused: built unchecked, it makes every weight 0 and the loss 0."""
    cfg = GRPOConfig.model_construct(**{**GRPOConfig().model_dump(), "truncated_importance_sampling_type": "tis",
                                        "truncated_importance_sampling_ratio_min": None,
                                        "truncated_importance_sampling_ratio": 0.0})
    g = torch.Generator().manual_seed(0)
    curr = (-torch.rand(2, 5, generator=g)).requires_grad_(True)
    gen = curr.detach() + 0.01 * torch.randn(2, 5, generator=g)
    adv = torch.tensor([[1.0] * 5, [-1.0] * 5])
    ones = torch.ones(2, 5)
    loss, _ = clipped_pg_loss(curr, curr.detach(), gen, adv, ones, torch.ones(2), 10.0, 2.0, cfg)
    loss.backward()
    assert loss.item() == 0.0 and curr.grad.abs().max().item() == 0.0
    with pytest.raises(ValueError, match="must be > 0"):
        GRPOConfig(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio_min=None,
                   truncated_importance_sampling_ratio=0.0)
