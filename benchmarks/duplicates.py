"""Duplicate completions in GRPO groups on a pool of servers: ``recipes/pool.yaml`` for its first steps, with one and
with two ``molt serve`` servers, over seeds; prints a markdown table of ``samples/duplicates`` (the share of a group's
completions that repeat another one token for token, ``trajectory.repeats``), the mean of the steps run.

Two servers that sample from one random stream answer the same requests alike, so half of a group's samples were
copies (issue: 52% with two servers against 6% with one, steps 0-1); with a stream per engine the two should be
within noise of each other.

    .venv/bin/python benchmarks/duplicates.py [--seeds 0 1 2] [--steps 2] [--servers 1 2] [--out FILE.md]

Each run is ``molt fit --config recipes/pool.yaml --trainer.max_steps STEPS --seed_everything S
--model.rollout.task_seed S --model.engine.init_args.servers N`` in a temporary run folder (about a minute or two a
run on 2 cores: the servers start each time). ``PYTHONPATH`` chooses the package measured (another checkout's, for a
before/after table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def run(servers: int, seed: int, steps: int, workdir: str) -> list[float]:
    """One run's ``samples/duplicates`` per step."""
    cmd = [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", str(ROOT / "recipes/pool.yaml"),
           "--trainer.max_steps", str(steps), "--seed_everything", str(seed), "--model.rollout.task_seed", str(seed),
           "--model.engine.init_args.servers", str(servers), "--trainer.logger.init_args.save_dir", workdir,
           "--trainer.enable_progress_bar", "false"]
    out = subprocess.run(cmd, cwd=workdir, env={**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "0"},
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    [metrics] = Path(workdir, "pool").glob("version_*/metrics.csv")
    frame = pd.read_csv(metrics)
    if "samples/duplicates" not in frame:
        raise SystemExit(f"{metrics} has no samples/duplicates column: the package measured predates the metric")
    return frame["samples/duplicates"].dropna().tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args()
    rows = ["| servers | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |",
            "|---" * (len(args.seeds) + 2) + "|"]
    for servers in args.servers:
        shares = []
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as workdir:
                shares.append(statistics.fmean(run(servers, seed, args.steps, workdir)))
            print(f"servers {servers}, seed {seed}: {shares[-1]:.1%}", file=sys.stderr, flush=True)
        rows.append(f"| {servers} | " + " | ".join(f"{s:.1%}" for s in shares) + f" | {statistics.fmean(shares):.1%} |")
    table = (f"samples/duplicates, recipes/pool.yaml, steps 0-{args.steps - 1} (mean), "
             f"package: {os.environ.get('PYTHONPATH') or ROOT}\n\n" + "\n".join(rows))
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
