"""Calibration of the verdict by simulation (normal data, SD 1): the numbers documented in ``bench.stats``.

Each check runs 4,000 simulated comparisons at once (``stats.verdict_kinds`` applies the rule column-wise with the
same library calls as ``compare``). Monte Carlo standard error at 4,000 is at most 0.008, so each bound below holds
with several standard errors to spare when the documented property holds, and fails when it does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from molt_lightning.bench import stats

SIMS = 4000


def simulate(n: int, shift: float, margin: float, seed: int, goal: str = "max") -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.normal(shift, 1.0, (n, SIMS))
    b = rng.normal(0.0, 1.0, (n, SIMS))
    return stats.verdict_kinds(a, b, margin, goal)


@pytest.mark.parametrize("n", [4, 5, 10, stats.DOC_SEEDS])
def test_same_distribution_gives_a_different_verdict_at_rate_alpha(n):
    kinds = simulate(n, shift=0.0, margin=1.0, seed=100 + n)
    different = np.isin(kinds, ["A better", "B better"]).mean()
    assert abs(different - stats.ALPHA) <= 0.02, f"n={n}: 'different' in {different:.3f} of null comparisons"
    # and the two directions share it (no side is favoured)
    assert abs((kinds == "A better").mean() - (kinds == "B better").mean()) <= 0.015


@pytest.mark.parametrize("goal", ["max", "min"])
def test_power_at_one_sd_with_the_documented_seeds(goal):
    """A is better by 1 SD (higher for goal max, lower for goal min): the verdict must name A."""
    kinds = simulate(stats.DOC_SEEDS, shift=1.0 if goal == "max" else -1.0, margin=1.0, seed=7, goal=goal)
    assert (kinds == "A better").mean() >= stats.DOC_POWER


def test_tost_declares_equivalence_at_the_documented_rate_when_there_is_no_difference():
    kinds = simulate(stats.DOC_SEEDS, shift=0.0, margin=1.0, seed=11)
    assert (kinds == "comparable").mean() >= stats.DOC_EQUIV_RATE


def test_tost_rarely_declares_equivalence_at_the_margin():
    """A true difference equal to the margin is not equivalent: "comparable" at most at TOST's size."""
    kinds = simulate(stats.DOC_SEEDS, shift=1.0, margin=1.0, seed=13)
    assert (kinds == "comparable").mean() <= stats.ALPHA + 0.02


def test_recommended_seed_counts_reach_the_target_power():
    n_diff = stats.seeds_needed(1.0, 1.0, margin=0.5)["diff"]
    kinds = simulate(n_diff, shift=1.0, margin=0.5, seed=17)
    assert (kinds == "A better").mean() >= stats.POWER - 0.02
    n_equiv = stats.seeds_needed(0.0, 1.0, margin=1.0)["equiv"]
    kinds = simulate(n_equiv, shift=0.0, margin=1.0, seed=19)
    assert (kinds == "comparable").mean() >= stats.POWER - 0.02
