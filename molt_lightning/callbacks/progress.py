"""``StepProgressBar``: Lightning's rich progress bar labelled by optimizer step, since an RL run has no epochs
(the stock bar reads "Epoch 0/-2" under ``max_steps``), without the logger's version number, and one line at 80
columns: a 20-column bar, no it/s (an RL step takes seconds; the time column says how long), metrics in 3 digits."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import CustomBarColumn, ProcessingSpeedColumn


class StepProgressBar(RichProgressBar):
    """Shows ``Step n/max_steps`` with the metrics logged with ``prog_bar=True`` (reward, lag)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.theme.metrics_format = ".3g"  # reward: 0.375 lag: 1

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's only hook for the label (private)
        return "Step"

    def configure_columns(self, trainer) -> list:
        columns = [c for c in super().configure_columns(trainer) if not isinstance(c, ProcessingSpeedColumn)]
        for column in columns:
            if isinstance(column, CustomBarColumn):
                column.bar_width = 20
        return columns

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
