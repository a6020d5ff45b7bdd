"""The gate's statistics (tasks/gate.py): intervals, the posterior, the luck risk, the strict comparison."""

import math
import time

import numpy as np
import pytest
from scipy.stats import binom

from tasks import gate
from tasks.evaluation import eval_summary_row, summarize, summarize_early_stop

Z = gate.Z95
N = 251


def test_strict_comparison_at_the_boundary():
    assert not gate.passes(0.69, 0.69)
    assert gate.passes(174 / N, 0.69) and not gate.passes(173 / N, 0.69)
    assert math.floor(0.69 * N) + 1 == 174  # the least passing count, as pass_chance uses it
    assert not gate.passes(0.0, 0.0) and gate.passes(0.0, -1.0)  # a negative target passes anything


@pytest.mark.parametrize("s", [0, 1, 90, 173, 174, 250, 251])
def test_wilson_bounds_solve_the_score_equation(s):
    # Each finite bound p satisfies (phat - p)^2 = z^2 p (1 - p) / n (an independent form of the interval).
    lo, hi = gate.wilson(s, N)
    phat = s / N
    for p in (lo, hi):
        if 0 < p < 1:
            assert (phat - p) ** 2 == pytest.approx(Z * Z * p * (1 - p) / N, rel=1e-9)
    assert lo <= phat <= hi


def test_wilson_all_and_none_solved_by_hand():
    assert gate.wilson(N, N) == pytest.approx((N / (N + Z * Z), 1.0))
    assert gate.wilson(0, N) == pytest.approx((0.0, Z * Z / (N + Z * Z)))
    lo, hi = gate.wilson(174, N)
    assert lo < 0.69 < hi and hi - lo == pytest.approx(0.113, abs=0.002)


def test_wilson_covers_heterogeneous_tasks():
    # U-shaped per-task rates: the binomial variance overstates the spread, so coverage >= 95%.
    rng = np.random.default_rng(3)
    q = rng.beta(0.3, 0.15, N)
    hits = sum(lo <= q.mean() <= hi for lo, hi in (gate.wilson((rng.random(N) < q).sum(), N) for _ in range(2000)))
    assert hits / 2000 >= 0.95


def test_posterior_uniform_prior_by_hand():
    # Beta(1, 1) prior: solved at the first sample -> E[q] = 1 - E[(1-p)^4] under Beta(2, 1) = 14/15;
    # failed 4 times -> Beta(1, 5), E[q] = 4/9; solved at the third -> Beta(2, 3), E[q] = 11/14.
    q = gate.posterior_q_means([(1, 0), (0, 4), (1, 2)], 4, prior=(1.0, 1.0))
    assert q == pytest.approx([14 / 15, 4 / 9, 11 / 14])
    prob, lo, hi = gate.posterior_above([(1, 0)] * N, 4, 0.69, prior=(1.0, 1.0))
    assert prob == 1.0 and lo < 14 / 15 < hi
    prob, lo, hi = gate.posterior_above([(0, 4)] * N, 4, 0.69, prior=(1.0, 1.0))
    assert prob == 0.0 and lo < 4 / 9 < hi


def test_posterior_all_and_none_solved():
    prob, lo, hi = gate.posterior_above([(1, 0)] * N, 4, 0.69)
    assert prob == 1.0 and lo > 0.95
    prob, lo, hi = gate.posterior_above([(0, 4)] * N, 4, 0.69)
    assert prob == 0.0 and hi < 0.05


def test_posterior_mean_matches_the_exact_per_task_means():
    out = [(1, 0)] * 150 + [(0, 4)] * 70 + [(1, 1)] * 11 + [(1, 2)] * 10 + [(1, 3)] * 10
    prior = gate.fit_prior(out)
    exact = gate.posterior_q_means(out, 4, prior=prior).mean()
    _, lo, hi = gate.posterior_above(out, 4, 0.69, prior=prior)
    assert lo < exact < hi and (lo + hi) / 2 == pytest.approx(exact, abs=0.01)


def _early_stop_samples(first_success: list) -> list[dict]:
    """Per task the sample index of its first success (None: failed 4 times), as early stop draws them."""
    samples = []
    for i, first in enumerate(first_success):
        draws = [0] * first + [1] if first is not None else [0] * 4
        samples += [dict(instance_id=f"t{i:03d}", sample_index=j, reward=r, masked=False) for j, r in enumerate(draws)]
    return samples


def test_posterior_at_the_threshold_from_early_stop_samples():
    # 174 tasks solved (most at once, as real tasks are mostly always or never solved), 77 failed 4 times.
    firsts = [0] * 150 + [1] * 11 + [2] * 7 + [3] * 6 + [None] * 77
    s = summarize_early_stop(_early_stop_samples(firsts), 4)
    assert s.pass_at_k == pytest.approx(174 / N) and s.pass_at_1 == pytest.approx(150 / N)
    assert s.task_outcomes["t155"] == (1, 1) and s.task_outcomes["t200"] == (0, 4)
    row = eval_summary_row("r", 5, 5, s, 4, 0, 1.0, "early_stop", target=0.69)
    assert (row["pass_at_k_low"], row["pass_at_k_high"]) == pytest.approx(gate.wilson(174, N))
    assert (row["pass_at_1_low"], row["pass_at_1_high"]) == pytest.approx(gate.wilson(150, N))
    assert 0.4 < row["p_above_target"] < 0.7  # the estimate sits on the target: not sure either way
    fewer = summarize_early_stop(_early_stop_samples(firsts[:173] + [None] * 78), 4)
    assert fewer.pass_at_k == pytest.approx(173 / N)
    assert eval_summary_row("r", 5, 5, fewer, 4, 0, 1.0, target=0.69)["p_above_target"] < row["p_above_target"]
    more = summarize_early_stop(_early_stop_samples([0] * 190 + [None] * 61), 4)
    assert eval_summary_row("r", 5, 5, more, 4, 0, 1.0, target=0.69)["p_above_target"] > 0.99


