"""``RewardPlot``: at the end of training, a PNG of reward per step beside the CSV metrics (pandas + matplotlib)."""

from __future__ import annotations

import os

import lightning as L


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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import pandas as pd

        df = pd.read_csv(path)
        if self.metric not in df:
            return
        df = df.dropna(subset=[self.metric])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(df["step"], df[self.metric], marker=".", lw=1)
        ax.set(xlabel="training step (policy version)", ylabel=f"mean {self.metric}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(logger.log_dir, self.filename), dpi=120)
        plt.close(fig)
