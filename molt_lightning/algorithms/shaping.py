"""Sample-side pieces: reward shaping before the advantages (length penalties), and the group filter of DAPO's
dynamic sampling that the rollout source applies to every completed group.

- Reward shaping ``fn(rewards (M,), outcomes: trajectory.Outcomes, cfg) -> (M,)``; ``outcomes.lengths`` counts a
  trajectory's policy tokens (over all its turns), ``outcomes.turns`` its turns, ``outcomes.truncated`` whether a
  turn hit ``max_tokens`` (or an episode ``max_turns``). A recipe lists shapers; they apply in order.
  - ``overlong``: DAPO's soft overlong punishment (Yu et al. 2025), added to the reward: 0 up to
    ``L_max - L_cache`` tokens, then a linear ramp to ``-overlong_penalty`` at ``L_max``, and beyond.
  - ``stop_properly``: ``-truncation_penalty`` for a truncated trajectory (one that did not stop by itself).
  - ``length``: linear, ``-token_penalty`` per policy token and ``-turn_penalty`` per turn.
  Turn-level estimators receive the change a shaper makes on the trajectory's last turn.
- Group filter ``fn(rewards: list[float]) -> bool`` (keep the group?). ``nonzero_std`` is DAPO's dynamic sampling:
  a group whose rewards are all equal has zero advantage under every group baseline, so it would only dilute the
  batch; the rollout source drops it (counted as ``dropped_filtered_groups``/``_samples``) and admits another
  prompt in its place, so a batch is always ``prompts_per_step`` informative groups. The filter sees the agent's
  reward before shaping (DAPO filters on accuracy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def no_shaping(rewards: torch.Tensor, outcomes, cfg) -> torch.Tensor:
    return rewards


def overlong(rewards: torch.Tensor, outcomes, cfg) -> torch.Tensor:
    """DAPO's soft overlong punishment: ``r - penalty * clamp((|y| - (L_max - L_cache)) / L_cache, 0, 1)``."""
    start = cfg.overlong_max_tokens - cfg.overlong_buffer
    excess = ((outcomes.lengths.to(rewards.dtype) - start) / cfg.overlong_buffer).clamp(0, 1)  # (M,)
    return rewards - cfg.overlong_penalty * excess


def stop_properly(rewards: torch.Tensor, outcomes, cfg) -> torch.Tensor:
    """``r - truncation_penalty`` where the trajectory was truncated, ``r`` elsewhere."""
    return rewards - cfg.truncation_penalty * outcomes.truncated.to(rewards.dtype)


def length(rewards: torch.Tensor, outcomes, cfg) -> torch.Tensor:
    """``r - token_penalty * |policy tokens| - turn_penalty * |turns|``."""
    return (rewards - cfg.token_penalty * outcomes.lengths.to(rewards.dtype)
            - cfg.turn_penalty * outcomes.turns.to(rewards.dtype))


def chain(shapers: list[Callable]) -> Callable:
    """One shaper applying ``shapers`` in order."""

    def shape(rewards: torch.Tensor, outcomes, cfg) -> torch.Tensor:
        for fn in shapers:
            rewards = fn(rewards, outcomes, cfg)
        return rewards

    return shape


def nonzero_std(rewards: list[float]) -> bool:
    """Keep a group only if its rewards are not all equal (a group of one is always dropped)."""
    return max(rewards) > min(rewards)


REWARD_SHAPERS: dict[str, Callable] = {"none": no_shaping, "overlong": overlong, "stop_properly": stop_properly,
                                       "length": length}
GROUP_FILTERS: dict[str, Callable | None] = {"none": None, "nonzero_std": nonzero_std}