def test_full_sampling_outcomes_and_rows_without_target():
    samples = [dict(instance_id="a", reward=r, masked=False) for r in (1, 0, 1, 0)]
    samples += [dict(instance_id="b", reward=None, masked=True)]
    s = summarize(samples, 4, task_ids=["a", "b"])
    assert s.task_outcomes == {"a": (2, 2), "b": (0, 0)}
    row = eval_summary_row("r", 1, 1, s, 4, 0, 1.0)
    assert row["p_above_target"] is None and row["pass_at_1_low"] < 0.25 < row["pass_at_1_high"]
    # A task without a valid sample counts as a failure in the posterior too.
    assert gate.posterior_q_means([(2, 2), (0, 0)], 4)[1] == 0.0


def test_luck_risk_is_the_binomial_tail_for_equal_rates():
    p = binom.sf(173, N, 0.69)  # P(count >= 174)
    assert gate.luck_risk([0.69] * N, 1, 0.69) == pytest.approx(p, rel=1e-9)
    assert gate.luck_risk([0.69] * N, 3, 0.69) == pytest.approx(1 - (1 - p) ** 3, rel=1e-9)
    assert gate.luck_risk([0.69] * N, 0, 0.69) == 0.0
    assert gate.luck_risk([0.69] * N, 2, -1.0) == 1.0 and gate.luck_risk([0.69] * N, 2, 1.0) == 0.0


def test_luck_risk_against_a_simulation():
    rng = np.random.default_rng(7)
    q = rng.beta(0.4, 0.2, N)
    shifted = gate._shift_to_mean(np.clip(q, 1e-6, 1 - 1e-6), 0.69)
    assert shifted.mean() == pytest.approx(0.69) and np.all(np.diff(shifted[np.argsort(q)]) >= 0)
    counts = (rng.random((40000, N)) < shifted).sum(axis=1)
    sim = np.mean(counts >= 174)
    exact = gate.luck_risk(q, 1, 0.69)
    assert exact == pytest.approx(sim, abs=4 * math.sqrt(sim * (1 - sim) / 40000))
    # Heterogeneous tasks spread the count less than a binomial: a policy just below the target passes less.
    assert gate.luck_risk(q, 1, 0.67) < gate.luck_risk([0.67] * N, 1, 0.67)


def test_cost_per_evaluation():
    rng = np.random.default_rng(0)
    out = [(1, int(f)) for f in rng.integers(0, 4, 181)] + [(0, 4)] * 70
    t0 = time.perf_counter()
    gate.posterior_above(out, 4, 0.69)
    gate.luck_risk(gate.posterior_q_means(out, 4), 10, 0.69)
    seconds = time.perf_counter() - t0
    print(f"gate statistics: {seconds:.3f} s per evaluation of {N} tasks")
    assert seconds < 2.0  # well under a second on an idle core; slack for a loaded CI machine


def test_run_luck_reads_the_passing_checkpoints_samples(tmp_path):
    from schemas.tables import EVAL_SAMPLES
    from tasks.evaluation import run_luck, summary_table
    from tasks.storage import Store

    store = Store(f"file://{tmp_path}/store")
    firsts = {2: [0] * 150 + [None] * 101, 3: [0] * 180 + [None] * 71}  # step 3 passes, step 2 does not
    for step, f in firsts.items():
        samples = [dict(x, rollout_id=f"{step}-{x['instance_id']}-{x['sample_index']}", run_id="r", step=step,
                        policy_version=step, reward=float(x["reward"]), mask_reason=None, finish_reason="submitted")
                   for x in _early_stop_samples(f)]
        store.write_stage("r", step, "eval_samples", EVAL_SAMPLES.from_rows(samples))
        s = summarize_early_stop(samples, 4)
        store.write_stage("r", step, "eval_summary", summary_table([eval_summary_row(
            "r", step, step, s, 4, 0, 1.0, "early_stop", target=0.69)]))
    luck = run_luck(store, "r", range(1, 5), 0.69)
    assert luck["from_step"] == 3 and luck["evaluations"] == 2
    q = gate.posterior_q_means([(1, 0)] * 180 + [(0, 4)] * 71, 4)
    assert luck["true_pass"] == pytest.approx(0.67)  # the default margin: 2 points under the target
    assert luck["luck_risk"] == pytest.approx(gate.luck_risk(q, 2, 0.69, 0.67))
    assert luck["per_evaluation"] < luck["luck_risk"] < gate.luck_risk(q, 2, 0.69)  # further under, less luck
    assert run_luck(store, "r", range(4, 6), 0.69) is None  # no evaluation in range
