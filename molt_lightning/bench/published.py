"""``molt-bench compare-published``: the verdict from numbers as papers report them (mean, SD and runs per side).

A paper that says its 119.4 +- 2.3 s per step over 3 runs is "comparable" to a baseline's 109.5 +- 10.3 s gives
enough to check the claim with the tests that need only means, standard deviations and run counts:

- Welch's t-test: ``scipy.stats.ttest_ind_from_stats(equal_var=False)``;
- TOST within ``(-d, +d)``: two one-sided Welch tests, each ``ttest_ind_from_stats`` with side A's mean shifted by
  ``+d`` (``alternative="greater"``, H0: diff <= -d) and by ``-d`` (``alternative="less"``, H0: diff >= +d); the
  TOST p is the larger one, as ``statsmodels ttost_ind(usevar="unequal")`` computes it from raw values;
- the CIs of mean(A) - mean(B), by hand: diff +- t_{df}(q) * se with the Welch standard error and Welch-Satterthwaite
  df (scipy's ``ttest_ind_from_stats`` returns no interval);
- the verdict and the seed advice: ``stats.decide``, the same rule and power analysis as ``molt-bench compare``.

Mann-Whitney U, the IQM, the probability of improvement and their bootstrap CIs need the per-run values: they are
not computed, and the report says so. So is the normality Welch assumes, which three runs cannot show anyway.
The SD must be the runs' standard deviation (ddof 1), not a standard error (multiply a standard error by sqrt(n)).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import asdict, dataclass

from scipy import stats as st

from . import stats
from .compare import _f
from .protocol import parse_margin

NOT_FROM_SUMMARIES = ("Mann-Whitney U, IQM, probability of improvement and bootstrap CIs need the per-run values: "
                      "not computed from summaries")


@dataclass(frozen=True)
class Side:
    name: str
    mean: float
    sd: float
    n: int


def parse_side(text: str, default_name: str) -> Side:
    """``[NAME=]MEAN,SD,N``, e.g. ``molt=119.4,2.3,3``; every problem named with its fix."""
    name, sep, rest = text.rpartition("=")
    name = name.strip() if sep else default_name
    fields = [f.strip() for f in rest.split(",")]
    form = f"side {default_name} {text!r}: expected [NAME=]MEAN,SD,N, e.g. molt=119.4,2.3,3 (mean, standard " \
           "deviation, number of runs)"
    if len(fields) != 3:
        raise ValueError(f"{form}; got {len(fields)} comma-separated field(s)")
    try:
        mean, sd = float(fields[0]), float(fields[1])
    except ValueError:
        raise ValueError(f"{form}; the mean or the SD is not a number") from None
    if not re.fullmatch(r"\d+", fields[2]):
        raise ValueError(f"{form}; N = {fields[2]!r} is not a whole number of runs")
    return check_side(Side(name or default_name, mean, sd, int(fields[2])))


def check_side(s: Side) -> Side:
    if not (math.isfinite(s.mean) and math.isfinite(s.sd)):
        raise ValueError(f"side {s.name}: mean {s.mean} and SD {s.sd} must be finite numbers")
    if s.sd < 0:
        raise ValueError(f"side {s.name}: SD {s.sd} is negative; give the standard deviation over runs (>= 0)")
    if s.n < 2:
        raise ValueError(f"side {s.name}: {s.n} run(s); a standard deviation and a test need at least 2 runs per "
                         "side. One run shows no run-to-run spread, so it can support no comparison claim")
    return s


@dataclass
class PublishedComparison:
    metric: str
    goal: str
    margin: float
    margin_rel: float | None  # the margin as a fraction of B's mean, when it was given so
    alpha: float
    name_a: str
    name_b: str
    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    sd_a: float
    sd_b: float
    diff: float  # mean(A) - mean(B)
    diff_ci: tuple[float, float]  # Welch (1 - alpha) CI, as `compare` reports it
    tost_ci: tuple[float, float]  # Welch (1 - 2 alpha) CI: TOST says "comparable" iff it lies inside (-d, +d)
    welch_t: float
    welch_df: float
    welch_p: float
    tost_p: float
    margin_supported: float  # the narrowest margin TOST would accept on these numbers (chosen after: not a test)
    seeds_for_equiv_if_equal: int  # runs per side to show equivalence if the true difference were 0
    seeds_for_diff: int
    seeds_for_equiv: int
    min_detectable_diff: float
    verdict: str
    verdict_kind: str
    not_computed: str = NOT_FROM_SUMMARIES

    def as_dict(self) -> dict:
        return asdict(self)


def compare_published(a: Side, b: Side, *, margin: float | str, goal: str, alpha: float = stats.ALPHA,
                      power: float = stats.POWER, metric: str = "metric") -> PublishedComparison:
    """Welch, TOST, CIs and the verdict for two published summaries; ``margin`` a number or ``"10%"`` of B's mean."""
    a, b = check_side(a), check_side(b)
    absolute, rel = parse_margin(margin) if isinstance(margin, str) else (float(margin), None)
    if rel is not None and b.mean == 0:
        raise ValueError(f"margin {margin!r} is relative to side B's mean, which is 0: give it in the metric's units")
    d = absolute if rel is None else rel * abs(b.mean)
    stats.check_goal_margin(goal, d)
    diff = a.mean - b.mean
    va, vb = a.sd ** 2 / a.n, b.sd ** 2 / b.n
    se = math.sqrt(va + vb)
    deterministic = se == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zero SDs make t undefined: reported as NaN
        df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1)) if not deterministic else math.nan
        w = st.ttest_ind_from_stats(a.mean, a.sd, a.n, b.mean, b.sd, b.n, equal_var=False)
        lower = st.ttest_ind_from_stats(a.mean + d, a.sd, a.n, b.mean, b.sd, b.n, equal_var=False,
                                        alternative="greater")  # H0: diff <= -d
        upper = st.ttest_ind_from_stats(a.mean - d, a.sd, a.n, b.mean, b.sd, b.n, equal_var=False,
                                        alternative="less")  # H0: diff >= +d
    tost_p = max(float(lower.pvalue), float(upper.pvalue)) if not deterministic else math.nan
    half = lambda tail: 0.0 if deterministic else float(st.t.ppf(1 - tail, df)) * se  # noqa: E731
    ci, tost_ci = (diff - half(alpha / 2), diff + half(alpha / 2)), (diff - half(alpha), diff + half(alpha))
    sd = math.sqrt((a.sd ** 2 + b.sd ** 2) / 2)
    return PublishedComparison(
        metric=metric, goal=goal, margin=d, margin_rel=rel, alpha=alpha, name_a=a.name, name_b=b.name,
        n_a=a.n, n_b=b.n, mean_a=a.mean, mean_b=b.mean, sd_a=a.sd, sd_b=b.sd, diff=diff, diff_ci=ci, tost_ci=tost_ci,
        welch_t=float(w.statistic), welch_df=df, welch_p=float(w.pvalue), tost_p=tost_p,
        margin_supported=max(tost_ci[1], -tost_ci[0]),
        seeds_for_equiv_if_equal=stats.seeds_needed(0.0, sd, d, alpha, power)["equiv"],
        **stats.decide(diff, a.sd, b.sd, a.n, b.n, float(w.pvalue), tost_p, goal=goal, margin=d, alpha=alpha,
                       power=power),
    )


