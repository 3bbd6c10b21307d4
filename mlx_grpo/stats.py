"""Statistics for paired A/B comparisons over tasks (`python -m mlx_grpo.compare`, the
curriculum benchmark, the exported model card). Pure numpy; no model in sight.

The unit is the task: a task's value is the mean over its k samples.
- Each side's mean: a 95% percentile bootstrap over tasks (10,000 resamples, seeded).
- B - A: a paired bootstrap; each resample draws the same tasks for both sides.
- A difference is called significant (`better`) when its interval leaves out 0 and
  the p-value is below 1 - level: the bootstrap alone is too narrow with few tasks.
- p-value: two-sided paired sign-flip permutation test of the mean difference; exact
  over all 2^n sign patterns when n <= 16 tasks, else 20,000 random flips with the +1
  correction, p = (1 + hits) / (1 + R). The sign test (binomial on the tasks that are
  not tied) is reported beside it: it ignores effect sizes, so it is robust to a few
  tasks with large differences.
- pass@k: Chen et al. (2021)'s unbiased estimator 1 - C(n-c, k) / C(n, k) per task
  (n samples, c successes), averaged over tasks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Floating-point slack when comparing rewards (ties, "reached the best value").
TOL = 1e-6


@dataclass(frozen=True)
class StatsConfig:
    """How intervals and p-values are computed (all draws come from `seed`)."""

    resamples: int = 10_000  # bootstrap resamples of the tasks
    permutations: int = 20_000  # random sign flips when the exact test is too big
    exact_max: int = 16  # enumerate all 2^n sign patterns up to this many tasks
    level: float = 0.95  # confidence level of the intervals
    seed: int = 0


def bootstrap_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] task indices drawn with replacement; row r is resample r."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_interval(stats: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap statistics (percentile method, numpy's
    linear interpolation)."""
    lo, hi = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def bootstrap_ci(
    values, resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`.

    >>> bootstrap_ci([1.0, 1.0, 1.0])
    (1.0, 1.0)
    """
    x = np.asarray(values, dtype=float)
    return percentile_interval(x[bootstrap_indices(len(x), resamples, seed)].mean(1), level)


def permutation_p(d, permutations: int = 20_000, seed: int = 0, exact_max: int = 16) -> float:
    """Two-sided paired sign-flip permutation test of mean(d) = 0.

    Under the null each per-task difference is as likely to have either sign. Exact
    (all 2^n patterns, the observed one included) when n <= exact_max; otherwise
    `permutations` random patterns and p = (1 + hits) / (1 + permutations).

    >>> permutation_p([0.0, 0.0, 0.0])
    1.0
    >>> permutation_p([1.0, 1.0, 1.0])  # only all-plus and all-minus reach |sum| = 3
    0.25
    """
    d = np.asarray(d, dtype=float)
    n = len(d)
    observed = abs(d.sum())
    slack = 1e-9 * (1.0 + np.abs(d).sum())  # the same sum in another order
    if n <= exact_max:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
        hits = int((np.abs(signs @ d) >= observed - slack).sum())
        return hits / 2**n
    rng = np.random.default_rng(seed)
    hits = 0
    for lo in range(0, permutations, 4096):  # chunks keep memory flat for big eval sets
        size = min(4096, permutations - lo)
        signs = 1 - 2 * rng.integers(0, 2, size=(size, n))
        hits += int((np.abs(signs @ d) >= observed - slack).sum())
    return (1 + hits) / (1 + permutations)


def sign_test_p(d) -> float:
    """Two-sided sign test: ties (d = 0) dropped, the positives ~ Binomial(m, 1/2).

    >>> sign_test_p([1, 1, 1, 1, 1])
    0.0625
    """
    d = np.asarray(d, dtype=float)
    pos, neg = int((d > TOL).sum()), int((d < -TOL).sum())
    m = pos + neg
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(pos, neg) + 1))
    return min(1.0, 2 * tail / 2**m)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with n samples, c of them correct (Chen et al. 2021):
    the chance that k samples drawn without replacement hold at least one success.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4)
    (0.25, 0.5, 0.0)
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples (n={n})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def better(ci_low: float, ci_high: float, p: float, level: float = 0.95) -> str | None:
    """The side a difference favours, "a" or "b", when both the paired interval leaves
    out 0 and the permutation test rejects at 1 - level; else None. With few tasks the
    percentile bootstrap is too narrow (all differences equal give a zero-width
    interval, whatever n), so the interval alone would call chance significant.

    >>> better(1.0, 1.0, 0.25), better(0.1, 0.7, 0.0021), better(-0.4, -0.1, 0.01)
    (None, 'b', 'a')
    >>> better(0.1, 0.5, 0.05)  # below 0.05, not at it

    """
    if p >= round(1 - level, 12):  # (1 - 0.95 is 0.050000000000000044)
        return None
    return "b" if ci_low > 0 else "a" if ci_high < 0 else None


def compare_values(metric: str, a, b, stats: StatsConfig = StatsConfig()) -> dict:
    """One summary row for per-task values of A and B (same tasks, same order): each
    side's mean with its interval, B - A with its paired interval, both p-values."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"{metric}: A and B need the same non-empty list of tasks")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"{metric}: a task's value is not a finite number")
    d = b - a
    idx = bootstrap_indices(len(a), stats.resamples, stats.seed)
    a_lo, a_hi = percentile_interval(a[idx].mean(1), stats.level)
    b_lo, b_hi = percentile_interval(b[idx].mean(1), stats.level)
    lo, hi = percentile_interval(d[idx].mean(1), stats.level)
    p = permutation_p(d, stats.permutations, stats.seed, stats.exact_max)
    return {
        "metric": metric,
        "n": len(a),
        "a": float(a.mean()),
        "b": float(b.mean()),
        "diff": float(d.mean()),
        "ci_low": lo,
        "ci_high": hi,
        "p_value": p,
        "p_sign": sign_test_p(d),
        "better": better(lo, hi, p, stats.level),
        "a_low": a_lo,
        "a_high": a_hi,
        "b_low": b_lo,
        "b_high": b_hi,
    }
