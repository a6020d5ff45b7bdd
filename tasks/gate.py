"""How sure is a pass: intervals on pass@k and pass@1, the posterior chance that pass@k is above
the target, and the risk that a policy just under the target passes by luck within a run.

Intervals (`wilson`): the Wilson score interval on the mean of per-task values in [0, 1] over the
fixed task set. For pass@k under early stop (draw until the first success, at most k) and under
full sampling with n = k, each task's value is exactly the indicator "solved within k samples",
a Bernoulli(q_i); with n > k the unbiased estimator has smaller variance than that indicator. For
pass@1 the per-task value c/n (or the first sample's indicator under early stop) has mean p_i and
lies in [0, 1], so its variance is at most p_i (1 - p_i). In every case the variance of the mean is
at most sum m_i (1 - m_i) / n^2 <= mbar (1 - mbar) / n (concavity), the binomial variance the
Wilson interval assumes: the interval is conservative for heterogeneous tasks.

Posterior (`posterior_above`): each task's per-sample success rate p_i ~ Beta(a + s_i, b + f_i)
from its own valid samples (the stopping rule is ignorable for the likelihood p^s (1 - p)^f), with
q_i = 1 - (1 - p_i)^k and pass@k = mean q_i. The prior Beta(a, b) is shared by the evaluation's
tasks and learnt from them (hierarchical: (a, b) on a log grid, flat there, drawn from its
beta-binomial posterior in each simulation draw, so the prior's own uncertainty is kept; fixing it
at its best fit makes the interval far too narrow). A uniform prior per task is not used: with at
most k = 4 samples it dominates the data (a task failed 4 times gets E[q] = 4/9, one solved at once
14/15), which biases pass@k towards 0.8 and P(> target) upwards. Tasks with no valid sample count as
failures (q = 0), as in the point estimate.

Luck risk (`luck_risk`): per-task rates shaped like the run's own, shifted in logit space by one
constant so their mean is a true pass@k just under the target (the run reports 2 points under: at
the target itself a pass is a coin flip by definition); one evaluation passes when its count of solved tasks / n is
strictly above the target, a Poisson-binomial tail computed exactly; the chance of at least one
pass in E evaluations is 1 - (1 - p)^E, treating evaluations as independent. Evaluations of one
run share tasks and similar policies (positively associated), and earlier checkpoints are worse,
so this is an upper bound on the risk.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

Z95 = 1.959963984540054
# Prior grid for the empirical-Bayes fit: a, b in [0.05, 50], log-spaced.
_GRID = np.exp(np.linspace(math.log(0.05), math.log(50.0), 121))


def passes(pass_at_k: float, target: float) -> bool:
    """The gate, strictly above the target as mlperf_logging's checker (v > target)."""
    return pass_at_k > target


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a share successes / n (successes may be a sum of values in [0, 1])."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    # At 0 or n successes the bound is exactly 0 or 1 (the formula leaves a rounding residue).
    return (0.0 if p <= 0 else max(0.0, centre - half)), (1.0 if p >= 1 else min(1.0, centre + half))


def _log_marginal(outcomes) -> np.ndarray:
    """Beta-binomial log marginal likelihood of per-task (successes, failures) at each (a, b) on the grid."""
    counts = Counter((int(s), int(f)) for s, f in outcomes if s + f > 0)
    a, b = np.meshgrid(_GRID, _GRID, indexing="ij")
    return sum(m * _log_beta_ratio(a, b, s, f) for (s, f), m in counts.items()) + 0 * a


def _log_beta_ratio(a, b, s: int, f: int):
    """log B(a + s, b + f) / B(a, b) for integer s, f: exact as a finite product (no special functions)."""
    out = sum(np.log(a + j) for j in range(s)) + sum(np.log(b + j) for j in range(f))
    return out - sum(np.log(a + b + j) for j in range(s + f))


def fit_prior(outcomes) -> tuple[float, float]:
    """(a, b) maximising the beta-binomial marginal likelihood (empirical Bayes, for point summaries)."""
    ll = _log_marginal(outcomes)
    i, j = np.unravel_index(np.argmax(ll), ll.shape)
    return float(_GRID[i]), float(_GRID[j])


def posterior_q_means(outcomes, k: int, prior: tuple[float, float] | None = None) -> np.ndarray:
    """Per task E[1 - (1 - p)^k] under Beta(a + s, b + f) (exact: B(a', b' + k) / B(a', b')); 0 without samples."""
    a, b = prior or fit_prior(outcomes)
    sf = np.asarray(outcomes, dtype=float).reshape(-1, 2)
    q = 1.0 - np.exp(_log_beta_ratio(a + sf[:, 0], b + sf[:, 1], 0, k))
    return np.where(sf.sum(axis=1) > 0, q, 0.0)


