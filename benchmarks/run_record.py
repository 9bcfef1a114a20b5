"""What the run's record (``callbacks.trace.RunTrace``, ``trace.jsonl.gz``) costs a step and how big it grows.

The default task, policy and algorithm (``recipes/default.yaml``: 8 prompts x 8 runs a step, ``max_lag=1``, lr 3e-4,
Dr. GRPO's advantage with the PPO clip and TIS at 2) on the torch engine in-process (the record is trainer-side: the
engine only adds noise; no ``Evaluate`` or checkpoint, so the file holds the run and step entries, and outcasts if any
sample was dropped). Rounds alternate between RunTrace as it ships ("on") and RunTrace with its ``on_train_batch_end``
a no-op ("off": the run entry only), in alternating order (off-on, then on-off, ...). Prints, over the steps after the
first ``--warmup`` of each round, the medians of the wall time per step (``perf/step_time_s``) and of the trainer's
own compute per step (``perf/train_compute_s``) for each variant and on / off; then, for the "on" rounds, the time
``on_train_batch_end`` takes on the trainer's thread (median; its share of the default run's 0.198 s/step median with
vLLM, docs/speed.md, measured on another machine of this kind), the writer thread's time per step building the
entries and writing them (wall and the thread's CPU time, all steps), the file's size per step compressed (as written:
a gzip member per entry) and uncompressed (the JSON lines), both extrapolated to 1,000 steps, and the time ``read``
takes on a file of 1,000 steps (the step members of the last "on" round repeated).
Usage: ``python benchmarks/run_record.py [--steps 30] [--rounds 4]``.
"""

from __future__ import annotations

import argparse
import gzip
import math
import statistics
import tempfile
import threading
import time
from pathlib import Path

from ab import alternate, fit_default  # (benchmarks/ab.py)

DEFAULT_S_PER_STEP = 0.198  # the default run's median with vLLM (docs/speed.md, the Intel draw)
HOOK: list[float] = []  # s per call of RunTrace.on_train_batch_end, trainer's thread ("on" rounds)
WRITER: dict[str, float] = {"wall": 0.0, "cpu": 0.0, "steps": 0}  # the writer thread's build + write time
FILES: list[tuple[int, int, int]] = []  # (steps, bytes compressed, bytes uncompressed) of each "on" round
LAST: dict[str, bytes] = {}  # the last "on" round's file


def timed_on_writer(fn):
    """``fn`` timed when it runs on the writer thread (wall and thread CPU time)."""
    def call(*args, **kwargs):
        if threading.current_thread().name != "molt-trace":
            return fn(*args, **kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            WRITER["wall"] += time.perf_counter() - t0
            WRITER["cpu"] += time.thread_time() - c0
    return call


def run(variant: str, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    from molt_lightning.algorithms import Algorithm
    from molt_lightning.callbacks.trace import FILENAME, RunTrace

    hook, submit, write = RunTrace.on_train_batch_end, RunTrace.submit, RunTrace.write
    if variant == "off":
        RunTrace.on_train_batch_end = lambda *a, **k: None
    else:
        def on_train_batch_end(self, *args):
            t0 = time.perf_counter()
            hook(self, *args)
            HOOK.append(time.perf_counter() - t0)

        def timed_submit(self, entry):  # a step's entries are built on the writer thread: time the build there
            submit(self, timed_on_writer(entry) if callable(entry) else entry)

        RunTrace.on_train_batch_end, RunTrace.submit = on_train_batch_end, timed_submit
        RunTrace.write = timed_on_writer(write)
    try:
        compute, wall = fit_default(variant, steps, warmup, Algorithm(
            advantage="grpo", scale_by_std=False, loss="ppo_clip", clip_low=0.2, clip_high=0.2, tis_cap=2.0),
            keep=lambda log_dir: LAST.update(data=(Path(log_dir) / FILENAME).read_bytes()) if variant == "on" else None)
    finally:
        RunTrace.on_train_batch_end, RunTrace.submit, RunTrace.write = hook, submit, write
    if variant == "on":
        data = LAST["data"]
        FILES.append((steps, len(data), len(gzip.decompress(data))))
        WRITER["steps"] += steps
    return compute, wall


def read_time(data: bytes, steps: int, tmp: str) -> tuple[int, float]:
    """A file of at least 1,000 steps (``data``'s members after its first, the run entry, repeated): its steps and the
    seconds ``read`` takes on it."""
    from molt_lightning.callbacks.trace import read

    first = len(gzip.compress(gzip.decompress(data).split(b"\n", 1)[0] + b"\n", compresslevel=6, mtime=0))
    copies = math.ceil(1000 / steps)
    path = Path(tmp) / "trace.jsonl.gz"
    path.write_bytes(data[:first] + data[first:] * copies)
    t0 = time.perf_counter()
    entries, skipped = read(path)
    seconds = time.perf_counter() - t0
    assert skipped == 0 and sum(e["type"] == "step" for e in entries) == steps * copies, skipped
    return steps * copies, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    got, med = alternate(lambda variant: run(variant, args.steps, args.warmup), args.rounds)
    hook_ms = statistics.median(HOOK) * 1e3
    steps = sum(s for s, _, _ in FILES)
    packed, plain = sum(c for _, c, _ in FILES) / steps, sum(u for _, _, u in FILES) / steps
    with tempfile.TemporaryDirectory() as tmp:
        read_steps, read_s = read_time(LAST["data"], FILES[-1][0], tmp)
    print("| variant | wall s/step (median) | train compute s/step (median) | steps |")
    print("|---|---|---|---|")
    for v in ("off", "on"):
        print(f"| {v} | {med[v][1]:.4f} | {med[v][0]:.4f} | {len(got[v][0])} |")
    print(f"| on / off | {med['on'][1] / med['off'][1]:.3f} | {med['on'][0] / med['off'][0]:.3f} | |")
    print("\n| RunTrace (on rounds) | per step | per 1,000 steps |\n|---|---|---|")
    print(f"| on_train_batch_end on the trainer's thread (median) | {hook_ms:.2f} ms "
          f"({hook_ms / 1e3 / DEFAULT_S_PER_STEP:.2%} of the default run's {DEFAULT_S_PER_STEP} s/step) | |")
    print(f"| writer thread, build + write (mean): wall / CPU | {WRITER['wall'] / WRITER['steps'] * 1e3:.2f} ms / "
          f"{WRITER['cpu'] / WRITER['steps'] * 1e3:.2f} ms | |")
    print(f"| file, compressed (as written) | {packed / 1e3:.1f} kB | {packed / 1e3:.1f} MB |")
    print(f"| file, uncompressed (JSON lines) | {plain / 1e3:.1f} kB | {plain / 1e3:.1f} MB |")
    print(f"| read() of the file, {read_steps:,} steps | | {read_s:.2f} s |")

if __name__ == "__main__":
    main()
