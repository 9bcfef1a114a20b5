"""Two-sample statistics on per-seed summaries, and the one verdict line molt-bench prints.

The unit of analysis is one number per seed (a run's final reward, its mean step time, ...): side A has ``n_a``
seeds, side B ``n_b``. Everything here takes those two arrays.
``published`` gives the same verdict from summaries (mean, SD and seeds per side, as papers report them):
``decide`` is the rule and seed advice both paths share.

Tests and estimates (library first, by hand only where no library does it):
- Welch's t-test: ``scipy.stats.ttest_ind(equal_var=False)``.
- Mann-Whitney U: ``scipy.stats.mannwhitneyu`` (two-sided; exact for small samples).
- TOST equivalence within ``(-d, +d)``: ``statsmodels.stats.weightstats.ttost_ind(usevar="unequal")`` (two one-sided
  Welch tests, Schuirmann 1987).
- Interquartile mean (IQM) and probability of improvement with stratified bootstrap confidence intervals, as rliable
  defines them (Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice"): IQM is
  ``scipy.stats.trim_mean(x, 0.25)``; probability of improvement ``P(A > B) + P(A = B) / 2`` is the normalised
  Mann-Whitney U, computed by hand (a pairwise comparison, checked against scipy's U in the tests). The bootstrap is
  ``scipy.stats.bootstrap`` with both samples resampled independently (stratified by side), percentile intervals
  as rliable uses. rliable itself is not a dependency (it pins pandas<3).
- Power analysis: ``statsmodels.stats.power.TTestIndPower`` (pooled-variance t power; Welch's power at equal
  variances and equal n is within about one point of it).

THE VERDICT RULE (alpha = 0.05 and target power 0.8 unless told otherwise; d > 0 is the equivalence margin, in the
metric's units; "better" follows the metric's goal, higher or lower):
1. "comparable within +-d"     iff TOST p < alpha (the 90% CI of mean(A) - mean(B) lies inside (-d, +d));
2. "A better" / "B better"     iff step 1 fails and Welch p < alpha; the sign of mean(A) - mean(B) and the goal say
                               which;
3. "inconclusive: about N seeds per side needed" otherwise, where N = min(N_diff, N_equiv) (see ``seeds_needed``),
   from the pooled seed-to-seed SD observed here.
Mann-Whitney, IQM and probability of improvement are reported beside it, never used by it. So: when A and B do not
differ, a "better" verdict happens at most at Welch's size (alpha); when |true difference| >= d, "comparable" happens
at most at TOST's size (alpha). With zero seed-to-seed variance (deterministic metrics) the rule compares |diff|
with d directly and says so.

DOCUMENTED CALIBRATION (checked by simulation in tests/bench/test_bench_calibration.py, normal data, SD 1):
- same distribution on both sides, n >= 4 seeds per side: "A better"/"B better" rate = alpha +- 0.02 (below that
  Welch is conservative: about 0.035 at n = 3 and 0.024 at n = 2, so small comparisons err towards "inconclusive");
- ``DOC_SEEDS`` = 20 seeds per side, true shift 1 SD: the verdict names the better side at least ``DOC_POWER`` = 0.85
  of the time (theory 0.87);
- 20 seeds per side, true difference 0, margin 1 SD: "comparable" at least ``DOC_EQUIV_RATE`` = 0.83 of the time
  (simulated 0.85); at a true difference equal to the margin, at most alpha + 0.02;
- the seed counts ``seeds_needed`` recommends reach the target power (0.8) in simulation, within 2 points.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.power import TTestIndPower
from statsmodels.stats.weightstats import ttost_ind

ALPHA = 0.05
POWER = 0.8
DOC_SEEDS = 20
DOC_POWER = 0.85
DOC_EQUIV_RATE = 0.83
MAX_SEEDS = 10_000  # what "not reachable" is reported as


def _arr(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected one value per seed (a 1-D array), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: has NaN or infinite per-seed values {a.tolist()}: a run is missing the metric "
                         "or ended early; drop that seed or pick a metric every run logs")
    if a.size < 2:
        raise ValueError(f"{name}: {a.size} seed(s); at least 2 per side are needed for a variance (5+ advised)")
    return a


def iqm(x, axis: int = -1):
    """Interquartile mean: the mean of the middle 50% (``trim_mean(x, 0.25)``; with n < 4 it is the plain mean)."""
    return stats.trim_mean(x, 0.25, axis=axis)


def prob_improvement(a, b, goal: str = "max"):
    """P(A better than B) + P(tie) / 2 over all seed pairs (rliable's normalised Mann-Whitney U). Broadcasts on the
    leading axes, comparing along the last one."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = a[..., :, None] - b[..., None, :]  # (..., n_a, n_b)
    if goal == "min":
        diff = -diff
    return (diff > 0).mean(axis=(-2, -1)) + 0.5 * (diff == 0).mean(axis=(-2, -1))


def bootstrap_ci(samples: tuple, statistic, alpha: float = ALPHA, n_resamples: int = 2000, seed: int = 0):
    """Percentile CI by ``scipy.stats.bootstrap``; each sample resampled on its own (stratified by side)."""
    with warnings.catch_warnings():  # tiny samples give degenerate resamples; the interval is still what it is
        warnings.simplefilter("ignore")
        res = stats.bootstrap(samples, statistic, vectorized=True, paired=False, confidence_level=1 - alpha,
                              n_resamples=n_resamples, method="percentile", rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):  # every resample gave one value (e.g. all seeds equal)
        low = high = float(statistic(*samples, axis=-1))
    return low, high


def seeds_needed(diff: float, sd: float, margin: float, alpha: float = ALPHA, power: float = POWER) -> dict:
    """Seeds per side for a conclusive verdict if the true difference were ``diff`` and the seed SD ``sd``.

    - ``diff``: for Welch to detect ``diff`` with the given power (two-sided); effect size |diff| / sd.
    - ``equiv``: for TOST to show equivalence within ``margin``: the nearer one-sided test (effect
      (margin - |diff|) / sd, one-sided alpha) at power 1 - (1 - power) / 2, which by Bonferroni guarantees the
      joint power (the farther test is stronger). Unreachable (|diff| >= margin) is reported as ``MAX_SEEDS``.
    """
    out = {}
    pw = TTestIndPower()
    for key, effect, alt, target in (
        ("diff", abs(diff) / sd if sd > 0 else math.inf, "two-sided", power),
        ("equiv", (margin - abs(diff)) / sd if sd > 0 else math.inf, "larger", 1 - (1 - power) / 2),
    ):
        if effect <= 1e-9:
            out[key] = MAX_SEEDS
        elif math.isinf(effect):
            out[key] = 2
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p2 = pw.power(effect_size=effect, nobs1=2, alpha=alpha, alternative=alt)
                if not np.isfinite(p2) or p2 >= target:  # nan: a noncentrality so large the power is 1
                    n = 2  # (the solver, searching above 2 seeds, fails to converge there and says nan)
                else:
                    n = pw.solve_power(effect_size=effect, alpha=alpha, power=target, alternative=alt)
            out[key] = int(min(MAX_SEEDS, max(2, math.ceil(n)))) if np.isfinite(n) else MAX_SEEDS
    return out


def min_detectable(n: int, sd: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest true difference Welch detects with ``power`` at ``n`` seeds per side (in metric units)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        es = TTestIndPower().solve_power(nobs1=n, alpha=alpha, power=power, alternative="two-sided")
    return float(es) * sd


@dataclass
class Comparison:
    metric: str
    goal: str
    margin: float
    alpha: float
    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    sd_a: float
    sd_b: float
    diff: float  # mean(A) - mean(B)
    diff_ci: tuple[float, float]  # Welch (1 - alpha) CI of the difference
    welch_t: float
    welch_p: float
    mwu_u: float
    mwu_p: float
    tost_p: float
    iqm_a: float
    iqm_a_ci: tuple[float, float]
    iqm_b: float
    iqm_b_ci: tuple[float, float]
    iqm_diff_ci: tuple[float, float]
    prob_improvement: float  # P(A better than B)
    prob_improvement_ci: tuple[float, float]
    seeds_for_diff: int
    seeds_for_equiv: int
    min_detectable_diff: float
    verdict: str
    verdict_kind: str  # comparable | A better | B better | inconclusive

    def as_dict(self) -> dict:
        return asdict(self)


def verdict(diff: float, welch_p: float, tost_p: float, goal: str, margin: float, alpha: float,
            n_needed: int, deterministic: bool = False) -> tuple[str, str]:
    """The rule in the module docstring, as (kind, line)."""
    d = f"{margin:.4g}"
    better = "A better" if (diff > 0) == (goal == "max") else "B better"
    if deterministic:  # no seed-to-seed variation: no test is defined, compare directly
        if abs(diff) < margin:
            return "comparable", f"comparable within +-{d} (no variation between seeds)"
        return better, f"{better} (no variation between seeds)"
    if tost_p < alpha:
        return "comparable", f"comparable within +-{d}"
    if welch_p < alpha:
        return better, better
    many = seeds_text(n_needed) if n_needed >= MAX_SEEDS else f"about {n_needed}"
    return "inconclusive", f"inconclusive: {many} seeds per side needed"


def seeds_text(n: int) -> str:
    """A seed count from ``seeds_needed`` as printed: its cap ``MAX_SEEDS`` means unreachable, "more than 10000"."""
    return f"more than {MAX_SEEDS}" if n >= MAX_SEEDS else str(n)


def check_goal_margin(goal: str, margin: float) -> None:
    if goal not in ("max", "min"):
        raise ValueError(f"goal must be 'max' or 'min', got {goal!r}")
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"the equivalence margin must be a positive number, got {margin!r}: set `margin` for the "
                         "metric in the protocol or pass --margin")


def decide(diff: float, sd_a: float, sd_b: float, n_a: int, n_b: int, welch_p: float, tost_p: float, *, goal: str,
           margin: float, alpha: float = ALPHA, power: float = POWER) -> dict:
    """The verdict and its seed advice from what every path computes (per-seed values here, published summaries in
    ``published``): seeds per side for the observed difference and for equivalence from the pooled seed SD, the
    smallest difference these seeds detect, and the rule's (kind, line)."""
    sd = math.sqrt((sd_a ** 2 + sd_b ** 2) / 2)
    need = seeds_needed(diff, sd, margin, alpha, power)
    kind, line = verdict(diff, welch_p, tost_p, goal, margin, alpha, min(need.values()), sd_a == 0 and sd_b == 0)
    return dict(seeds_for_diff=need["diff"], seeds_for_equiv=need["equiv"],
                min_detectable_diff=min_detectable(min(n_a, n_b), sd, alpha, power), verdict=line, verdict_kind=kind)


def compare(a, b, *, margin: float, goal: str = "max", alpha: float = ALPHA, power: float = POWER,
            metric: str = "metric", n_boot: int = 2000, seed: int = 0) -> Comparison:
    """All statistics for per-seed values ``a`` (side A) and ``b`` (side B), and the verdict."""
    a, b = _arr(a, "side A"), _arr(b, "side B")
    check_goal_margin(goal, margin)
    diff = float(a.mean() - b.mean())
    sd_a, sd_b = float(a.std(ddof=1)), float(b.std(ddof=1))
    deterministic = sd_a == 0 and sd_b == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # identical values make t undefined: reported as NaN
        w = stats.ttest_ind(a, b, equal_var=False)
        ci = w.confidence_interval(1 - alpha) if not deterministic else (diff, diff)
        tost_p = float(ttost_ind(a, b, -margin, margin, usevar="unequal")[0]) if not deterministic else math.nan
    mwu = stats.mannwhitneyu(a, b, alternative="two-sided")
    return Comparison(
        metric=metric, goal=goal, margin=margin, alpha=alpha, n_a=a.size, n_b=b.size,
        mean_a=float(a.mean()), mean_b=float(b.mean()), sd_a=sd_a, sd_b=sd_b, diff=diff,
        diff_ci=(float(ci[0]), float(ci[1])), welch_t=float(w.statistic), welch_p=float(w.pvalue),
        mwu_u=float(mwu.statistic), mwu_p=float(mwu.pvalue), tost_p=tost_p,
        iqm_a=float(iqm(a)), iqm_a_ci=bootstrap_ci((a,), iqm, alpha, n_boot, seed),
        iqm_b=float(iqm(b)), iqm_b_ci=bootstrap_ci((b,), iqm, alpha, n_boot, seed),
        iqm_diff_ci=bootstrap_ci((a, b), lambda x, y, axis=-1: iqm(x, axis) - iqm(y, axis), alpha, n_boot, seed),
        prob_improvement=float(prob_improvement(a, b, goal)),
        prob_improvement_ci=bootstrap_ci((a, b), lambda x, y, axis=-1: prob_improvement(x, y, goal), alpha,
                                         n_boot, seed),
        **decide(diff, sd_a, sd_b, a.size, b.size, float(w.pvalue), tost_p, goal=goal, margin=margin, alpha=alpha,
                 power=power),
    )


def verdict_kinds(a: np.ndarray, b: np.ndarray, margin: float, goal: str = "max", alpha: float = ALPHA) -> np.ndarray:
    """The verdict kind for many simulated comparisons at once: ``a`` (n_a, S), ``b`` (n_b, S) -> (S,) strings.

    The same rule and the same library calls as ``compare`` (vectorised over columns), without the bootstrap and
    the power analysis: what the calibration simulations exercise.
    """
    w = stats.ttest_ind(a, b, axis=0, equal_var=False)  # (S,)
    tost_p = np.asarray(ttost_ind(a, b, -margin, margin, usevar="unequal")[0])  # (S,)
    diff = a.mean(0) - b.mean(0)  # (S,)
    better_a = (diff > 0) == (goal == "max")
    return np.where(tost_p < alpha, "comparable",
                    np.where(w.pvalue < alpha, np.where(better_a, "A better", "B better"), "inconclusive"))