def posterior_above(outcomes, k: int, target: float, draws: int = 20000, seed: int = 0,
                    prior: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """P(pass@k > target) and the 95% credible interval of pass@k; outcomes: per task (successes, failures)."""
    sf = np.asarray(outcomes, dtype=int).reshape(-1, 2)
    n = len(sf)
    if n == 0:
        raise ValueError("no tasks")
    rng = np.random.default_rng(seed)
    if prior is not None:
        a, b = np.full(draws, prior[0]), np.full(draws, prior[1])
    else:
        # (a, b) drawn from its grid posterior (flat in log a, log b): the prior's own uncertainty is kept.
        ll = _log_marginal(sf).ravel()
        w = np.exp(ll - ll.max())
        cell = rng.choice(w.size, size=draws, p=w / w.sum())
        a, b = _GRID[cell // _GRID.size], _GRID[cell % _GRID.size]
    total = np.zeros(draws)
    # Tasks with the same counts share a posterior: one draw matrix per distinct (s, f) keeps it fast.
    for (s, f), m in Counter(map(tuple, sf.tolist())).items():
        if s + f == 0:
            continue
        p = rng.beta((a + s)[:, None], (b + f)[:, None], size=(draws, m))
        total += (1.0 - (1.0 - p) ** k).sum(axis=1)
    pk = total / n
    low, high = np.quantile(pk, [0.025, 0.975])
    return float(np.mean(pk > target)), float(low), float(high)


def _shift_to_mean(q: np.ndarray, target: float) -> np.ndarray:
    """q shifted by one constant in logit space so that its mean is the target (bisection)."""
    logit = np.log(q) - np.log1p(-q)
    lo, hi = -50.0, 50.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(logit + mid)))) < target:
            lo = mid
        else:
            hi = mid
    return 1 / (1 + np.exp(-(logit + (lo + hi) / 2)))


def pass_chance(q, target: float) -> float:
    """P(count / n > target) for independent task indicators ~ Bernoulli(q_i): exact Poisson-binomial tail."""
    q = np.asarray(q, dtype=float)
    dist = np.zeros(len(q) + 1)
    dist[0] = 1.0
    for i, qi in enumerate(q):
        dist[1:i + 2] = dist[1:i + 2] * (1 - qi) + dist[:i + 1] * qi
        dist[0] *= 1 - qi
    need = max(0, math.floor(target * len(q)) + 1)  # the least count with count / n > target
    return float(dist[need:].sum())


def luck_risk(per_task_q, evaluations: int, target: float, true_pass: float | None = None) -> float:
    """Chance that a policy with true pass@k `true_pass` (default: the target itself), tasks shaped
    like per_task_q, passes (> target) at least once in `evaluations` evaluations (independent: an
    upper bound, see the module doc)."""
    true_pass = target if true_pass is None else true_pass
    if evaluations <= 0 or target >= 1:
        return 0.0
    if target < 0:
        return 1.0  # every evaluation passes
    if true_pass <= 0:
        return 0.0  # a policy that solves nothing never passes a target >= 0
    q = np.clip(np.asarray(per_task_q, dtype=float), 1e-6, 1 - 1e-6)
    p = pass_chance(_shift_to_mean(q, min(true_pass, 1 - 1e-6)), target)
    return float(1 - (1 - p) ** evaluations)


def gate_columns(pass_at_k: float, pass_at_1: float, num_tasks: int, outcomes, k: int,
                 target: float | None) -> dict:
    """The eval_summary columns: 95% intervals on pass@k and pass@1, P(pass@k > target)."""
    lo_k, hi_k = wilson(pass_at_k * num_tasks, num_tasks)
    lo_1, hi_1 = wilson(pass_at_1 * num_tasks, num_tasks)
    above = posterior_above(outcomes, k, target)[0] if target is not None and len(outcomes) else None
    return dict(pass_at_k_low=lo_k, pass_at_k_high=hi_k, pass_at_1_low=lo_1, pass_at_1_high=hi_1,
                p_above_target=above)


def describe(row: dict, target: float | None = None) -> str:
    """'pass@4 0.721 [0.662, 0.773]  P(>0.69) 0.86' from an eval_summary row (old rows: the bare number)."""
    out = f"pass@{row['k']} {row['pass_at_k']:.3f}"
    if row.get("pass_at_k_low") is not None:
        out += f" [{row['pass_at_k_low']:.3f}, {row['pass_at_k_high']:.3f}]"
    if row.get("p_above_target") is not None and target is not None:
        out += f"  P(>{target:g}) {row['p_above_target']:.2f}"
    return out
