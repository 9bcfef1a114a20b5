"""What each page of ``molt view`` shows, as plain data for its template (``server`` routes, ``templates/`` render).

The overview's charts (``CHARTS``), a step's groups, a sample's tokens with the values to colour them by (``FIELDS``),
the timeline's bars, the sample search and the comparison (molt-bench's own ``compare_runsets``: the same numbers as
``molt-bench compare``).
"""

from __future__ import annotations

import math

import pandas as pd

from .runs import Run, finite

# (title, metrics drawn, y-axis label): the first three are drawn with the held-out rounds, the lag bound, ...
CHARTS = [
    ("reward", ["reward", "reward/all_samples"], "mean reward"),
    ("lag (staleness of the batch's tokens)", ["lag", "lag/max"], "policy versions"),
    ("mismatch (engine vs trainer)", ["mismatch/kl", "mismatch/abs_logprob_diff"], "nats"),
    ("throughput", ["perf/gen_tokens_per_s"], "generated tokens / s"),
    ("weight sync", ["perf/weight_sync_s"], "seconds"),
    ("step time", ["perf/step_time_s", "perf/trainer_idle_s", "perf/train_compute_s"], "seconds"),
]
# per-token fields the sample view colours by: (key, label)
FIELDS = [("staleness", "staleness (versions behind the step)"), ("version", "policy version"),
          ("adv", "advantage"), ("gap", "engine - trainer logprob"), ("is_weight", "importance weight"),
          ("trained", "trained or not"), ("entropy", "entropy")]
KINDS = {0: "prompt", 1: "policy", 2: "environment / tool"}


def _series(x, y, name: str) -> dict:
    return {"name": name, "x": [finite(v) for v in x], "y": [finite(v) for v in y]}


def curves(run: Run) -> dict:
    """The overview's charts: per chart the series (a run, or each seed of a run set) and the held-out rounds."""
    charts = []
    frames = _frames(run)
    for title, names, unit in CHARTS:
        series = [_series(f["step"], f[n], f"{n}{label}") for label, f in frames for n in names if n in f]
        if series:
            charts.append({"title": title, "unit": unit, "series": series})
    if charts and charts[0]["title"] == "reward":
        charts[0]["heldout"] = run.heldout()
    names = sorted({c for _, f in frames for c in f.columns if c not in ("step", "epoch")})
    return {"charts": charts, "metrics": names, "live": run.live, "clickable": run.kind == "fit" and
            bool(run.trace.steps), "notes": run.notes()}


def metric_series(run: Run, name: str) -> dict:
    return {"title": name, "unit": "", "series": [_series(f["step"], f[name], f"{name}{label}")
                                                  for label, f in _frames(run) if name in f]}


def _frames(run: Run) -> list[tuple[str, pd.DataFrame]]:
    """(label, one row per step) for a run, or per seed of a run set."""
    if run.kind == "runset":
        from ..bench.runs import RunSetError, load_runset

        try:
            rs = load_runset(run.path)
        except (RunSetError, ValueError, KeyError) as e:
            run.load_error = str(e)
            return []
        return [(f" (seed {s})", f) for s, f in sorted(rs.frames.items())]
    frame = run.metrics()
    return [("", frame)] if "step" in frame and len(frame) else []


def step(run: Run, s: int) -> dict:
    entry = run.step(s)
    steps = sorted(run.trace.steps)
    near = {"prev": max((x for x in steps if x < s), default=None), "next": min((x for x in steps if x > s),
                                                                                default=None)}
    if entry is None:
        return {"s": s, "entry": None, **near, "outcasts": []}
    groups = []
    for g in entry.get("groups", []):
        members = []
        for m_i, m in enumerate(g["members"]):
            adv = next((a for seg in m["segments"] for a, k in zip(seg.get("adv", []), seg["kind"])
                        if k == 1 and a is not None), None)
            members.append({**m, "index": m_i, "advantage": adv})
        groups.append({**g, "members": members})
    outcasts = [(k, o) for k, o in enumerate(run.trace.outcasts) if o["step"] == s]
    evals = [e for e in run.trace.evals if e.get("step") == s]
    return {"s": s, "entry": entry, "groups": groups, "outcasts": outcasts, "evals": evals, **near,
            "metrics": _key_metrics(entry.get("metrics", {}))}


