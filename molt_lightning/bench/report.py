"""Reports of a comparison: ``report.md`` and a self-contained ``report.html``, PNG plots, ``summary.json``.

Per metric two plots (matplotlib, Agg backend): the curves (mean over seeds against step, samples or wall time, with
a t-based 95% confidence band, thin lines for single seeds), and the per-seed summary values of both sides with
their means and Welch intervals. The HTML embeds the PNGs (base64), so one file can be mailed or attached.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np

from . import summaries
from .compare import MetricResult, describe_summary, text_report, verdict_line
from .runs import RunSet

COLORS = ("tab:blue", "tab:orange")


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _alpha(r: MetricResult) -> float:
    return r.result.alpha if r.result is not None else 0.05


def plot_curves(a: RunSet, b: RunSet, r: MetricResult, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (rs, label), color in zip(((a, "A"), (b, "B")), COLORS):
        frames = list(rs.frames.values())
        grid, values = summaries.curves(frames, r.spec.name, r.by, r.horizon)
        mean, low, high = summaries.band(values, _alpha(r))
        for row in values:
            ax.plot(grid, row, color=color, lw=0.5, alpha=0.35)
        ax.plot(grid, mean, color=color, lw=2, label=f"{label}: {rs.label} (n={len(frames)})")
        ax.fill_between(grid, low, high, color=color, alpha=0.2)
    if r.spec.threshold is not None:
        ax.axhline(r.spec.threshold, color="grey", ls=":", lw=1)
    what = "one run per side" if len(a.frames) == 1 and len(b.frames) == 1 else "mean and 95% CI over seeds"
    ax.set(xlabel={"step": "optimizer step", "samples": "samples consumed", "wall": "wall seconds"}[r.by],
           ylabel=r.spec.name, title=f"{r.spec.name}: {what}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_seeds(a: RunSet, b: RunSet, r: MetricResult, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.2, 3.8))
    rng = np.random.default_rng(0)
    for i, (vals, color) in enumerate(((r.values_a, COLORS[0]), (r.values_b, COLORS[1]))):
        v = np.array(list(vals.values()))
        ax.scatter(i + rng.uniform(-0.08, 0.08, v.size), v, color=color, s=22, zorder=3)
        mean, low, high = summaries.band(v, _alpha(r))
        ax.errorbar(i + 0.25, mean, yerr=high - mean, fmt="s", color="black", capsize=4, ms=5)
    ax.set_xticks([0, 1], [f"A\n{a.label}", f"B\n{b.label}"], fontsize=8)
    ax.set(ylabel=f"{r.spec.name} ({r.summary})", title="per-seed values, mean and 95% CI")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, a: RunSet, b: RunSet, allowed: list, results: list[MetricResult]) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = text_report(a, b, allowed, results)
    pngs = {}
    for r in results:
        name = _safe(r.spec.name)
        pngs[r.spec.name] = (out / f"curves_{name}.png", out / f"seeds_{name}.png")
        plot_curves(a, b, r, pngs[r.spec.name][0])
        plot_seeds(a, b, r, pngs[r.spec.name][1])
    md = ["# molt-bench comparison", "", f"- **A**: `{a.path}` ({a.label})", f"- **B**: `{b.path}` ({b.label})", ""]
    md += ["| metric | summary | mean A | mean B | A-B [CI] | Welch p | TOST p (margin) | verdict |",
           "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.result
        if c is None:
            ma, mb = np.mean(list(r.values_a.values())), np.mean(list(r.values_b.values()))
            md.append(f"| {r.spec.name} | {r.summary} by {r.by} | {ma:.4g} | {mb:.4g} | {ma - mb:+.3g} | - | - | "
                      f"**{verdict_line(r)}** |")
            continue
        md.append(f"| {c.metric} | {r.summary} by {r.by} | {c.mean_a:.4g} | {c.mean_b:.4g} | {c.diff:+.3g} "
                  f"[{c.diff_ci[0]:.3g}, {c.diff_ci[1]:.3g}] | {c.welch_p:.3g} | {c.tost_p:.3g} (+-{c.margin:.3g}) "
                  f"| **{c.verdict}** |")
    alpha = next((r.result.alpha for r in results if r.result is not None), 0.05)
    checks = [f"- {side}: {f.line().strip()}" for side, rs in (("A", a), ("B", b)) for f in rs.findings]
    md += ["", "## molt-bench check", "", *(checks or ["No findings on either side."])]
    md += ["", f"Verdict rule (alpha {alpha:g}): comparable within +-d iff TOST p < alpha; else A/B better iff Welch "
           "p < alpha; else inconclusive, with the seeds per side a conclusive answer needs.", ""]
    for r in results:
        curve, seeds = pngs[r.spec.name]
        md += [f"## {r.spec.name}", "", f"{describe_summary(r)}", "", f"![curves]({curve.name}) ![seeds]({seeds.name})",
               ""]
    md += ["## Full output", "", "```", text, "```", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(_html(a, b, results, pngs, text))
    summary = {"a": str(a.path), "b": str(b.path), "allowed_differences": allowed,
               "excluded": {"A": a.excluded, "B": b.excluded},
               "check": {side: [vars(f) for f in rs.findings] for side, rs in (("A", a), ("B", b))},
               "metrics": [{"metric": r.spec.name, "summary": r.summary, "by": r.by, "horizon": r.horizon,
                            "values_a": r.values_a, "values_b": r.values_b, "no_verdict": r.no_verdict,
                            **(r.result.as_dict() if r.result is not None else {})} for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return {"markdown": out / "report.md", "html": out / "report.html", "json": out / "summary.json"}


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(path.name)}">'


def _html(a: RunSet, b: RunSet, results: list[MetricResult], pngs: dict, text: str) -> str:
    def row(r: MetricResult) -> str:
        ma, mb = np.mean(list(r.values_a.values())), np.mean(list(r.values_b.values()))
        p = (f"{r.result.welch_p:.3g}", f"{r.result.tost_p:.3g}") if r.result is not None else ("-", "-")
        return (f"<tr><td>{html.escape(r.spec.name)}</td><td>{ma:.4g}</td><td>{mb:.4g}</td><td>{ma - mb:+.3g}</td>"
                f"<td>{p[0]}</td><td>{p[1]}</td><td><b>{html.escape(verdict_line(r))}</b></td></tr>")

    rows = "".join(row(r) for r in results)
    sections = "".join(f"<h2>{html.escape(name)}</h2>{_img(c)}{_img(s)}" for name, (c, s) in pngs.items())
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>molt-bench comparison</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px}img{max-width:49%}pre{background:#f6f6f6;padding:1em;"
        "overflow-x:auto}</style></head><body><h1>molt-bench comparison</h1>"
        f"<p><b>A</b>: {html.escape(str(a.path))} ({html.escape(a.label)})<br><b>B</b>: {html.escape(str(b.path))} "
        f"({html.escape(b.label)})</p><table><tr><th>metric</th><th>mean A</th><th>mean B</th><th>A-B</th>"
        f"<th>Welch p</th><th>TOST p</th><th>verdict</th></tr>{rows}</table>{sections}"
        f"<h2>Full output</h2><pre>{html.escape(text)}</pre></body></html>"
    )
