"""``molt-bench compare A B``: hold two run sets to one protocol, summarise each seed, test, and say a verdict.

Steps: load both run sets; refuse if their recorded protocols differ in a field not named by ``allow`` (see
``protocol.check_matched``); for each metric, cut every run at the common horizon on the chosen axis, summarise each
seed to one number (``summaries``), and hand the two arrays to ``stats.compare``. Before any of that,
``check.check_runset`` looks at both sides: an error there (a collapsed run, NaN values, a mismatch metric out of
range) means no verdict, unless the flagged seeds are left out (``exclude``) or the user accepts them
(``accept_check``); with one seed on a side there is no verdict either, and the line says what it would take. The
per-seed values and curves are still reported in both cases. ``summary="ttt"`` tests the time to the metric's
threshold instead (the first x on the ``by`` axis where a seed reaches it; lower is better; the margin, from
``--margin``, defaults to 20% of side B's mean time), so "reaches 0.8 reward sooner in wall time" gets a verdict; a seed
that never reaches the threshold is named, with the fix. The margin comes from
``--margin`` (a number, or ``N%`` of side B's mean) or else from the protocol's metric entry; a relative margin is
turned into metric units with side B's mean, B being the reference. Metrics the protocol does not list can be
compared when both sides logged them, given ``--goal`` and ``--margin``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from . import check, stats, summaries
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
    result: stats.Comparison | None  # None: no verdict, and ``no_verdict`` says why
    no_verdict: str | None = None


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
                    alpha: float = stats.ALPHA, power: float = stats.POWER, n_boot: int = 2000,
                    exclude: list[str] | None = None, accept_check: bool = False, threshold: float | None = None):
    """``exclude``: ``"A:3"``-style seeds to leave out of the comparison (recorded in the report)."""
    a, b = load_runset(path_a), load_runset(path_b)
    for side, rs in (("A", a), ("B", b)):
        rs.exclude(parse_exclude(exclude or [], side))
    allowed = check_matched(a.protocol, b.protocol, allow or [], names=("A", "B"))
    metrics = metrics or list(a.protocol.get("metrics", {}))
    if not metrics:
        raise ProtocolError("no metric to compare: the protocol lists none; pass --metric")
    a.findings, b.findings = check.check_runset(a, metrics), check.check_runset(b, metrics)
    flagged = [f"{side} seed {f.seed} ({f.check})" if f.seed is not None else f"{side} ({f.check})"
               for side, rs in (("A", a), ("B", b)) for f in check.errors(rs.findings)]
    frames = [(s, "A", f) for s, f in a.frames.items()] + [(s, "B", f) for s, f in b.frames.items()]
    results = []
    for metric in metrics:
        spec = resolve_spec(metric, a, None if summary == "ttt" else goal, None if summary == "ttt" else margin)
        spec = spec if threshold is None else replace(spec, threshold=threshold)
        summ = summary or spec.summary
        upto = summaries.horizon([f for _, _, f in frames], metric, by)
        vals = {"A": {}, "B": {}}
        ttt = {"A": {}, "B": {}}
        for seed, side, frame in frames:
            where = f"{(a if side == 'A' else b).path} seed {seed}"
            if summ != "ttt":
                vals[side][seed] = summaries.summarise(frame, spec, by, upto, summ, where)
            ttt[side][seed] = summaries.time_to_threshold(frame, spec, by)
        if summ == "ttt":  # time to threshold: the per-seed value is the first x at the threshold; lower is better
            vals, spec = ttt, _ttt_spec(spec, margin, metric)
            never = [f"{side} seed {s}" for side in ttt for s, v in ttt[side].items() if not math.isfinite(v)]
            if never:
                raise ProtocolError(f"--summary ttt: {', '.join(never)} never reached {metric} {spec.threshold} "
                                    f"within the runs: lower the threshold (--threshold), run longer, or leave the "
                                    f"seed out (--exclude SIDE:SEED)")
        mean_b = float(np.mean(list(vals["B"].values())))
        d = spec.margin_for(mean_b)
        res, why = None, None
        if flagged and not accept_check:
            why = ("no verdict: molt-bench check found errors in " + ", ".join(dict.fromkeys(flagged)) + "; leave "
                   "those seeds out with --exclude SIDE:SEED, or pass --accept-check to compare with them")
        elif min(len(vals["A"]), len(vals["B"])) < 2:
            why = one_seed(list(vals["A"].values()), list(vals["B"].values()), d, alpha, power)
        else:
            res = stats.compare(list(vals["A"].values()), list(vals["B"].values()), margin=d, goal=spec.goal,
                                alpha=alpha, power=power, metric=metric, n_boot=n_boot)
        results.append(MetricResult(spec, summ, by, upto, vals["A"], vals["B"], ttt["A"], ttt["B"], res, why))
    return a, b, allowed, results


def _ttt_spec(spec: MetricSpec, margin: str | None, metric: str) -> MetricSpec:
    if spec.threshold is None:
        raise ProtocolError(f"--summary ttt needs a threshold for {metric}: metrics.{metric}.threshold in the "
                            "protocol, or --threshold")
    m, rel = parse_margin(margin) if margin is not None else (None, 0.2)
    return replace(spec, goal="min", margin=m, margin_rel=rel)


def parse_exclude(items: list[str], side: str) -> list[int]:
    out = []
    for item in items:
        s, sep, seed = item.partition(":")
        if not sep or s.upper() not in ("A", "B") or not seed.strip().lstrip("-").isdigit():
            raise ProtocolError(f"--exclude {item!r}: expected SIDE:SEED, e.g. --exclude B:3")
        if s.upper() == side:
            out.append(int(seed))
    return out


def one_seed(a: list[float], b: list[float], margin: float, alpha: float, power: float) -> str:
    """What a comparison with a single seed on a side can say, and what a verdict would take."""
    diff = float(np.mean(a) - np.mean(b))
    several = [v for v in (a, b) if len(v) > 1]
    line = (f"no verdict: {len(a)} vs {len(b)} seed(s). One run per side shows no seed-to-seed spread, so no test "
            f"can tell a difference of {_f(diff)} (A-B) from luck; a test needs 2 seeds per side at least")
    if several:
        sd = float(np.std(several[0], ddof=1))
        need = stats.seeds_needed(diff, sd, margin, alpha, power)
        return (line + f". With the seed SD the other side shows ({_f(sd, 3)}), seeds per side for {power:.0%} power: "
                f"to show this difference {stats.seeds_text(need['diff'])}, to show equivalence within "
                f"+-{_f(margin, 3)} {stats.seeds_text(need['equiv'])}")
    sds = ", ".join(f"{n}: {stats.min_detectable(n, 1.0, alpha, power):.1f}" for n in (3, 5, 10, 20))
    return line + (f"; with n seeds per side Welch detects (at {power:.0%} power) differences of about k seed SDs, "
                   f"n: k = {sds}. The curves are drawn side by side in the report")


def _f(x: float, digits: int = 4) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def describe_summary(r: MetricResult) -> str:
    s = r.spec
    what = {"final": f"mean of the last {s.last_k} logged steps", "mean": f"mean after {s.warmup} warm-up steps",
            "auc": "area under the curve / x range",
            "ttt": f"first {r.by} at {r.spec.name} {s.threshold}; lower is better"}[r.summary]
    return f"{r.summary} ({what}), by {r.by}, horizon {_f(r.horizon)}"


def text_report(a: RunSet, b: RunSet, allowed: list, results: list[MetricResult]) -> str:
    lines = []
    for side, rs in (("A", a), ("B", b)):
        lines.append(f"{side}: {rs.path}  stack {rs.manifest.get('stack')}  protocol {rs.manifest.get('protocol_name')}"
                     f"@{rs.manifest.get('fingerprint')}  seeds {rs.seeds}"
                     + (f"  (left out: {rs.excluded})" if rs.excluded else ""))
    if allowed:
        lines.append("protocol differences allowed: " + ", ".join(f"{k} (A={va!r}, B={vb!r})" for k, va, vb in allowed))
    for side, rs in (("A", a), ("B", b)):
        if rs.findings:
            lines += [f"check {side}: " + check.text(rs, rs.findings)]
    for r in results:
        lines += ["", f"== {r.spec.name} (goal {r.spec.goal}; {describe_summary(r)})",
                  "  per seed A: " + " ".join(_f(v) for v in r.values_a.values()),
                  "  per seed B: " + " ".join(_f(v) for v in r.values_b.values())]
        c = r.result
        if c is None:
            va, vb = list(r.values_a.values()), list(r.values_b.values())
            lines.append(f"  mean A {_f(float(np.mean(va)))}   mean B {_f(float(np.mean(vb)))}   A-B "
                         f"{_f(float(np.mean(va) - np.mean(vb)))}")
        else:
            lines += [f"  mean A {_f(c.mean_a)} (sd {_f(c.sd_a, 3)})   mean B {_f(c.mean_b)} (sd {_f(c.sd_b, 3)})   "
                      f"A-B {_f(c.diff)} [{_f(c.diff_ci[0])}, {_f(c.diff_ci[1])}] ({100 * (1 - c.alpha):.0f}% Welch "
                      "CI)",
                      f"  Welch t={_f(c.welch_t, 3)} p={_f(c.welch_p, 3)}   Mann-Whitney U={_f(c.mwu_u, 3)} "
                      f"p={_f(c.mwu_p, 3)}   TOST(+-{_f(c.margin, 3)}) p={_f(c.tost_p, 3)}",
                      f"  IQM A {_f(c.iqm_a)} [{_f(c.iqm_a_ci[0])}, {_f(c.iqm_a_ci[1])}]   IQM B {_f(c.iqm_b)} "
                      f"[{_f(c.iqm_b_ci[0])}, {_f(c.iqm_b_ci[1])}]   IQM A-B CI [{_f(c.iqm_diff_ci[0])}, "
                      f"{_f(c.iqm_diff_ci[1])}]",
                      f"  P(A better than B) = {_f(c.prob_improvement, 3)} [{_f(c.prob_improvement_ci[0], 3)}, "
                      f"{_f(c.prob_improvement_ci[1], 3)}]",
                      f"  power: {c.n_a} vs {c.n_b} seeds detect a difference of {_f(c.min_detectable_diff, 3)} with "
                      f"80% power; seeds per side for 80% power: to show this difference "
                      f"{stats.seeds_text(c.seeds_for_diff)}, to show equivalence within +-{_f(c.margin, 3)} "
                      f"{stats.seeds_text(c.seeds_for_equiv)}"]
        if r.spec.threshold is not None:
            for side, t in (("A", r.threshold_a), ("B", r.threshold_b)):
                hit = [v for v in t.values() if not math.isnan(v)]
                med = _f(float(np.median(hit))) if hit else "-"
                lines.append(f"  time to {r.spec.threshold} ({r.by}) {side}: reached by {len(hit)}/{len(t)} seeds, "
                             f"median {med}")
        lines.append(f"  verdict: {verdict_line(r)}")
    return "\n".join(lines)


def verdict_line(r: MetricResult) -> str:
    return r.result.verdict if r.result is not None else r.no_verdict
