"""What routing replay (R3, ``molt_lightning.policies.moe``) costs and buys on the tiny MoE, torch engine, this machine.

Two measurements, both modes in one run so the ratios share the machine's state:
1. the loop: ``--steps`` RL steps of the default task on ``models.tiny.moe_policy`` with the torch engine, on-policy
   (``max_lag=0``: the engine-trainer logprob gap is numerics and routing only) and one version stale (``max_lag=1``,
   the recipe's: the trainer's updated router also drifts from the engine's choices); per mode the median s/step
   after ``--warmup``, the mean |trainer - engine| logprob on trained tokens (``mismatch/abs_logprob_diff``), the
   trainer's free-routing agreement with the engine per layer, the expert load's worst violation and the reward;
   and, paired (the runs' trajectories differ once the policies do), the same mismatch recomputed in both modes on
   every batch of the run with the weights that trained on it ("paired |dlogp| free / replay");
2. the training step alone: forward + backward of the policy on one fixed rollout batch, ``--reps`` times per mode
   (median ms), i.e. what the replay hook itself costs without generation's noise.
Usage: ``python benchmarks/routing_replay.py [--steps 30]``; the table is printed (save it under benchmarks/results/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

MODES = ("free", "replay")
LAGS = (0, 1)


def loop(mode: str, lag: int, steps: int, warmup: int, threads: int):
    import lightning as L
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from molt_lightning import AsyncRLModule, MoE, Optim, Rollout
    from molt_lightning.engines import TorchEngine
    from molt_lightning.models.tiny import moe_policy
    from molt_lightning.tasks import arithmetic

    pairs, before = [], {}  # (weights the step started from, its batch)

    class Keep(L.Callback):
        def on_train_start(self, trainer, pl_module):
            before["w"] = {k: v.detach().clone() for k, v in pl_module.policy.lm.state_dict().items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pairs.append((before["w"], outputs["batch"].to("cpu")))
            before["w"] = {k: v.detach().clone() for k, v in pl_module.policy.lm.state_dict().items()}

    module = AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks, policy=moe_policy(),
                           engine=TorchEngine(seed=0), rollout=Rollout(max_lag=lag), optim=Optim(lr=3e-4),
                           moe=MoE(routing=mode), torch_threads=threads)
    out = tempfile.mkdtemp()
    L.seed_everything(0, verbose=False)
    L.Trainer(max_steps=steps, accelerator="cpu", logger=CSVLogger(out), log_every_n_steps=1, callbacks=[Keep()],
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)
    df = pd.read_csv(f"{out}/lightning_logs/version_0/metrics.csv").groupby("step").first()
    tail = df.iloc[warmup:]
    row = {"config": f"max_lag={lag}, {mode}", "lag": lag, "s/step": tail["perf/step_time_s"].median(),
           "mismatch |dlogp|": df["mismatch/abs_logprob_diff"].mean(),
           "mismatch max step": df["mismatch/abs_logprob_diff"].max(),
           "agree l0": df["moe/agree_l0"].mean(), "agree l1": df["moe/agree_l1"].mean(),
           "load violation": df["moe/load_violation_max"].mean(),
           "reward first 5": df["reward"].iloc[:5].mean(), "reward last 5": df["reward"].iloc[-5:].mean()}
    row.update(paired(module.policy_path, pairs))
    return row, pairs[-1][1], module.policy_path


def paired(path: str, pairs) -> dict[str, float]:
    """Mean |trainer - engine| logprob over all the run's trained tokens, recomputed per mode (no grad)."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt_lightning.trainer.policy import Policy

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for mode in MODES:
        policy, diffs = Policy(lm, routing=mode), []
        for state, b in pairs:
            lm.load_state_dict(state)
            with torch.no_grad():
                lp = policy.outputs(b.input_ids, b.attention_mask, b.loss_mask, 1.0, routing=b.routing).logprobs
            diffs.append((lp - b.engine_logprobs[:, 1:])[b.loss_mask[:, 1:]].abs())  # (tokens,)
        out[f"paired |dlogp| {mode}"] = float(torch.cat(diffs).mean())
    return out


def step_ms(path: str, batch, reps: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from molt_lightning.trainer.policy import Policy

    out = {}
    for mode in MODES:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        policy = Policy(lm, routing=mode)
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            o = policy.outputs(batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, routing=batch.routing)
            o.logprobs.sum().backward()
            lm.zero_grad()
            if i >= 2:  # two warm-up repetitions
                times.append(time.perf_counter() - t0)
        out[mode] = 1000 * statistics.median(times)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="trainer torch threads (the engine shares the process)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pandas as pd
    import torch

    rows, batch, path = [], None, None
    for lag in LAGS:
        for mode in MODES:
            row, batch, path = loop(mode, lag, args.steps, args.warmup, args.threads)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    table = pd.DataFrame(rows).set_index("config")
    free = {lag: table.loc[f"max_lag={lag}, free", "s/step"] for lag in LAGS}
    table.insert(1, "vs free", [r["s/step"] / free[r["lag"]] for r in rows])
    table = table.drop(columns="lag")
    torch.set_num_threads(args.threads)
    ms = step_ms(path, batch, args.reps)
    print(f"tiny MoE ({path.rsplit('/', 1)[-1]}), torch engine, {args.steps} steps per config (s/step: median after "
          f"{args.warmup}; metrics: mean over the steps); {args.threads} trainer thread(s)")
    with pd.option_context("display.width", 250):
        print(table.to_string(float_format=lambda x: f"{x:.4g}"))
    print(f"\ntraining step alone, forward + backward of one {tuple(batch.input_ids.shape)} rollout batch (median of "
          f"{args.reps}): free {ms['free']:.1f} ms, replay {ms['replay']:.1f} ms, replay / free "
          f"{ms['replay'] / ms['free']:.3f}")


if __name__ == "__main__":
    main()
