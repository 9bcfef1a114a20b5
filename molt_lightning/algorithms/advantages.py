"""Advantage estimators: one value per trajectory from its reward and its group."""

from __future__ import annotations

import torch


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(r - mean_group) / (std_group + eps)``.

    std is the unbiased sample std (as TRL and verl compute it); a group of one has std 0 by convention, so its
    advantage is 0. ``cfg.scale_by_std=False`` gives the mean-only baseline (Dr. GRPO's estimator).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # (M,), (K,)
    K = counts.numel()
    sums = torch.zeros(K, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]  # (M,)
    sq = torch.zeros(K, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, (rewards - mean) ** 2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()[inverse]  # (M,)
    adv = rewards - mean
    return adv / (std + cfg.eps) if cfg.scale_by_std else adv
