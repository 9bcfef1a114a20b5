"""End-to-end loop throughput on this machine: synchronous vs asynchronous, and how the two cores are split.

Runs the embedded default (vLLM engine in-process, tiny policy, calculator task) for ``--steps`` optimizer steps per
configuration and prints one table: seconds per step (median over the steps after ``--warmup``), generated tokens per
second, the share of wall time the trainer waited for data and the engine sat idle, and the speed-up against the
synchronous baseline measured in the same run. Usage: ``python benchmarks/loop_overlap.py [--steps 30]``.

Then asynchrony against its limit, for the recipes' core split (vLLM on core 1, the trainer on one thread): the
synchronous run measures each phase alone (generation = the time the trainer waits for a batch it cannot overlap,
training = the rest of its step: gradient step, weight sync and everything else), so sync = gen + train, the limit of
overlap is max(gen, train), and the asynchronous run's s/step is placed between them: efficiency = (sync - async) /
(sync - limit), 100% at the limit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

CONFIGS = {  # name: (max_lag, vLLM OMP threads bind, trainer torch threads)
    "sync (max_lag=0), engine 1 core": (0, None, None),
    "sync (max_lag=0), engine 2 cores": (0, "0-1", None),
    "async (max_lag=1), engine 1 core": (1, None, None),
    "async (max_lag=1), engine 2 cores": (1, "0-1", None),
    "async (max_lag=1), engine core 1, trainer 1 thread": (1, "1", 1),
    "sync (max_lag=0), engine core 1, trainer 1 thread": (0, "1", 1),
}
SPLIT = ("sync (max_lag=0), engine core 1, trainer 1 thread", "async (max_lag=1), engine core 1, trainer 1 thread")


def run(name, max_lag, bind, threads, steps, warmup):
    import lightning as L
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from molt_lightning import AsyncRLModule, Optim, Rollout
    from molt_lightning.engines import VLLMEngine
    from molt_lightning.tasks import arithmetic

    engine = VLLMEngine(seed=0, cpu_threads=bind)
    module = AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks, engine=engine, torch_threads=threads,
                           rollout=Rollout(max_lag=max_lag), optim=Optim(lr=3e-4))
    out = tempfile.mkdtemp()
    L.seed_everything(0, verbose=False)
    L.Trainer(max_steps=steps, accelerator="cpu", logger=CSVLogger(out), log_every_n_steps=1,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)
    df = pd.read_csv(f"{out}/lightning_logs/version_0/metrics.csv").groupby("step").first().iloc[warmup:]
    return {
        "config": name,
        "s/step": df["perf/step_time_s"].median(),
        "idle s": df["perf/trainer_idle_s"].median(),
        "gen tok/s": df["perf/gen_tokens_per_s"].median(),
        "trainer idle": df["perf/trainer_idle_frac"].mean(),
        "engine idle": df["perf/engine_idle_frac"].mean(),
        "weight sync s": df["perf/weight_sync_s"].median(),
        "mean lag": df["lag"].mean(),
        "reward (last 5)": df["reward"].iloc[-5:].mean(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="config names to run (default: all)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pandas as pd
    import torch

    default_threads = torch.get_num_threads()
    rows = []
    for name, (lag, bind, threads) in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        torch.set_num_threads(default_threads)
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        rows.append(run(name, lag, bind, threads, args.steps, args.warmup))
        print(rows[-1], file=sys.stderr, flush=True)
    table = pd.DataFrame(rows).set_index("config")
    base = table["s/step"].iloc[0]
    table.insert(1, "speed-up vs first", base / table["s/step"])
    print(table.drop(columns="idle s").round(3).to_string())
    if all(name in table.index for name in SPLIT):
        sync, fast = table.loc[SPLIT[0]], table.loc[SPLIT[1]]
        gen = sync["idle s"]
        train = sync["s/step"] - gen
        limit = max(gen, train)
        eff = (sync["s/step"] - fast["s/step"]) / (sync["s/step"] - limit)
        print(f"\ncore split (vLLM core 1, trainer 1 thread): generation alone {gen:.3f} s, training alone "
              f"{train:.3f} s (from the sync run); sync = gen + train {sync['s/step']:.3f} s/step, limit max(gen, "
              f"train) {limit:.3f}, async {fast['s/step']:.3f}: {100 * eff:.0f}% of the way from sync to the limit")


if __name__ == "__main__":
    main()
