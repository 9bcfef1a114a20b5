"""Each statistic of ``bench.stats`` against an independent computation, and the verdict rule branch by branch."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as st

from molt_lightning.bench import stats

RNG = np.random.default_rng(1234)


def welch_by_hand(a, b):
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    return (a.mean() - b.mean()) / se, se, df


@pytest.mark.parametrize("na,nb", [(3, 3), (5, 8), (10, 4)])
def test_welch_matches_hand_formula(na, nb):
    a, b = RNG.normal(0.3, 1.0, na), RNG.normal(0.0, 2.0, nb)
    t, se, df = welch_by_hand(a, b)
    c = stats.compare(a, b, margin=0.5)
    assert c.welch_t == pytest.approx(t, rel=1e-10)
    assert c.welch_p == pytest.approx(2 * st.t.sf(abs(t), df), rel=1e-8)
    q = st.t.ppf(0.975, df)
    assert c.diff_ci == pytest.approx((a.mean() - b.mean() - q * se, a.mean() - b.mean() + q * se), rel=1e-8)


@pytest.mark.parametrize("na,nb", [(3, 4), (5, 5), (6, 3)])
def test_tost_matches_two_one_sided_welch_tests(na, nb):
    a, b = RNG.normal(0.1, 1.0, na), RNG.normal(0.0, 1.5, nb)
    d = 0.8
    t, se, df = welch_by_hand(a, b)
    diff = a.mean() - b.mean()
    p_low = st.t.sf((diff + d) / se, df)  # H0: diff <= -d
    p_high = st.t.cdf((diff - d) / se, df)  # H0: diff >= +d
    assert stats.compare(a, b, margin=d).tost_p == pytest.approx(max(p_low, p_high), rel=1e-8)


def test_mann_whitney_u_is_the_pair_count_and_p_is_the_exact_permutation_p():
    a, b = RNG.normal(0.5, 1, 5), RNG.normal(0, 1, 4)
    u = sum(float(x > y) + 0.5 * float(x == y) for x in a for y in b)
    c = stats.compare(a, b, margin=0.5)
    assert c.mwu_u == u
    # exact two-sided p by enumerating every split of the pooled values (no ties in continuous data)
    pooled = np.concatenate([a, b])
    us = []
    for idx in itertools.combinations(range(pooled.size), a.size):
        rest = np.setdiff1d(np.arange(pooled.size), idx)
        us.append(sum(float(pooled[i] > pooled[j]) for i in idx for j in rest))
    us = np.array(us)
    p = min(1.0, 2 * min((us <= u).mean(), (us >= u).mean()))
    assert c.mwu_p == pytest.approx(p, rel=1e-10)


@pytest.mark.parametrize("n", range(2, 14))
def test_iqm_is_the_mean_of_the_middle_half(n):
    x = RNG.normal(size=n)
    k = n // 4  # rliable / scipy.trim_mean cut floor(n/4) from each end
    assert stats.iqm(x) == pytest.approx(np.sort(x)[k:n - k].mean(), rel=1e-12)


def test_probability_of_improvement_is_normalised_mann_whitney_u():
    a, b = RNG.integers(0, 4, 7).astype(float), RNG.integers(0, 4, 5).astype(float)  # with ties
    u = st.mannwhitneyu(a, b).statistic
    assert stats.prob_improvement(a, b, "max") == pytest.approx(u / (a.size * b.size))
    assert stats.prob_improvement(a, b, "min") == pytest.approx(1 - u / (a.size * b.size))


@pytest.mark.slow
def test_iqm_bootstrap_ci_agrees_with_a_hand_written_stratified_bootstrap():
    a, b = RNG.normal(1.0, 1, 12), RNG.normal(0.0, 1, 9)
    lo, hi = stats.bootstrap_ci((a, b), lambda x, y, axis=-1: stats.iqm(x, axis) - stats.iqm(y, axis),
                                n_resamples=20000, seed=1)
    rng = np.random.default_rng(7)
    ia = rng.integers(0, a.size, (20000, a.size))
    ib = rng.integers(0, b.size, (20000, b.size))
    diffs = stats.iqm(a[ia], axis=1) - stats.iqm(b[ib], axis=1)  # each side resampled on its own, row by row
    ref_lo, ref_hi = np.percentile(diffs, [2.5, 97.5])
    width = ref_hi - ref_lo
    assert lo == pytest.approx(ref_lo, abs=0.05 * width)
    assert hi == pytest.approx(ref_hi, abs=0.05 * width)


def test_power_numbers_against_the_noncentral_t():
    """Seeds for a difference reach the target power under the noncentral t; one fewer does not."""
    def power(n, es, alpha=0.05):
        df, nc = 2 * n - 2, es * math.sqrt(n / 2)
        crit = st.t.ppf(1 - alpha / 2, df)
        return st.nct.sf(crit, df, nc) + st.nct.cdf(-crit, df, nc)

    for es in (0.5, 1.0, 2.0):
        n = stats.seeds_needed(es, 1.0, margin=10.0)["diff"]
        assert power(n, es) >= 0.8 > power(n - 1, es)
    mdd = stats.min_detectable(6, sd=2.0)
    assert power(6, mdd / 2.0) == pytest.approx(0.8, abs=1e-3)
    # equivalence: (z_{1-a} + z_{1-b/2})^2 * 2 / effect^2 is the normal approximation the t answer sits just above
    n_eq = stats.seeds_needed(0.0, 1.0, margin=0.8)["equiv"]
    approx = 2 * (st.norm.ppf(0.95) + st.norm.ppf(0.9)) ** 2 / 0.8 ** 2
    assert approx <= n_eq <= approx + 2
    assert stats.seeds_needed(1.0, 1.0, margin=0.5)["equiv"] == stats.MAX_SEEDS  # |diff| >= margin: unreachable
    # a difference of 11.6 seed SDs (verl's step time, Ulysses SP vs DP): 2 seeds per side already have the power,
    # where statsmodels' solver fails to converge and said nan, which was reported as "more than 10000"
    assert power(2, 8.0) >= 0.8 and stats.seeds_needed(8.0, 1.0, margin=10.0)["diff"] == 2  # power rises with it
    assert stats.seeds_needed(2.08, 0.18, margin=0.95)["diff"] == 2


def test_verdict_branches():
    base = np.array([-1.0, -0.5, 0.0, 0.5, 1.0]) * 0.01
    assert stats.compare(base + 0.001, base, margin=0.05).verdict == "comparable within +-0.05"
    better = stats.compare(base + 1, base, margin=0.05)
    assert (better.verdict_kind, better.verdict) == ("A better", "A better")
    assert stats.compare(base + 1, base, margin=0.05, goal="min").verdict == "B better"
    assert stats.compare(base, base + 1, margin=0.05).verdict == "B better"
    rng = np.random.default_rng(0)  # its own draws: the module's RNG depends on which tests ran before (xdist)
    noisy = stats.compare(rng.normal(0.2, 1, 4), rng.normal(0, 1, 4), margin=0.05)
    assert noisy.verdict_kind == "inconclusive"
    n = min(noisy.seeds_for_diff, noisy.seeds_for_equiv)
    assert noisy.verdict == f"inconclusive: about {n} seeds per side needed"
    same = stats.compare([2.0, 2.0, 2.0], [2.0, 2.0], margin=0.1)
    assert same.verdict == "comparable within +-0.1 (no variation between seeds)"
    assert stats.compare([3.0, 3.0], [2.0, 2.0], margin=0.1).verdict == "A better (no variation between seeds)"


def test_tost_wins_over_welch_when_a_real_difference_is_inside_the_margin():
    a = np.linspace(1.00, 1.01, 30)
    b = a - 0.02  # significant for Welch, yet well inside +-0.1
    c = stats.compare(a, b, margin=0.1)
    assert c.welch_p < 0.05 and c.tost_p < 0.05
    assert c.verdict_kind == "comparable"


@pytest.mark.parametrize("a,b,kwargs,match", [
    ([1.0], [1.0, 2.0], {"margin": 1}, "at least 2 per side"),
    ([1.0, float("nan")], [1.0, 2.0], {"margin": 1}, "NaN"),
    ([1.0, 2.0], [1.0, 2.0], {"margin": 0}, "positive number"),
    ([1.0, 2.0], [1.0, 2.0], {"margin": 1, "goal": "up"}, "goal"),
])
def test_bad_input_names_the_problem(a, b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        stats.compare(a, b, **kwargs)


def test_vectorised_verdicts_equal_the_single_comparison():
    a, b = RNG.normal(0.3, 1, (6, 40)), RNG.normal(0, 1, (6, 40))
    kinds = stats.verdict_kinds(a, b, margin=0.7)
    single = [stats.compare(a[:, i], b[:, i], margin=0.7, n_boot=10).verdict_kind for i in range(40)]
    assert kinds.tolist() == single