def text_report(c: PublishedComparison, power: float = stats.POWER) -> str:
    """The same lines as ``molt-bench compare`` prints for a metric, less what needs per-run values."""
    rel = f" = {100 * c.margin_rel:.4g}% of B's mean" if c.margin_rel is not None else ""
    pct = lambda x: f" ({100 * x / abs(c.mean_b):.3g}% of B's mean)" if c.mean_b else ""  # noqa: E731
    many = stats.seeds_text
    conf, conf2 = f"{100 * (1 - c.alpha):.0f}%", f"{100 * (1 - 2 * c.alpha):.0f}%"
    lines = [f"A: {c.name_a}  {_f(c.mean_a)} +- {_f(c.sd_a, 3)} over {c.n_a} runs (published mean, SD, runs)",
             f"B: {c.name_b}  {_f(c.mean_b)} +- {_f(c.sd_b, 3)} over {c.n_b} runs",
             f"== {c.metric} (goal {c.goal}; margin +-{_f(c.margin, 4)}{rel})",
             f"  mean A {_f(c.mean_a)} (sd {_f(c.sd_a, 3)})   mean B {_f(c.mean_b)} (sd {_f(c.sd_b, 3)})   A-B "
             f"{_f(c.diff)} [{_f(c.diff_ci[0])}, {_f(c.diff_ci[1])}] ({conf} Welch CI), [{_f(c.tost_ci[0])}, "
             f"{_f(c.tost_ci[1])}] ({conf2}, TOST's)",
             f"  Welch t={_f(c.welch_t, 3)} df={_f(c.welch_df, 3)} p={_f(c.welch_p, 3)}   "
             f"TOST(+-{_f(c.margin, 4)}) p={_f(c.tost_p, 3)}",
             f"  {c.not_computed}",
             f"  power: {c.n_a} vs {c.n_b} runs detect a difference of {_f(c.min_detectable_diff, 3)} with "
             f"{power:.0%} power; runs per side for {power:.0%} power:",
             f"         to show this difference {many(c.seeds_for_diff)}, to show equivalence within "
             f"+-{_f(c.margin, 4)} {many(c.seeds_for_equiv)} ({many(c.seeds_for_equiv_if_equal)} if the true "
             "difference were 0)"]
    if math.isfinite(c.tost_p):
        lines.append(f"  narrowest margin TOST accepts on these numbers: +-{_f(c.margin_supported, 4)}"
                     f"{pct(c.margin_supported)}, found after seeing them: a measure, not a test")
    lines.append(f"  verdict: {c.verdict}")
    return "\n".join(lines)
