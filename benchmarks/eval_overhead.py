"""What held-out evaluation costs training: the default recipe's s/step without and with ``Evaluate`` rounds.

Runs the embedded default (the tiny policy, the calculator task, vLLM in-process on core 1, the trainer on one
thread, ``max_lag=1``) for ``--steps`` steps twice in one process: once without evaluation, once with a periodic
round every ``--every`` steps (``--prompts`` held-out prompts x ``--k`` runs, beside training; no start or end
round, which the trainer waits for by design), at each ``--concurrency`` (runs of a round at once: fewer share the
engine less, for a longer round). Prints one table: s/step (median and mean over the steps after
``--warmup``), the trainer's wait for data, the rounds run and their seconds, and the ratio to the run without
evaluation. Usage: ``python benchmarks/eval_overhead.py [--steps 60] [--every 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def run(name: str, steps: int, warmup: int, evaluate) -> dict:
    import lightning as L
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from molt_lightning import AsyncRLModule, Optim, Rollout
    from molt_lightning.engines import VLLMEngine
    from molt_lightning.tasks import arithmetic

    module = AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks, engine=VLLMEngine(seed=0, cpu_threads="1"),
                           torch_threads=1, rollout=Rollout(max_lag=1), optim=Optim(lr=3e-4))
    out = tempfile.mkdtemp()
    L.seed_everything(0, verbose=False)
    L.Trainer(max_steps=steps, accelerator="cpu", logger=CSVLogger(out), log_every_n_steps=1,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[evaluate] if evaluate else []).fit(module)
    run_dir = f"{out}/lightning_logs/version_0"
    df = pd.read_csv(f"{run_dir}/metrics.csv")
    steps_df = df.dropna(subset=["perf/step_time_s"]).groupby("step").first().iloc[warmup:]
    rounds = [json.loads(x) for x in open(f"{run_dir}/eval.jsonl")] if evaluate else []
    return {"config": name, "s/step median": steps_df["perf/step_time_s"].median(),
            "s/step mean": steps_df["perf/step_time_s"].mean(),
            "trainer idle": steps_df["perf/trainer_idle_frac"].mean(), "rounds": len(rounds),
            "s/round": sum(r["seconds"] for r in rounds) / max(len(rounds), 1),
            "reward (last 5)": steps_df["reward"].iloc[-5:].mean()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 16], help="agent runs of a round at once")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pandas as pd

    from molt_lightning.callbacks import Evaluate
    from molt_lightning.tasks import arithmetic

    rows = [run("no evaluation", args.steps, args.warmup, None)]
    for concurrency in args.concurrency:
        evaluate = Evaluate(arithmetic.tasks, k=args.k, seed=10_000, max_prompts=args.prompts,
                            every_n_steps=args.every, at_start=False, at_end=False, concurrency=concurrency)
        rows.append(run(f"a round every {args.every} steps ({args.prompts} x {args.k}, {concurrency} at once)",
                        args.steps, args.warmup, evaluate))
    table = pd.DataFrame(rows).set_index("config")
    for col in ("s/step median", "s/step mean"):
        table[f"{col.split()[1]} ratio"] = table[col] / table[col].iloc[0]
    print(table.round(3).to_string())


if __name__ == "__main__":
    main()
