"""``molt-bench compare-published``: the verdict from published mean, SD and runs, against the raw-data path, against
independent libraries on raw data built to those summaries, and worked by hand on the Molt paper's step-time claim."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from scipy import stats as st
from statsmodels.stats.weightstats import CompareMeans, DescrStatsW, ttost_ind

from molt_lightning.bench import stats
from molt_lightning.bench.cli import main
from molt_lightning.bench.published import Side, compare_published, parse_side

RNG = np.random.default_rng(2024)
PAPER = Side("molt", 119.4, 2.3, 3), Side("baseline", 109.5, 10.3, 3)  # s per step, 3 runs each


def summarise(x: np.ndarray, name: str) -> Side:
    return Side(name, float(x.mean()), float(x.std(ddof=1)), x.size)


def with_summary(mean: float, sd: float, n: int) -> np.ndarray:
    """n values whose mean and SD (ddof 1) are exactly ``mean`` and ``sd`` (up to rounding)."""
    z = RNG.normal(size=n)
    return mean + sd * (z - z.mean()) / z.std(ddof=1)


@pytest.mark.parametrize("na,nb,shift,margin,goal", [
    (3, 3, 0.3, 0.5, "max"), (5, 8, 0.0, 1.0, "max"), (10, 4, 2.0, 0.5, "min"), (20, 20, 0.05, 0.8, "min"),
    (2, 6, -1.0, 1.5, "max"),
])
def test_summaries_give_what_the_raw_data_path_gives(na, nb, shift, margin, goal):
    a, b = RNG.normal(shift, 1.0, na), RNG.normal(0.0, 1.7, nb)
    raw = stats.compare(a, b, margin=margin, goal=goal, n_boot=10)
    pub = compare_published(summarise(a, "A"), summarise(b, "B"), margin=margin, goal=goal)
    for key in ("diff", "welch_t", "welch_p", "tost_p", "min_detectable_diff"):
        assert getattr(pub, key) == pytest.approx(getattr(raw, key), abs=1e-9), key
    assert pub.diff_ci == pytest.approx(raw.diff_ci, abs=1e-9)
    for key in ("seeds_for_diff", "seeds_for_equiv", "verdict", "verdict_kind"):
        assert getattr(pub, key) == getattr(raw, key), key


@pytest.mark.slow
def test_the_verdicts_agree_over_many_draws_and_without_variation():
    for _ in range(40):
        a, b = RNG.normal(RNG.uniform(-1, 1), 1.0, 4), RNG.normal(0.0, 1.0, 5)
        raw = stats.compare(a, b, margin=0.9, n_boot=10)
        pub = compare_published(summarise(a, "A"), summarise(b, "B"), margin=0.9, goal="max")
        assert (pub.verdict, pub.tost_p) == (raw.verdict, pytest.approx(raw.tost_p, abs=1e-9))
    same = compare_published(Side("A", 1.0, 0.0, 3), Side("B", 1.01, 0.0, 3), margin=0.1, goal="max")
    assert same.verdict == stats.compare([1.0] * 3, [1.01] * 3, margin=0.1).verdict \
        == "comparable within +-0.1 (no variation between seeds)"


@pytest.mark.parametrize("a,b,margin", [(PAPER[0], PAPER[1], 10.95), (Side("x", 0.71, 0.04, 5),
                                                                      Side("y", 0.69, 0.03, 7), 0.05)])
def test_against_scipy_and_statsmodels_on_raw_data_with_exactly_those_summaries(a, b, margin):
    xa, xb = with_summary(a.mean, a.sd, a.n), with_summary(b.mean, b.sd, b.n)
    pub = compare_published(a, b, margin=margin, goal="min")
    w = st.ttest_ind(xa, xb, equal_var=False)
    assert (pub.welch_t, pub.welch_p) == pytest.approx((w.statistic, w.pvalue), rel=1e-9)
    assert pub.welch_df == pytest.approx(w.df, rel=1e-9)
    assert pub.tost_p == pytest.approx(ttost_ind(xa, xb, -margin, margin, usevar="unequal")[0], rel=1e-9)
    cm = CompareMeans(DescrStatsW(xa), DescrStatsW(xb))
    assert pub.diff_ci == pytest.approx(cm.tconfint_diff(alpha=0.05, usevar="unequal"), rel=1e-9)
    assert pub.tost_ci == pytest.approx(cm.tconfint_diff(alpha=0.10, usevar="unequal"), rel=1e-9)


def test_the_paper_example_worked_by_hand():
    """Molt 119.4 +- 2.3 s/step vs the baseline's 109.5 +- 10.3 s/step, 3 runs each, margin 10% of 109.5 = 10.95 s.

    Welch:  var of each mean  2.3^2 / 3 = 1.76333,  10.3^2 / 3 = 35.36333;  se = sqrt(37.12667) = 6.09317
            t  = (119.4 - 109.5) / se = 9.9 / 6.09317 = 1.62477
            df = 37.12667^2 / (1.76333^2 / 2 + 35.36333^2 / 2) = 1378.389 / 626.837 = 2.19896
            p  = 2 * P(T_2.199 > 1.62477) = 0.2345; at df = 2 the closed form 1 - t / sqrt(2 + t^2) = 0.2457 is a
                 bound from above (more df, thinner tails).
    TOST within +-10.95:  (9.9 + 10.95) / se = 3.42187 -> p = 0.0331;  (9.9 - 10.95) / se = -0.17232 -> p = 0.4389
            (df = 2 closed form 0.5 * (1 - 0.17232 / sqrt(2.02970)) = 0.4395); TOST p = the larger = 0.4389.
    90% CI: t_{0.95, 2.199} = 2.7476 -> 9.9 +- 16.741 = [-6.841, 26.641]: not inside +-10.95, and TOST would take a
            margin above 26.64 s (24.3% of 109.5) on these numbers. 95% CI: t_{0.975} = 3.9503 -> [-14.170, 33.970].
    Verdict: TOST p 0.44 >= 0.05 and Welch p 0.23 >= 0.05: inconclusive. Pooled SD sqrt((2.3^2 + 10.3^2) / 2) =
            7.4626. Seeds per side (normal approximation, which the t answer sits just above):
            this difference, effect 9.9 / 7.4626 = 1.3266:       2 (1.960 + 0.8416)^2 / 1.3266^2 = 8.92 -> 10;
            equivalence at the observed 9.9, effect 1.05 / 7.4626 = 0.1407: 2 (1.645 + 1.2816)^2 / 0.1407^2 = 865
                -> 866 (the nearer one-sided test at power 0.9, as ``stats.seeds_needed`` plans it);
            equivalence were the truth 0, effect 10.95 / 7.4626 = 1.4673: 2 (1.645 + 1.2816)^2 / 1.4673^2 = 7.96 -> 9.
    """
    c = compare_published(*PAPER, margin="10%", goal="min")
    assert c.margin == pytest.approx(10.95)
    assert c.welch_t == pytest.approx(1.62477, abs=1e-5)
    assert c.welch_df == pytest.approx(2.19896, abs=1e-5)
    assert c.welch_p == pytest.approx(0.2345, abs=5e-5) and c.welch_p < 1 - c.welch_t / math.sqrt(2 + c.welch_t ** 2)
    assert c.tost_p == pytest.approx(0.4389, abs=5e-5)
    assert c.tost_ci == pytest.approx((-6.841, 26.641), abs=1e-3)
    assert c.diff_ci == pytest.approx((-14.170, 33.970), abs=1e-3)
    assert c.margin_supported == pytest.approx(26.641, abs=1e-3)
    assert (c.verdict_kind, c.verdict) == ("inconclusive", "inconclusive: about 10 seeds per side needed")
    assert (c.seeds_for_diff, c.seeds_for_equiv, c.seeds_for_equiv_if_equal) == (10, 866, 9)
    # planned before the runs with this pooled SD, 3 runs per side reach 80% power for equivalence within +-22 s
    # (20% of 109.5) if the two are truly equal, not within +-21.5 s (what the READMEs say)
    sd = math.sqrt((2.3 ** 2 + 10.3 ** 2) / 2)
    assert (stats.seeds_needed(0.0, sd, 22.0)["equiv"], stats.seeds_needed(0.0, sd, 21.5)["equiv"]) == (3, 4)
    # at the narrowest margin the numbers support, TOST's p sits at alpha
    assert compare_published(*PAPER, margin=c.margin_supported, goal="min").tost_p == pytest.approx(0.05, abs=1e-9)


def test_cli_prints_the_verdict_and_the_table(capsys):
    assert main(["compare-published", "molt=119.4,2.3,3", "baseline=109.5,10.3,3", "--goal", "min", "--margin",
                 "10%", "--metric", "step time (s)"]) == 0
    out = capsys.readouterr().out
    for line in ("A: molt  119.4 +- 2.3 over 3 runs", "== step time (s) (goal min; margin +-10.95 = 10% of B's mean)",
                 "A-B 9.9 [-14.17, 33.97] (95% Welch CI), [-6.841, 26.64] (90%, TOST's)",
                 "Welch t=1.62 df=2.2 p=0.234   TOST(+-10.95) p=0.439", "need the per-run values: not computed",
                 "to show this difference 10, to show equivalence within +-10.95 866 (9 if the true difference were 0)",
                 "+-26.64 (24.3% of B's mean)", "verdict: inconclusive: about 10 seeds per side needed"):
        assert line in out, line
    assert main(["compare-published", "1,0.1,4", "1.02,0.1,4", "--goal", "max", "--margin", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["name_a"], got["name_b"], got["verdict_kind"]) == ("A", "B", "comparable")


@pytest.mark.parametrize("a,margin,match", [
    ("molt=119.4,2.3,1", "10%", r"1 run\(s\); a standard deviation and a test need at least 2 runs per side"),
    ("molt=119.4,-2.3,3", "10%", "SD -2.3 is negative"),
    ("molt=119.4,2.3", "10%", r"expected \[NAME=\]MEAN,SD,N, e.g. molt=119.4,2.3,3 .*got 2 comma-separated"),
    ("molt=119.4,fast,3", "10%", "the mean or the SD is not a number"),
    ("molt=119.4,2.3,3.5", "10%", "'3.5' is not a whole number of runs"),
    ("molt=119.4,inf,3", "10%", "must be finite numbers"),
    ("molt=119.4,2.3,3", "0", "margin must be a positive number"),
    ("molt=119.4,2.3,3", "ten", "neither a number nor a percentage"),
])
def test_cli_bad_input_names_the_problem_and_exits_2(capsys, a, margin, match):
    assert main(["compare-published", a, "baseline=109.5,10.3,3", "--goal", "min", "--margin", margin]) == 2
    err = capsys.readouterr().err
    assert err.startswith("molt-bench compare-published: error: ")
    assert re.search(match, err), err


def test_parse_side_names_and_relative_margin_on_a_zero_mean():
    assert parse_side("a b=1,2,3", "A") == Side("a b", 1.0, 2.0, 3)
    assert parse_side(" 1, 2 ,3 ", "B") == Side("B", 1.0, 2.0, 3)
    with pytest.raises(ValueError, match="relative to side B's mean, which is 0"):
        compare_published(Side("A", 1, 1, 3), Side("B", 0, 1, 3), margin="10%", goal="max")