def _key_metrics(m: dict) -> list[tuple[str, float]]:
    keys = ["reward", "reward/std", "lag", "lag/max", "mismatch/kl", "is/ratio_mean", "loss/clip_frac", "entropy",
            "grad_norm", "batch/policy_tokens", "select/kept_frac", "samples/failed", "samples/dropped_stale_samples",
            "samples/dropped_filtered_samples", "perf/step_time_s"]
    return [(k, m[k]) for k in keys if k in m]


def sample(run: Run, s: int, g: int, m: int) -> dict:
    """A recorded sample's tokens: per token its text, kind and every value, with its staleness and gap."""
    entry = run.step(s) or {}
    group = next((x for x in entry.get("groups", []) if x["group"] == g), None)
    if group is None or not 0 <= m < len(group["members"]):
        return {"s": s, "g": g, "m": m, "member": None, "blocks": [], "fields": FIELDS}
    member, version = group["members"][m], entry.get("version")
    blocks = []  # runs of tokens of one kind: prompt, policy, environment / tool
    for n, seg in enumerate(member["segments"]):
        for j, (text, kind) in enumerate(zip(seg["text"], seg["kind"])):
            tok = {"i": j, "segment": n, "text": text, "kind": kind, "id": seg["tokens"][j]}
            for key in ("version", "engine_lp", "trainer_lp", "adv", "is_weight", "entropy", "trained"):
                tok[key] = seg.get(key, [None] * (j + 1))[j]
            if kind == 1:
                tok["staleness"] = None if tok["version"] is None or version is None else version - tok["version"]
                gap = (tok["engine_lp"] - tok["trainer_lp"]) if None not in (tok["engine_lp"], tok["trainer_lp"]) \
                    else None
                tok["gap"] = None if gap is None else round(gap, 4)
            if not blocks or blocks[-1]["kind"] != kind or blocks[-1]["segment"] != n:
                blocks.append({"kind": kind, "label": KINDS.get(kind, "?"), "segment": n, "tokens": []})
            blocks[-1]["tokens"].append(tok)
    return {"s": s, "g": g, "m": m, "member": member, "version": version, "blocks": blocks, "fields": FIELDS,
            "group": group}


def outcast(run: Run, k: int) -> dict:
    entry = run.outcast(k)
    return {"k": k, "entry": entry, "kinds": KINDS}


def timeline(run: Run, first: int | None, last: int | None) -> dict:
    """Bars on wall time (seconds from the first step shown): the trainer's phases per step, each group's generation
    (lanes so that overlapping groups do not hide each other), held-out rounds."""
    steps = sorted(run.trace.steps)
    if not steps:
        return {"data": {"bars": []}, "first": first, "last": last, "steps": steps}
    last = steps[-1] if last is None else last
    first = max(steps[0], last - 19) if first is None else first
    shown = [run.trace.steps[s] for s in steps if first <= s <= last]
    t0 = min([e["start"] for e in shown] + [g["started"] for e in shown for g in e.get("batch", []) if g["started"]])
    bars, lanes = [], []
    for e in shown:
        t = e["start"]
        for phase in ("wait_rollouts", "train", "weight_sync"):
            d = e.get("phases", {}).get(phase, 0.0)
            bars.append({"lane": f"trainer: {phase.replace('_', ' ')}", "start": t - t0, "length": d,
                         "step": e["step"], "what": f"step {e['step']}: {phase.replace('_', ' ')} {d:.3f} s"})
            t += d
        for g in e.get("batch", []):
            if not g["started"]:
                continue
            lane = next((i for i, end in enumerate(lanes) if end <= g["started"]), None)
            if lane is None:
                lanes.append(0.0)
                lane = len(lanes) - 1
            lanes[lane] = g["ended"]
            bars.append({"lane": f"generation {lane + 1}", "start": g["started"] - t0,
                         "length": g["ended"] - g["started"], "step": e["step"],
                         "what": f"group {g['group']} (sample {g['sample_id']}), trained at step {e['step']}: "
                                 f"{g['ended'] - g['started']:.3f} s"})
    for ev in run.trace.evals:
        if ev.get("end") and first <= (ev.get("step") or 0) <= last:
            bars.append({"lane": "evaluation", "start": ev["end"] - ev["seconds"] - t0, "length": ev["seconds"],
                         "step": ev["step"], "what": f"held-out round of version {ev['version']}: "
                                                     f"{ev['seconds']:.2f} s"})
    return {"data": {"bars": bars}, "first": first, "last": last, "steps": steps}


