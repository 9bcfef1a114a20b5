"""What ``benchmarks/step_record.py`` and ``benchmarks/run_record.py`` share: a short run of the default task and
policy on the torch engine in-process (``fit_default``), and rounds of two variants, "off" and "on", in alternating
order (``alternate``: off-on, then on-off, ...) with the medians per step of each."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable


def fit_default(name: str, steps: int, warmup: int, algo=None, keep: Callable[[str], None] | None = None
                ) -> tuple[list[float], list[float]]:
    """``steps`` steps of the default task (8 prompts x 8 runs, ``max_lag=1``, lr 3e-4, one torch thread; ``algo``,
    else ``Algorithm()``'s defaults) in a temporary run folder (``keep(log_dir)`` reads from it before it goes): the
    trainer's compute and the wall time per step (``perf/train_compute_s``, ``perf/step_time_s``) after ``warmup``."""
    import lightning as L
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from molt_lightning import AsyncRLModule, Optim, Rollout
    from molt_lightning.engines import TorchEngine
    from molt_lightning.tasks import arithmetic

    module = AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks, engine=TorchEngine(seed=0),
                           rollout=Rollout(group_size=8, prompts_per_step=8, max_lag=1), optim=Optim(lr=3e-4),
                           torch_threads=1, **({"algo": algo} if algo is not None else {}))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=CSVLogger(tmp, name=name),
                            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module)
        df = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")
        if keep is not None:
            keep(trainer.logger.log_dir)
    df = df[df["step"] >= warmup]
    return df["perf/train_compute_s"].dropna().tolist(), df["perf/step_time_s"].dropna().tolist()


def alternate(run: Callable[[str], tuple[list[float], list[float]]], rounds: int):
    """``run(variant)`` for "off" and "on", ``rounds`` times in alternating order: per variant the compute and wall
    times of every step (``got``) and their medians (``med``)."""
    got = {"on": ([], []), "off": ([], [])}
    for i in range(rounds):
        for variant in ("off", "on") if i % 2 == 0 else ("on", "off"):
            compute, wall = run(variant)
            got[variant][0].extend(compute)
            got[variant][1].extend(wall)
    return got, {v: (statistics.median(c), statistics.median(w)) for v, (c, w) in got.items()}
