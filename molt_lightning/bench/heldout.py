"""``molt-bench heldout``: held-out accuracy before and after training, per source, with molt-bench's verdict.

    molt-bench heldout RUN_DIR                   # the first and the last round of the run's eval.jsonl
    molt-bench heldout BEFORE.json AFTER.json    # two `molt eval --out` files (e.g. the base and the export)

For each source: avg@k, pass@1, pass@k and maj@k before and after with their 95% intervals (as ``Evaluate`` logged
them), and the verdict of ``stats.compare`` on the per-prompt avg@k values (after = A, before = B, goal max, margin
``--margin`` in accuracy points): "A better" means the trained policy scores higher on prompts it never trained on.
The unit is the prompt, not the seed: the verdict says how sure one run's improvement is over the prompt sample, not
how it would vary over training seeds. The two sides share their prompts; Welch's test treats them as independent,
which is conservative for a paired design.
"""

from __future__ import annotations

import json
from pathlib import Path

from .stats import compare


def load(paths: list[Path]) -> tuple[dict, dict]:
    """(before, after) rounds: ``{"k", "metrics", "per_prompt"}`` each, with ``"version"`` (a run's round) or
    ``"policy"`` (a ``molt eval --out`` file), and ``"file"`` for a file."""
    if len(paths) == 1 and paths[0].is_dir():
        log = paths[0] / "eval.jsonl"
        if not log.exists():
            raise ValueError(f"{paths[0]} holds no eval.jsonl: give a run folder of a run with the Evaluate callback")
        rounds = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        if len(rounds) < 2:
            raise ValueError(f"{log} holds {len(rounds)} round(s): before/after needs the first and the last")
        return rounds[0], rounds[-1]
    if len(paths) == 2:
        return tuple({**json.loads(p.read_text()), "file": str(p)} for p in paths)
    raise ValueError("give one run folder (its eval.jsonl) or two `molt eval --out` files (before, after)")


def heldout(paths: list[Path], margin: float = 0.05) -> str:
    before, after = load(paths)
    k = after["k"]
    lines = ["| source | metric | before | after |", "|---|---|---|---|"]
    verdicts = []
    for source in after["metrics"]:
        if source not in before["metrics"]:
            raise ValueError(f"source {source!r} is in the after round only: evaluate both on the same tasks")
        b, a = before["metrics"][source], after["metrics"][source]
        for name in (f"avg@{k}", "pass@1", f"pass@{k}", f"maj@{k}"):
            if name in a and name in b:
                lines.append(f"| {source} | {name} | {_cell(b, name)} | {_cell(a, name)} |")
        c = compare(after["per_prompt"][source], before["per_prompt"][source], margin=margin, goal="max",
                    metric=f"avg@{k}")
        verdict = c.verdict.replace("seeds", "prompts")  # the unit here
        verdicts.append(f"{source}: avg@{k} {c.mean_b:.3f} -> {c.mean_a:.3f} ({c.diff:+.3f}, 95% CI "
                        f"[{c.diff_ci[0]:+.3f}, {c.diff_ci[1]:+.3f}], {c.n_a} prompts): {verdict} "
                        f"(Welch p={c.welch_p:.2g}, margin +-{margin})")
    where = [f"before: {_label(before)}", f"after: {_label(after)}"]
    return "\n".join([", ".join(where), "", *lines, "", *verdicts])


def _label(side: dict) -> str:
    """A run's round by its policy version; a `molt eval --out` file (no version) by its name and the policy it
    evaluated."""
    if "version" in side:
        return f"version {side['version']}"
    return f"{side.get('file', '?')} (policy {side.get('policy', '?')})"


def _cell(m: dict, name: str) -> str:
    return f"{m[name]:.3f} [{m[name + '_lo']:.3f}, {m[name + '_hi']:.3f}]"