def search(run: Run, q: dict) -> dict:
    """Recorded samples filtered by reward range, status, trained or not, and text."""
    rows, text = run.samples(), (q.get("text") or "").strip()
    lo, hi = finite(q.get("min")), finite(q.get("max"))
    status, trained = q.get("status") or "", q.get("trained") or ""
    out = []
    for r in rows:
        reward = r.get("reward")
        if (lo is not None and (reward is None or reward < lo)) or (hi is not None and (reward is None or reward > hi)):
            continue
        if (status and r.get("status") != status) or (trained and str(r["trained"]).lower() != trained):
            continue
        out.append(r)
    if text:  # reads the matching entries back from the record
        out = [r for r in out if text.lower() in run.text_of(r).lower()]
    statuses = sorted({str(r.get("status")) for r in rows})
    return {"rows": out[:500], "total": len(out), "of": len(rows), "q": q, "statuses": statuses}


def compare_metrics(runs: list[Run]) -> list[str]:
    names = set()
    for r in runs:
        for _, f in _frames(r):
            names |= {c for c in f.columns if c not in ("step", "epoch", "samples", "wall_s")}
    return sorted(names, key=lambda n: (n != "reward", n))


def compare(runs: list[Run], metric: str) -> dict:
    """Curves of ``metric`` overlaid, and for run sets molt-bench's verdict of the first (A) against each other one
    (B: ``molt-bench compare FIRST OTHER``)."""
    series = [_series(f["step"], f[metric], f"{r.name}{label}") for r in runs for label, f in _frames(r)
              if metric in f]
    verdicts, notes = [], []
    if not 2 <= len(runs) <= 4:
        notes.append("Choose 2 to 4 runs.")
    sets = [r for r in runs if r.kind == "runset"]
    if len(sets) < len(runs):
        notes.append("A verdict needs molt-bench run sets (seeds of one protocol: `molt-bench run` or `molt-bench "
                     "import`); a single molt fit run is one seed, so its curves are drawn without one.")
    from ..bench.compare import compare_runsets, verdict_line

    for other in sets[1:] if len(sets) == len(runs) else []:
        try:
            a, b, _, results = compare_runsets(sets[0].path, other.path, [metric])
        except Exception as e:  # noqa: BLE001 (shown on the page: unmatched protocols, a metric not listed)
            verdicts.append({"a": sets[0].name, "b": other.name, "error": str(e)})
            continue
        r = results[0]
        c = r.result
        verdicts.append({"a": sets[0].name, "b": other.name, "verdict": verdict_line(r), "summary": r.summary,
                         "mean_a": _mean(r.values_a), "mean_b": _mean(r.values_b), "n_a": len(r.values_a),
                         "n_b": len(r.values_b), "diff": None if c is None else c.diff,
                         "ci": None if c is None else c.diff_ci, "welch_p": None if c is None else c.welch_p,
                         "tost_p": None if c is None else c.tost_p, "kind": None if c is None else c.verdict_kind,
                         "margin": r.spec.margin_for(_mean(r.values_b))})
    return {"chosen": runs, "data": {"series": series, "title": metric}, "verdicts": verdicts,
            "notes": notes}


def _mean(values: dict) -> float:
    v = [x for x in values.values() if x is not None and math.isfinite(x)]
    return sum(v) / len(v) if v else math.nan
