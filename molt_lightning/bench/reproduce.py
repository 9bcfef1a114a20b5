"""``molt-bench reproduce NAME``: re-run a result the READMEs report and write the reproduction next to it.

The results live in ``benchmarks/reported.yaml``: per name, where it is reported (``where``: one ``FILE#anchor`` or a
list, the anchor a heading's GitHub slug; ``what``: which table there), the commands that make it, the
numbers as reported (verbatim) and how to read the reproduced ones (``extract``). ``reproduce`` runs the commands
from the repository root (``{out}`` is the output folder, ``{real_logs}`` the real-logs folder), keeps their output,
and writes ``OUT/report.md``: the reported block, the reproduced numbers, the commands with their exit status and
wall time, and the environment (package versions, git revision, the machine: CPU model, CPUs, GPU; the date). It
works the same inside a container.

Extractors: ``recipe`` (a training run's ``metrics.csv``: reward over step windows, first step where the 5-step
mean reaches a threshold, median s/step and tokens/s, lag, stale drops; with ``heldout: true`` also the held-out
avg@k at the first and the last round of its ``eval.jsonl``), ``compare`` (a molt-bench
``summary.json``: per metric means and the verdict), ``stdout`` (the last lines the commands printed: the benchmark
scripts print their tables).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from . import runs
from .runs import RunSetError

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "benchmarks" / "reported.yaml"


def registry(path: Path = REGISTRY) -> dict[str, dict]:
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise RunSetError(f"cannot read the registry of reported results {path}: {e}") from e


def locations(entry: dict) -> list[str]:
    """Where an entry is reported: ``FILE`` or ``FILE#anchor`` (a heading's GitHub slug), from the repository root."""
    where = entry["where"]
    return [where] if isinstance(where, str) else list(where)


def _where(entry: dict) -> str:
    return ", ".join(locations(entry)) + (f" ({entry['what']})" if entry.get("what") else "")


def listing(path: Path = REGISTRY) -> str:
    return "\n".join(f"{name:26s} ~{e.get('minutes', '?')} min  {_where(e)}" for name, e in registry(path).items())


