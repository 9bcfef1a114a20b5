"""``RewardPlot``: at the end of training, a PNG of reward per step beside the CSV metrics (pandas + matplotlib), with
the held-out evaluations (``Evaluate``'s ``eval/<source>/avg@k``, at the step each round started, with its 95%
interval) on the same axes."""

from __future__ import annotations

import os
import re

import lightning as L

EVAL = re.compile(r"^eval/(.+)/avg@(\d+)$")


def series(columns) -> list[str]:
    """The evaluation columns ``RewardPlot`` draws beside the reward."""
    return sorted(c for c in columns if EVAL.match(c))


class RewardPlot(L.Callback):
    def __init__(self, metric: str = "reward", filename: str = "reward.png"):
        self.metric, self.filename = metric, filename

    def on_train_end(self, trainer, pl_module) -> None:
        logger = trainer.logger
        path = os.path.join(logger.log_dir, "metrics.csv") if logger is not None and logger.log_dir else None
        if trainer.global_rank != 0 or path is None:
            return
        logger.save()
        if not os.path.exists(path):
            return
        import pandas as pd

        df = pd.read_csv(path)
        if self.metric in df:
            draw(df, self.metric, os.path.join(logger.log_dir, self.filename))


def draw(df, metric: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = df.dropna(subset=[metric]).groupby("step", as_index=False)[metric].first()
    if len(train) >= 40:  # a noisy per-step reward: the steps faint, a moving mean over them
        window = max(5, len(train) // 20)
        ax.plot(train["step"], train[metric], marker=".", lw=0.5, alpha=0.35, color="C0")
        ax.plot(train["step"], train[metric].rolling(window, min_periods=1).mean(), lw=2, color="C0",
                label=f"training {metric} ({window}-step mean)")
    else:
        ax.plot(train["step"], train[metric], marker=".", lw=1, label=f"training {metric}")
    for i, column in enumerate(series(df.columns)):
        rounds = df.dropna(subset=[column])
        low, high = rounds.get(f"{column}_lo"), rounds.get(f"{column}_hi")
        err = None if low is None or high is None else [rounds[column] - low, high - rounds[column]]
        source, k = EVAL.match(column).groups()
        source = "" if source == "heldout" else f"{source} "  # "heldout": a plain tasks(seed) stream
        ax.errorbar(rounds["step"], rounds[column], yerr=err, marker="o", capsize=3, lw=1.2, ls="--", color=f"C{i + 1}",
                    label=f"held-out {source}avg@{k} (95% CI)")
    ax.set(xlabel="training step", ylabel=f"mean {metric}")
    ax.grid(alpha=0.3)
    if series(df.columns) or len(train) >= 40:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
