"""``molt-bench compare A B``: hold two run sets to one protocol, summarise each seed, test, and say a verdict.

Steps: load both run sets; refuse if their recorded protocols differ in a field not named by ``allow`` (see
``protocol.check_matched``); for each metric, cut every run at the common horizon on the chosen axis, summarise each
seed to one number (``summaries``), and hand the two arrays to ``stats.compare``. The margin comes from
``--margin`` (a number, or ``N%`` of side B's mean) or else from the protocol's metric entry; a relative margin is
turned into metric units with side B's mean, B being the reference. Metrics the protocol does not list can be
compared when both sides logged them, given ``--goal`` and ``--margin``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from . import stats, summaries
from .protocol import MetricSpec, ProtocolError, check_matched, metric_spec, parse_margin
from .runs import RunSet, load_runset


@dataclass
class MetricResult:
    spec: MetricSpec
    summary: str
    by: str
    horizon: float
    values_a: dict[int, float]
    values_b: dict[int, float]
    threshold_a: dict[int, float]
    threshold_b: dict[int, float]
    result: stats.Comparison


def resolve_spec(metric: str, a: RunSet, goal: str | None, margin: str | None) -> MetricSpec:
    raw = a.protocol.get("metrics", {}).get(metric)
    if raw is None:
        if goal is None or margin is None:
            listed = sorted(a.protocol.get("metrics", {}))
            raise ProtocolError(f"metric {metric!r} is not in the protocol (it lists {listed}); to compare it anyway "
                                "pass --goal max|min and --margin")
        raw = {}
    spec = metric_spec(metric, raw)
    if goal is not None:
        spec = replace(spec, goal=goal)
    if margin is not None:
        m, rel = parse_margin(margin)
        spec = replace(spec, margin=m, margin_rel=rel)
    return spec


def compare_runsets(path_a, path_b, metrics: list[str] | None = None, *, by: str = "step", summary: str | None = None,
                    margin: str | None = None, goal: str | None = None, allow: list[str] | None = None,
                    alpha: float = stats.ALPHA, power: float = stats.POWER, n_boot: int = 2000):
    a, b = load_runset(path_a), load_runset(path_b)
    allowed = check_matched(a.protocol, b.protocol, allow or [], names=("A", "B"))
    metrics = metrics or list(a.protocol.get("metrics", {}))
    if not metrics:
        raise ProtocolError("no metric to compare: the protocol lists none; pass --metric")
    frames = [(s, "A", f) for s, f in a.frames.items()] + [(s, "B", f) for s, f in b.frames.items()]
    results = []
    for metric in metrics:
        spec = resolve_spec(metric, a, goal, margin)
        summ = summary or spec.summary
        upto = summaries.horizon([f for _, _, f in frames], metric, by)
        vals = {"A": {}, "B": {}}
        ttt = {"A": {}, "B": {}}
        for seed, side, frame in frames:
            where = f"{(a if side == 'A' else b).path} seed {seed}"
            vals[side][seed] = summaries.summarise(frame, spec, by, upto, summ, where)
            ttt[side][seed] = summaries.time_to_threshold(frame, spec, by)
        mean_b = float(np.mean(list(vals["B"].values())))
        d = spec.margin_for(mean_b)
        res = stats.compare(list(vals["A"].values()), list(vals["B"].values()), margin=d, goal=spec.goal,
                            alpha=alpha, power=power, metric=metric, n_boot=n_boot)
        results.append(MetricResult(spec, summ, by, upto, vals["A"], vals["B"], ttt["A"], ttt["B"], res))
    return a, b, allowed, results


def _f(x: float, digits: int = 4) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def describe_summary(r: MetricResult) -> str:
    s = r.spec
    what = {"final": f"mean of the last {s.last_k} logged steps", "mean": f"mean after {s.warmup} warm-up steps",
            "auc": "area under the curve / x range"}[r.summary]
    return f"{r.summary} ({what}), by {r.by}, horizon {_f(r.horizon)}"


def text_report(a: RunSet, b: RunSet, allowed: list, results: list[MetricResult]) -> str:
    lines = [f"A: {a.path}  stack {a.manifest.get('stack')}  protocol {a.manifest.get('protocol_name')}"
             f"@{a.manifest.get('fingerprint')}  seeds {a.seeds}",
             f"B: {b.path}  stack {b.manifest.get('stack')}  protocol {b.manifest.get('protocol_name')}"
             f"@{b.manifest.get('fingerprint')}  seeds {b.seeds}"]
    if allowed:
        lines.append("protocol differences allowed: " + ", ".join(f"{k} (A={va!r}, B={vb!r})" for k, va, vb in allowed))
    for r in results:
        c = r.result
        lines += ["", f"== {c.metric} (goal {c.goal}; {describe_summary(r)})",
                  "  per seed A: " + " ".join(_f(v) for v in r.values_a.values()),
                  "  per seed B: " + " ".join(_f(v) for v in r.values_b.values()),
                  f"  mean A {_f(c.mean_a)} (sd {_f(c.sd_a, 3)})   mean B {_f(c.mean_b)} (sd {_f(c.sd_b, 3)})   "
                  f"A-B {_f(c.diff)} [{_f(c.diff_ci[0])}, {_f(c.diff_ci[1])}] ({100 * (1 - c.alpha):.0f}% Welch CI)",
                  f"  Welch t={_f(c.welch_t, 3)} p={_f(c.welch_p, 3)}   Mann-Whitney U={_f(c.mwu_u, 3)} "
                  f"p={_f(c.mwu_p, 3)}   TOST(+-{_f(c.margin, 3)}) p={_f(c.tost_p, 3)}",
                  f"  IQM A {_f(c.iqm_a)} [{_f(c.iqm_a_ci[0])}, {_f(c.iqm_a_ci[1])}]   IQM B {_f(c.iqm_b)} "
                  f"[{_f(c.iqm_b_ci[0])}, {_f(c.iqm_b_ci[1])}]   IQM A-B CI [{_f(c.iqm_diff_ci[0])}, "
                  f"{_f(c.iqm_diff_ci[1])}]",
                  f"  P(A better than B) = {_f(c.prob_improvement, 3)} [{_f(c.prob_improvement_ci[0], 3)}, "
                  f"{_f(c.prob_improvement_ci[1], 3)}]",
                  f"  power: {c.n_a} vs {c.n_b} seeds detect a difference of {_f(c.min_detectable_diff, 3)} with 80% "
                  f"power; seeds per side for 80% power: to show this difference {c.seeds_for_diff}, to show "
                  f"equivalence within +-{_f(c.margin, 3)} {c.seeds_for_equiv}"]
        if r.spec.threshold is not None:
            for side, t in (("A", r.threshold_a), ("B", r.threshold_b)):
                hit = [v for v in t.values() if not math.isnan(v)]
                med = _f(float(np.median(hit))) if hit else "-"
                lines.append(f"  time to {r.spec.threshold} ({r.by}) {side}: reached by {len(hit)}/{len(t)} seeds, "
                             f"median {med}")
        lines.append(f"  verdict: {c.verdict}")
    return "\n".join(lines)
