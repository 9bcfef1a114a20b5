"""The scale tables: SmolLM2's training step at 16 x 256 tokens, memory-bounded or not, and on 1 vs 2 ranks.

Each configuration runs ``benchmarks/train_step.py`` in its own process(es) (peak RSS is per process), in one sitting,
and the table shows ratios against the first row of its block (the baseline measured in the same run):

1. one process, 2 threads: full logits (the plain route) vs the chunked head vs chunked + micro-batches of 1,024
   tokens vs that + activation checkpointing, and vs bfloat16 parameters;
2. the chunked step on 1 rank (2 threads) vs DDP 2 ranks vs FSDP2 2 ranks (1 thread each: this machine has 2 cores).

    python benchmarks/scale_table.py [--policy smollm2] [--steps 3] [--out benchmarks/results/scale_cpu2.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEMORY = [
    ("full logits", ["--mode", "full"]),
    ("chunked head", ["--mode", "chunked"]),
    ("chunked + micro-batches (1,024 tokens)", ["--mode", "chunked", "--micro-batch-tokens", "1024"]),
    ("chunked + micro-batches + activation ckpt", ["--mode", "chunked", "--micro-batch-tokens", "1024",
                                                   "--activation-checkpointing"]),
    ("chunked + micro-batches, bfloat16 parameters", ["--mode", "chunked", "--micro-batch-tokens", "1024",
                                                      "--dtype", "bfloat16"]),
]
PARALLEL = [
    ("1 rank, 2 threads", ["--devices", "1", "--threads", "2"]),
    ("DDP, 2 ranks x 1 thread", ["--strategy", "ddp", "--devices", "2", "--threads", "1"]),
    ("FSDP2, 2 ranks x 1 thread", ["--strategy", "fsdp2", "--devices", "2", "--threads", "1"]),
]


def measure(policy: str, steps: int, args: list[str]) -> dict:
    cmd = [sys.executable, str(HERE / "train_step.py"), "--policy", policy, "--steps", str(steps), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def table(title: str, rows: list[tuple[str, dict]]) -> list[str]:
    base = rows[0][1]
    lines = [f"## {title}", "", "| configuration | s/step | vs first | peak RSS per rank (GiB) | vs first |",
             "|---|---|---|---|---|"]
    for name, r in rows:
        rss, base_rss = max(r["peak_rss_gib_per_rank"]), max(base["peak_rss_gib_per_rank"])
        per_rank = " / ".join(f"{x:.2f}" for x in r["peak_rss_gib_per_rank"])
        lines.append(f"| {name} | {r['s_per_step']:.2f} | {base['s_per_step'] / r['s_per_step']:.2f}x | {per_rank} "
                     f"| {rss / base_rss:.2f} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="smollm2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    memory = [(name, measure(a.policy, a.steps, ["--threads", "2", *args])) for name, args in MEMORY]
    parallel = [(name, measure(a.policy, a.steps, ["--mode", "chunked", *args])) for name, args in PARALLEL]
    lines = [f"policy {a.policy}, batch 16 x 256 tokens (64 prompt + 192 policy tokens each), median s/step of "
             f"steps 2..{a.steps}, AdamW", ""]
    lines += table("Memory-bounded step (one process)", memory)
    lines += table("Data parallelism (chunked head, same batch)", parallel)
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
