"""Seconds per training step of the tiny MoE: one process against two ranks under ``fsdp2`` (experts FSDP-sharded,
gathered for compute) and ``fsdp2_ep`` (experts split, tokens sent by all-to-all), in one run on the same machine.

The step is ``benchmarks/train_step.py``'s (the real ``AsyncRLModule.training_step`` on a fixed synthetic batch, no
engine, no weight push); each configuration runs in its own subprocess (the 2-rank ones launched by Lightning, as
``molt fit`` does) and prints one JSON line; this script collects them, prints a table with each configuration's
ratio to the one-process run with 1 thread and with the same total threads, and appends the lines to ``--out``.

    python benchmarks/expert_parallel.py --rows 16 --tokens 256 --steps 6 \
        --out benchmarks/results/expert_parallel_cpu2.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOE = "molt_lightning.models.tiny.moe_policy"
CONFIGS = [("auto", 1, 1), ("auto", 1, 2), ("fsdp2", 2, 1), ("fsdp2_ep", 2, 1)]  # strategy, ranks, threads per rank


def one(strategy: str, devices: int, threads: int, rows: int, tokens: int, steps: int) -> None:
    """Run one configuration in this process (rank 0 prints its JSON line)."""
    import lightning as L

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_step import StepBench

    from molt_lightning.config import Optim

    module = StepBench(rows, tokens, "chunked", policy=MOE, torch_threads=threads, optim=Optim(lr=1e-6))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    if trainer.global_rank == 0:
        times = module.times[1:] or module.times  # the first step warms up
        print("RESULT " + json.dumps({"policy": "tiny-moe", "strategy": strategy, "ranks": devices,
                                      "threads_per_rank": threads, "rows": rows, "tokens": tokens,
                                      "s_per_step": statistics.median(times), "s_per_step_min": min(times),
                                      "steps": [round(t, 4) for t in times]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    ap.add_argument("--one", nargs=3, metavar=("STRATEGY", "RANKS", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        return one(a.one[0], int(a.one[1]), int(a.one[2]), a.rows, a.tokens, a.steps)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    results, stamp = [], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for strategy, ranks, threads in CONFIGS:
        cmd = [sys.executable, __file__, "--rows", str(a.rows), "--tokens", str(a.tokens), "--steps", str(a.steps),
               "--one", strategy, str(ranks), str(threads)]
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
        if run.returncode or line is None:
            raise SystemExit(f"{strategy} x{ranks} failed:\n{run.stderr[-3000:]}")
        results.append({**json.loads(line[len("RESULT "):]), "time": stamp, "cores": os.cpu_count(),
                        "load_avg_1min": round(os.getloadavg()[0], 2)})
    base = {r["threads_per_rank"] * r["ranks"]: r["s_per_step"] for r in results if r["strategy"] == "auto"}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (s/step: median after the first step)")
    print(f"{'strategy':<10} {'ranks':>5} {'threads/rank':>12} {'s/step':>8} {'min':>7} {'/ 1 proc 1 thread':>18} "
          f"{'/ 1 proc same threads':>22}")
    for r in results:
        r["ratio_to_one_thread"] = round(r["s_per_step"] / base[1], 3)
        r["ratio_to_same_threads"] = round(r["s_per_step"] / base[r["threads_per_rank"] * r["ranks"]], 3)
        print(f"{r['strategy']:<10} {r['ranks']:>5} {r['threads_per_rank']:>12} {r['s_per_step']:>8.3f} "
              f"{r['s_per_step_min']:>7.3f} "
              f"{r['ratio_to_one_thread']:>18.2f} {r['ratio_to_same_threads']:>22.2f}")
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
