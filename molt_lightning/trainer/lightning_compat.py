"""A fix for the per-key cost of Lightning's ``self.log``, until Lightning ships one.

Lightning 2.6's ``_ResultCollection.log`` calls ``_ResultMetric.to(value.device)`` for every value logged, on every
step, and ``to`` walks the metric's whole ``__dict__`` with ``apply_to_collection`` (deep-copying its metadata
dataclass on the way) even when nothing has to move: a visible share of a small step that logs some fifty metrics
(measured in docs/speed.md; Lightning issue #20388; an open upstream pull request short-circuits the same case).
``patch()`` makes a move to the device where the metric's state already is a no-op; every other call (a first move,
another device, a dtype, keyword arguments, a wrapped torchmetrics ``Metric``) takes Lightning's own path unchanged.
Applied once, on import of ``molt_lightning.module``; ``tests/test_lightning_compat.py`` checks that logged metrics
stay the same.
"""

from __future__ import annotations

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

_original_to = _ResultMetric.to


def _to(self, *args, **kwargs):
    if not kwargs and len(args) == 1 and isinstance(args[0], (str, torch.device)) and self.is_tensor:
        target = torch.device(args[0])
        states = [self.value] + ([self.cumulated_batch_size] if self.meta.is_mean_reduction else [])
        if all(_on(t, target) for t in states):
            return self
    return _original_to(self, *args, **kwargs)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def patch() -> None:
    _ResultMetric.to = _to


def unpatch() -> None:  # for the test that compares both
    _ResultMetric.to = _original_to
