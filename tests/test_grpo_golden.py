"""Our GRPO loss and advantages against NeMo-RL's golden vectors (tests/data/golden: data only, with
their provenance in its README)."""

import json
import math
import os
import pathlib

import pytest
import torch

from schemas.config import GRPOConfig
from tasks.grpo import baseline_and_std, clipped_pg_loss, grpo_advantages

GOLDEN = pathlib.Path(os.environ.get("RLVR_GOLDEN_DIR", pathlib.Path(__file__).parent / "data" / "golden"))
REL, ABS = 1e-6, 1e-12

if not (GOLDEN / "grpo_loss_cases.json").exists():
    pytest.skip(f"golden vectors not found in {GOLDEN}", allow_module_level=True)

LOSS_CASES = json.loads((GOLDEN / "grpo_loss_cases.json").read_text())["cases"]
ADV_CASES = json.loads((GOLDEN / "grpo_advantage_cases.json").read_text())["cases"]
# NeMo-RL options we do not implement: every case must leave them at their defaults.
UNSUPPORTED_DEFAULTS = {"sequence_level_importance_ratios": False, "disable_ppo_ratio": False,
                        "use_on_policy_kl_approximation": False, "use_kl_in_reward": False,
                        "use_cispo": False, "positive_example_nll_weight": 0.0}


def close(got, want) -> bool:
    if math.isinf(want):
        return got == want
    return abs(got - want) <= max(REL * abs(want), ABS)


def assert_close(got: torch.Tensor, want, what: str):
    want = torch.tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = ~((got - want).abs() <= torch.clamp(REL * want.abs(), min=ABS))
    assert not bad.any(), f"{what}: first mismatch at {bad.nonzero()[0].tolist()}: {got[bad][0]} vs {want[bad][0]}"


@pytest.mark.parametrize("case", LOSS_CASES, ids=[c["name"] for c in LOSS_CASES])
def test_loss_matches_nemo_rl(case):
    lc = case["loss_config"]
    for k, v in UNSUPPORTED_DEFAULTS.items():
        assert lc.get(k, v) == v, f"case uses unsupported option {k}={lc[k]}"
    cfg = GRPOConfig(**{k: v for k, v in lc.items() if k in GRPOConfig.model_fields})
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["inputs"].items()
         if isinstance(v, list)}
    curr = t["curr_logprobs"].clone().requires_grad_(True)
    loss, metrics = clipped_pg_loss(
        curr, t["prev_logprobs"], t["generation_logprobs"], t["advantages"], t["token_mask"], t["sample_mask"],
        torch.tensor(case["inputs"]["global_valid_toks"], dtype=torch.float64),
        torch.tensor(case["inputs"]["global_valid_seqs"], dtype=torch.float64),
        cfg, reference_logprobs=t["reference_logprobs"])
    loss.backward()
    out = case["outputs"]
    assert close(loss.item(), out["loss"]), (loss.item(), out["loss"])
    assert_close(curr.grad, out["grad_curr_logprobs"], "grad_curr_logprobs")
    for k, want in out["metrics"].items():
        assert k in metrics, f"metric {k} missing"
        assert close(float(metrics[k]), float(want)), f"metric {k}: {metrics[k]} vs {want}"


def test_masked_positions_do_not_matter():
    case = LOSS_CASES[0]
    cfg = GRPOConfig(**{k: v for k, v in case["loss_config"].items() if k in GRPOConfig.model_fields})
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["inputs"].items() if isinstance(v, list)}
    mask = (t["token_mask"] * t["sample_mask"][:, None]).bool()

    def run(inputs):
        curr = inputs["curr_logprobs"].clone().requires_grad_(True)
        loss, m = clipped_pg_loss(curr, inputs["prev_logprobs"], inputs["generation_logprobs"], inputs["advantages"],
                                  inputs["token_mask"], inputs["sample_mask"], 62.0, 7.0, cfg)
        loss.backward()
        return loss.item(), curr.grad, m

    base = run(t)
    shaken = {k: (torch.where(mask, v, v + 0.3) if v.dim() == 2 and k != "token_mask" else v) for k, v in t.items()}
    got = run(shaken)
    assert close(got[0], base[0])
    assert torch.allclose(got[1], base[1], rtol=1e-12, atol=1e-15)


def _adv_inputs(case):
    i = case["inputs"]
    return torch.tensor(i["rewards"], dtype=torch.float64), i["prompt_group_ids"]


@pytest.mark.parametrize("case", [c for c in ADV_CASES if "estimator_config" in c],
                         ids=[c["name"] for c in ADV_CASES if "estimator_config" in c])
def test_advantages_match_nemo_rl(case):
    rewards, groups = _adv_inputs(case)
    ec = case["estimator_config"]
    adv, baseline, std = grpo_advantages(rewards, groups, leave_one_out=ec["use_leave_one_out_baseline"],
                                         normalize=ec["normalize_rewards"])
    out = case["outputs"]
    mask = torch.tensor(case["inputs"]["mask"], dtype=torch.float64)
    assert_close(adv[:, None].expand(mask.shape), out["advantages"], "advantages")
    assert_close(adv, out["advantages_per_sample"], "advantages_per_sample")
    assert_close(baseline, out["baseline"], "baseline")
    assert_close(std, out["std"], "std")


@pytest.mark.parametrize("case", [c for c in ADV_CASES if c.get("function") == "calculate_baseline_and_std_per_prompt"],
                         ids=[c["name"] for c in ADV_CASES if c.get("function") == "calculate_baseline_and_std_per_prompt"])
def test_baseline_fn_with_valid_mask(case):
    rewards, groups = _adv_inputs(case)
    valid = torch.tensor(case["inputs"]["valid_mask"], dtype=torch.float64)
    baseline, std = baseline_and_std(rewards, groups, valid, leave_one_out=case["config"]["leave_one_out_baseline"])
    assert_close(baseline, case["outputs"]["baseline"], "baseline")
    assert_close(std, case["outputs"]["std"], "std")


def test_every_golden_case_is_exercised():
    names = {c["name"] for c in ADV_CASES}
    assert {"baseline_fn_masked_sample_loo", "baseline_fn_masked_sample_no_loo", "baseline_fn_group_le1_valid"} <= names
    assert len(LOSS_CASES) == 10
