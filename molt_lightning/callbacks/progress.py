"""``StepProgressBar``: Lightning's rich progress bar labelled by optimizer step, since an RL run has no epochs
(the stock bar reads "Epoch 0/-2" under ``max_steps``) and without the logger's version number."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Shows ``Step n/max_steps`` with the metrics logged with ``prog_bar=True`` (reward, lag)."""

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's only hook for the label (private)
        return "Step"

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
