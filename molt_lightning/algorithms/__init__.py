"""Advantage estimators and policy losses: pure functions, one registry, picked by name or dotted path.

- An advantage estimator: ``fn(rewards (M,), group_ids (M,), cfg) -> advantages (M,)``, one value per trajectory.
- A policy loss: ``fn(inputs: LossInputs, cfg) -> (loss, metrics)``; ``metrics`` maps names to detached scalars.

``cfg`` is the recipe's ``Algorithm`` record. Adding an algorithm costs one function, one registry line and one
test; a user's own function is named by its dotted path (``mypkg.losses.my_loss``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .advantages import grpo
from .config import Algorithm
from .losses import LossInputs, ppo_clip

ADVANTAGES: dict[str, Callable] = {"grpo": grpo}
LOSSES: dict[str, Callable] = {"ppo_clip": ppo_clip}


def resolve(name: str, registry: dict[str, Callable]) -> Callable:
    """A registered name, or a dotted path ``pkg.module.function``."""
    if name in registry:
        return registry[name]
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"unknown name {name!r}: use one of {sorted(registry)} or a dotted path pkg.module.fn")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {name!r} ({e}); registered names are {sorted(registry)}") from e


__all__ = ["ADVANTAGES", "LOSSES", "Algorithm", "LossInputs", "resolve"]
