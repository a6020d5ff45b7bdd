"""pass@k arithmetic, masked samples and the spread diagnostics."""

import itertools
from math import comb

import pytest

from tasks.evaluation import pass_at_k, pass_hat_k, spread, summarize


def brute_pass_at_k(outcomes, k):
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(4, 0, 4), (4, 1, 4), (8, 3, 4), (16, 5, 4), (10, 10, 4), (6, 2, 1)])
def test_unbiased_estimator_matches_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k))
    assert pass_hat_k(n, c, k) == pytest.approx(comb(c, k) / comb(n, k))


def test_n_equal_k_is_any_success():
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0


def test_summary_masks_and_counts_missing_tasks():
    s = [dict(instance_id="a", reward=r, masked=False) for r in (1, 0, 0, 0)]
    s += [dict(instance_id="b", reward=0, masked=False) for _ in range(3)]
    s += [dict(instance_id="b", reward=None, masked=True)]
    out = summarize(s, k=4, task_ids=["a", "b", "c"])
    assert out.num_tasks == 3 and out.num_masked == 1 and out.num_samples == 7
    assert out.pass_at_k == pytest.approx(1 / 3)  # a solved; b not; c has no sample -> failure
    assert out.pass_at_1 == pytest.approx((0.25 + 0 + 0) / 3)
    assert out.short_tasks == 2
    sp = spread(out)
    assert sp["share_tasks_strictly_between_0_and_1"] == pytest.approx(1 / 3)
    assert sp["pass_at_k_minus_pass_at_1"] == pytest.approx(out.pass_at_k - out.pass_at_1)


def test_eval_subset_spreads_over_packages():
    from types import SimpleNamespace

    from flows.evaluate import eval_task_ids
    from schemas.presets import load_config

    ids = sorted(f"{pkg}__{i:03d}" for pkg in ("alpha", "beta", "gamma", "delta") for i in range(25))
    ctx = SimpleNamespace(split_ids=lambda split: ids, cfg=load_config("mini", ["eval.max_tasks=8"]))
    subset = eval_task_ids(ctx)
    assert len(subset) == len(set(subset)) == 8 and {s.split("__")[0] for s in subset} == {"alpha", "beta", "gamma", "delta"}
    ctx.cfg = load_config("mini")
    assert eval_task_ids(ctx) == ids


def test_base_evaluation_cache_id_names_what_was_measured():
    from schemas.presets import load_config
    from tasks.evaluation import base_eval_id

    prepared = {"tasks": "datasets/mini-a/tasks.parquet", "base_model": "models/base-123"}
    ident = base_eval_id(load_config("mini"), prepared)
    assert ident.startswith("base-base-123-")
    # Training-only settings share the base evaluation ...
    assert base_eval_id(load_config("mini", ["agent.training.temperature=0.7", "optimizer.lr=1e-4"]), prepared) == ident
    assert base_eval_id(load_config("mini", ["agent.seeded_sampling=true"]), prepared) == ident
    # ... what the evaluation measures does not.
    assert base_eval_id(load_config("mini", ["eval.max_tasks=128"]), prepared) != ident
    assert base_eval_id(load_config("mini", ["agent.validation.temperature=0.7"]), prepared) != ident
    assert base_eval_id(load_config("mini"), {**prepared, "tasks": "datasets/mini-b/tasks.parquet"}) != ident
