"""research/mismatch_layers.py's model variants (issue #47, item 3): with no component switched they
are the trainer's own fp32 and bf16 scoring, bit for bit; each component switch changes the scores
and leaves the fp32 master model untouched. A tiny random Qwen3.5 hybrid (1 GDN + 1 full-attention
layer, MoE with a shared expert, tied embeddings), built in-process: seconds."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ml():
    spec = importlib.util.spec_from_file_location("mismatch_layers", ROOT / "research" / "mismatch_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def hybrid():
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1,
                               linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
                               tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # weights at a scale where bf16 rounding moves the logprobs
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (40, 23, 70)]
    return model, ids


def test_unswitched_variants_are_the_trainers_scoring(ml, hybrid):
    from tasks.policy.runtime import policy_logprobs

    model, ids = hybrid
    for precision in ("fp32", "bf16"):
        ref = policy_logprobs(model, ids, temperature=0.7, precision=precision)
        got = policy_logprobs(ml.variant(model, precision), ids, temperature=0.7)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), precision


def test_each_component_switch_moves_the_scores(ml, hybrid):
    from tasks.policy.runtime import policy_logprobs

    model, ids = hybrid
    before = {n: p.clone() for n, p in model.state_dict().items()}
    fp32 = torch.cat(policy_logprobs(model, ids))
    names = ml.variants(model)
    assert {f"+{c}" for c in ml.COMPONENTS} <= set(names)
    for name, (base, other) in names.items():
        got = torch.cat(policy_logprobs(ml.variant(model, base, other), ids))
        assert torch.isfinite(got).all()
        if name != "fp32":
            assert not torch.equal(got, fp32), name
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.state_dict().items())
    shares = ml.flips(model, ids)
    assert set(shares) == {"bf16", "fp32-bf16w"}
    assert all(len(v) == 2 and all(0 <= x <= 1 for x in v) for v in shares.values())
