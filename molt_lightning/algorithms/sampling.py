"""Sample-side pieces of DAPO (Yu et al. 2025): reward shaping before the advantages, and the group filter of dynamic
sampling that the rollout source applies to every completed group.

- Reward shaping ``fn(rewards (M,), lengths (M,), cfg) -> (M,)``; ``lengths`` counts a trajectory's policy tokens
  (over all its turns). ``overlong`` is DAPO's soft overlong punishment, added to the reward:
  0 up to ``L_max - L_cache`` tokens, then a linear ramp to ``-overlong_penalty`` at ``L_max``, and beyond.
- Group filter ``fn(rewards: list[float]) -> bool`` (keep the group?). ``nonzero_std`` is DAPO's dynamic sampling:
  a group whose rewards are all equal has zero advantage under every group baseline, so it would only dilute the
  batch; the rollout source drops it (counted as ``dropped_filtered_groups``/``_samples``) and admits another
  prompt in its place, so a batch is always ``prompts_per_step`` informative groups. The filter sees the agent's
  reward before shaping (DAPO filters on accuracy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def no_shaping(rewards: torch.Tensor, lengths: torch.Tensor, cfg) -> torch.Tensor:
    return rewards


def overlong(rewards: torch.Tensor, lengths: torch.Tensor, cfg) -> torch.Tensor:
    """DAPO's soft overlong punishment: ``r - penalty * clamp((|y| - (L_max - L_cache)) / L_cache, 0, 1)``."""
    start = cfg.overlong_max_tokens - cfg.overlong_buffer
    excess = ((lengths.to(rewards.dtype) - start) / cfg.overlong_buffer).clamp(0, 1)  # (M,)
    return rewards - cfg.overlong_penalty * excess


def nonzero_std(rewards: list[float]) -> bool:
    """Keep a group only if its rewards are not all equal (a group of one is always dropped)."""
    return max(rewards) > min(rewards)


REWARD_SHAPERS: dict[str, Callable] = {"none": no_shaping, "overlong": overlong}
GROUP_FILTERS: dict[str, Callable | None] = {"none": None, "nonzero_std": nonzero_std}
