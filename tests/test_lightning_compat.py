"""``lightning_compat``: the short-cut in ``_ResultMetric.to`` changes no logged value and still moves what must
move."""

from __future__ import annotations

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric

from molt_lightning.trainer import lightning_compat


class _Logs(L.LightningModule):
    """Logs step-dependent values of every reduction kind Lightning keeps (mean, max, sum), tensors and floats."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.automatic_optimization = False

    def training_step(self, batch, i):
        x = float(batch)
        self.log_dict({"a": x, "b": torch.tensor(x * x)}, on_step=True, batch_size=1)
        self.log("c", x + 1, on_step=True, on_epoch=True, reduce_fx="max", batch_size=2)
        self.log("d", torch.tensor(2.0 * x), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("e", 3.0 * x, on_step=True, on_epoch=True, batch_size=int(batch) + 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([float(i) for i in range(7)], batch_size=None)


def _run(tmp_path, name):
    trainer = L.Trainer(max_epochs=2, logger=CSVLogger(tmp_path, name=name), log_every_n_steps=1,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(_Logs())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return metrics, pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")


def test_logged_metrics_are_the_same_with_and_without_the_patch(tmp_path):
    lightning_compat.unpatch()
    try:
        want, want_csv = _run(tmp_path, "original")
    finally:
        lightning_compat.patch()
    got, got_csv = _run(tmp_path, "patched")
    assert got == want and set(want) >= {"a", "b", "c_step", "c_epoch", "d", "e_step", "e_epoch"}
    assert want["e_epoch"] == pytest.approx(3 * sum(i * (i + 1) for i in range(7)) / sum(range(1, 8)))  # weighted
    pd.testing.assert_frame_equal(got_csv, want_csv)


def test_only_a_move_to_the_current_device_is_skipped(monkeypatch):
    lightning_compat.patch()
    meta = _Metadata(fx="training_step", name="x", on_step=True, on_epoch=True)
    metric = _ResultMetric(meta, is_tensor=True)
    calls, original = [], lightning_compat._original_to
    monkeypatch.setattr(lightning_compat, "_original_to",
                        lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    assert metric.to("cpu") is metric and metric.to(torch.device("cpu")) is metric and not calls
    metric.to(torch.float64)  # a dtype is never skipped
    metric.to("meta")  # nor another device: Lightning moves it
    assert len(calls) == 2 and metric.value.device.type == "meta"
