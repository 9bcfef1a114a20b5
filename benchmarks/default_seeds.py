"""The default run (`make train`'s recipe) over seeds: does every run end where it peaks? (one table)

Each seed runs ``molt fit --config recipes/default.yaml`` with ``seed_everything`` and the engine's seed set to it
(and any extra ``--key value`` overrides given after ``--``), one after another, then reads the run's
``metrics.csv`` and ``eval.jsonl``. Columns: training reward over steps 0-4, the best 5-step mean and its step, the
first step whose 5-step mean reaches 0.8, the mean over steps 90-99, held-out avg@4 at the first and last
evaluation, the largest single-token IS ratio after the peak; from the first step whose 5-step mean reaches 0.9
(saturation) on: the drawdown (the best 5-step mean minus the worst 10-step mean after it), the steps whose gradient
norm exceeds 1 (before clipping) and the median gradient norm; the mean entropy over steps 90-99, wall time.

    python benchmarks/default_seeds.py [--seeds 0-9] [--tag NAME] [-- --model.algo.scale_by_std false ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def seeds(spec: str) -> list[int]:
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def held_out(record: dict) -> float:
    return next(iter(record["metrics"].values()))[f"avg@{record['k']}"]  # the (only) source's avg@k


def summarize(folder: Path) -> dict:
    m = pd.read_csv(folder / "metrics.csv")
    steps = m.dropna(subset=["reward"]).groupby("step").mean(numeric_only=True)
    r = steps["reward"]
    rolling = r.rolling(5).mean()
    peak_step = int(rolling.idxmax())
    evals = [json.loads(x) for x in (folder / "eval.jsonl").read_text().splitlines()] \
        if (folder / "eval.jsonl").exists() else []
    reached = rolling[rolling >= 0.8]
    after = steps.loc[steps.index > peak_step]
    saturated = rolling[rolling >= 0.9]  # from the first step whose 5-step mean reaches 0.9
    sat = int(saturated.index[0]) if len(saturated) else None
    post = steps.loc[sat:] if sat is not None else steps.iloc[:0]
    return {"start": r.iloc[:5].mean(), "peak": rolling.max(), "peak_step": peak_step,
            "first_0.8": int(reached.index[0]) if len(reached) else None, "end_90_99": r.iloc[90:100].mean(),
            "eval_first": held_out(evals[0]) if evals else None, "eval_last": held_out(evals[-1]) if evals else None,
            "is_max_after_peak": after["is/ratio_max"].max() if len(after) else None,
            "drawdown": float(rolling.loc[sat:].max() - r.rolling(10).mean().loc[sat + 10:].min()) if sat else None,
            "spikes": int((post["grad_norm"] > 1).sum()), "grad_median_after": float(post["grad_norm"].median()),
            "entropy_90_99": steps["entropy"].iloc[90:100].mean() if "entropy" in steps else None}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--tag", default="seeds")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1"}
    rows = []
    for seed in seeds(args.seeds):
        name = f"{args.tag}-{seed}"
        t0 = time.time()
        out = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config",
                              "recipes/default.yaml",
                              "--seed_everything", str(seed), "--model.engine.init_args.seed", str(seed),
                              "--trainer.logger.init_args.name", name, *extra],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"seed {seed} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}", flush=True)
            continue
        folder = max((ROOT / "runs" / name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
        rows.append({"seed": seed, **summarize(folder), "wall_s": time.time() - t0})
        print(json.dumps(rows[-1]), flush=True)
    table = pd.DataFrame(rows)
    print(table.to_markdown(index=False, floatfmt=".3g"))
    if len(table):
        print(f"\nends >= 0.9 over steps 90-99: {(table['end_90_99'] >= 0.9).sum()} of {len(table)}; "
              f"mean {table['end_90_99'].mean():.3f}, min {table['end_90_99'].min():.3f}")


if __name__ == "__main__":
    main()
