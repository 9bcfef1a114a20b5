"""The recipe's algorithm record: which estimator and loss, and their knobs (one flat dataclass, shown by --help)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Algorithm:
    advantage: str = "grpo"  # registered name or dotted path
    loss: str = "ppo_clip"  # registered name or dotted path
    scale_by_std: bool = True  # GRPO: divide by the group's reward std
    eps: float = 1e-6  # added to the std
    clip_low: float = 0.2  # PPO ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    tis_cap: float = 2.0  # truncated importance sampling: weight = min(pi_prox / pi_engine, tis_cap)


def _allow_in_checkpoints() -> None:
    """Checkpoints store the recipe's ``Algorithm`` in their hyperparameters; let ``torch.load(weights_only=True)``
    (Lightning's default when resuming) read it back."""
    import torch

    torch.serialization.add_safe_globals([Algorithm])


_allow_in_checkpoints()