def reproduce(name: str, out: Path | None = None, path: Path = REGISTRY, log=print) -> Path:
    entries = registry(path)
    if name not in entries:
        raise RunSetError(f"no reported result {name!r}; `molt-bench reproduce --list` shows them: {sorted(entries)}")
    entry = entries[name]
    out = Path(out or Path("reproductions") / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    fill = {"out": str(out), "real_logs": str(real_logs())}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    ran, printed = [], []
    for k, template in enumerate(entry["commands"]):
        command = template.format(**fill)
        log(f"[molt-bench reproduce] {command}")
        t0 = time.perf_counter()
        with open(out / f"command_{k}.log", "w") as f:
            proc = subprocess.run(command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            f.write(proc.stdout)
        ran.append({"command": command, "status": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)})
        printed.append(proc.stdout)
        if proc.returncode != 0:
            log(f"[molt-bench reproduce] exit status {proc.returncode}; output in {out / f'command_{k}.log'}")
            break
    spec = {k: (v.format(**fill) if isinstance(v, str) else v) for k, v in entry["extract"].items()}
    if isinstance(spec.get("run_dir"), list):
        spec["run_dir"] = [d.format(**fill) for d in spec["run_dir"]]
    try:
        reproduced = EXTRACT[spec["kind"]](spec, "".join(printed))
    except (OSError, KeyError, ValueError, IndexError) as e:
        reproduced = f"(could not read the reproduced numbers: {type(e).__name__}: {e})"
    report = _report(name, entry, ran, reproduced)
    (out / "report.md").write_text(report)
    (out / "reproduction.json").write_text(json.dumps({"name": name, "commands": ran, "reproduced": reproduced,
                                                       "environment": runs.environment()}, indent=1, default=str))
    return out / "report.md"


def real_logs() -> Path:
    """The other stacks' logs: ``$MOLT_REAL_LOGS``, else ``../shared/real-logs`` beside the checkout, else
    ``/work/shared/real-logs`` (where a fresh clone elsewhere finds them on these machines)."""
    for candidate in (os.environ.get("MOLT_REAL_LOGS"), ROOT.parent / "shared" / "real-logs", "/work/shared/real-logs"):
        if candidate and Path(candidate, "README.md").exists():
            return Path(candidate)
    return ROOT.parent / "shared" / "real-logs"


def from_recipe(spec: dict, printed: str) -> str:
    patterns = spec["run_dir"] if isinstance(spec["run_dir"], list) else [spec["run_dir"]]
    dirs = [d for p in patterns for d in (sorted(glob.glob(p)) or [p])]  # a pattern may name many runs
    rows = []
    for d in dirs:
        found = sorted(glob.glob(f"{d}/version_*/metrics.csv"), key=os.path.getmtime)
        if not found:
            raise OSError(f"no metrics.csv under {d}/version_*")
        df = pd.read_csv(found[-1]).groupby("step").first().reset_index()
        r = df.set_index("step")["reward"].dropna()
        cells = [f"{d}"]
        for lo, hi in spec.get("windows", []):
            cells.append(f"reward steps {lo}-{hi - 1}: {r[(r.index >= lo) & (r.index < hi)].mean():.3f}")
        if "threshold" in spec:
            hit = r.rolling(5).mean()
            first = hit[hit >= spec["threshold"]]
            cells.append(f"5-step mean >= {spec['threshold']} at step {int(first.index[0]) if len(first) else '-'}")
        for col, what, fmt in (("perf/step_time_s", "s/step (median)", ".3f"),
                               ("perf/gen_tokens_per_s", "gen tok/s (median)", ",.0f"),
                               ("lag", "lag (mean)", ".2f"), ("mismatch/kl", "mismatch/kl (mean)", ".4f"),
                               ("samples/duplicates", "duplicates (mean)", ".1%"),
                               ("samples/dropped_stale_samples_total", "stale drops", ".0f")):
            if col in df and df[col].notna().any():
                v = df[col].median() if "median" in what else (df[col].max() if "drops" in what else df[col].mean())
                cells.append(f"{what} {v:{fmt}}")
        cells.append(f"steps {int(df['step'].max()) + 1}")
        if spec.get("heldout"):
            cells += heldout(Path(found[-1]).parent / "eval.jsonl")
        rows.append(" | ".join(cells))
    return "\n".join(rows)


def heldout(log: Path) -> list[str]:
    """Per source, avg@k with its 95% interval at ``Evaluate``'s first round (before the first step) and its last
    (after the last step), from the run folder's eval.jsonl."""
    rounds = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    if len(rounds) < 2:
        raise ValueError(f"{log} holds {len(rounds)} evaluation round(s): before -> after needs two")
    first, last = rounds[0], rounds[-1]
    name = f"avg@{last['k']}"
    cell = lambda r, m: f"{m[name]:.3f} [{m[name + '_lo']:.3f}, {m[name + '_hi']:.3f}] (version {r['version']})"  # noqa: E731
    return [f"held-out {name} (source {source}) {cell(first, first['metrics'][source])} -> {cell(last, m)}"
            for source, m in last["metrics"].items()]


def from_compare(spec: dict, printed: str) -> str:
    summary = json.loads(Path(spec["summary"]).read_text())
    lines = []
    for m in summary["metrics"]:
        means = (f"mean A {np.mean(list(m['values_a'].values())):.4g}, "
                 f"mean B {np.mean(list(m['values_b'].values())):.4g}")
        lines.append(f"{m.get('metric', '?')}: {means}, {m.get('verdict') or m.get('no_verdict')}")
    return "\n".join(lines)


def from_stdout(spec: dict, printed: str) -> str:
    return "\n".join(printed.rstrip().splitlines()[-int(spec.get("lines", 10)):])


EXTRACT = {"recipe": from_recipe, "compare": from_compare, "stdout": from_stdout}


def _report(name: str, entry: dict, ran: list[dict], reproduced: str) -> str:
    env = runs.environment()
    machine = env["machine"]
    commands = "\n".join(f"{r['command']}    # exit {r['status']}, {r['wall_s']} s" for r in ran)
    return "\n".join([
        f"# molt-bench reproduce {name}", "", f"Reported in {_where(entry)}.", "",
        "## Reported", "", "```", entry["reported"].rstrip(), "```", "",
        "## Reproduced", "", "```", reproduced, "```", "",
        "## Commands", "", "```", commands, "```", "",
        "## Environment", "",
        f"- machine: {machine['processor']}, {machine['cpus']} CPUs ({machine.get('cpus_usable', '?')} usable), "
        f"{machine.get('accelerator', 'no CUDA GPU')} ({machine['platform']}, host {machine['hostname']})",
        f"- date: {env['created']}",
        f"- git: {env['git']['revision']}{' (dirty)' if env['git']['dirty'] else ''}",
        "- packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()), "",
        "Times and throughputs reproduce only on a machine of the reported kind (2 cores, 24 GiB, no GPU); rewards "
        "and verdicts should agree within seed noise anywhere.", ""])
