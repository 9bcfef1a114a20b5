"""Policy losses over per-token logprobs, with the off-policy correction against the engine's logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossInputs:
    """Every field is (N, T), aligned with the predicted tokens; ``mask`` marks policy tokens."""

    logprobs: torch.Tensor  # current policy, carries the gradient
    prox_logprobs: torch.Tensor  # the policy before this update (detached): PPO's "old" policy
    engine_logprobs: torch.Tensor  # what the sampler reported (behaviour policy)
    advantages: torch.Tensor
    mask: torch.Tensor  # bool


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def ppo_clip(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with token-level truncated importance sampling (TIS, Yao et al.
    2025) in the decoupled form (Hilton et al. 2022; AReaL): the PPO ratio is taken against the proximal policy
    (the trainer's own logprobs before the update), and each token is weighted by
    ``w = min(pi_prox / pi_engine, tis_cap)`` (no gradient) for the gap between sampler and trainer: staleness and
    numerical mismatch. Token-mean aggregation over the batch.

    loss = -mean_t [ w_t * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) ],  r_t = pi_theta / pi_prox
    """
    m = inp.mask.float()
    ratio = torch.exp(inp.logprobs - inp.prox_logprobs)  # (N, T)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)  # (N, T)
    surrogate = torch.minimum(ratio * inp.advantages, clipped * inp.advantages)  # (N, T)
    log_is = (inp.prox_logprobs - inp.engine_logprobs).detach()  # (N, T)
    is_ratio = torch.exp(log_is)  # (N, T)
    weight = is_ratio.clamp(max=cfg.tis_cap)  # (N, T)
    loss = -masked_mean(weight * surrogate, m)
    on = inp.mask
    with torch.no_grad():
        metrics = {
            "loss/policy": loss.detach(),
            "loss/clip_frac": masked_mean((ratio * inp.advantages > clipped * inp.advantages).float(), m),
            "is/ratio_mean": masked_mean(is_ratio, m),
            "is/ratio_min": is_ratio[on].min() if on.any() else torch.tensor(1.0),
            "is/ratio_max": is_ratio[on].max() if on.any() else torch.tensor(1.0),
            "is/truncated_frac": masked_mean((is_ratio > cfg.tis_cap).float(), m),
            # KL(engine || trainer) by the k3 estimator on engine-sampled tokens (Schulman 2020)
            "mismatch/kl": masked_mean(is_ratio - 1 - log_is, m),
            "mismatch/abs_logprob_diff": masked_mean(log_is.abs(), m),
        }
    return loss, metrics
