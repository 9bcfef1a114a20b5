"""Off-policy correction against the engine's logprobs: ``off_policy(prox, engine, mask, cfg) -> Correction``.

The engine sampled each token from ``pi_engine`` (its processed logprobs at the sampling temperature); the trainer
recomputes ``pi_prox`` (its own policy before this update, same temperature). They differ by staleness (the engine
may hold older weights, ``max_lag``) and by numerics (kernels, precision). Two forms:

- ``decoupled`` (Hilton et al. 2022; AReaL): PPO's old policy is ``pi_prox``, and each token is weighted by
  ``w = f(pi_prox / pi_engine)`` (detached). With one optimizer step per batch ``pi_prox`` is this step's own forward
  pass, detached, so PPO's ratio is 1 and the weight carries the whole correction.
- ``bypass``: the engine's logprobs are PPO's old policy; PPO's ratio (and its clipping) absorbs the correction and
  there is no separate weight (``is_mode`` must be ``none``).

The weight ``w`` is built at one *level* and shaped by one *mode*:
- level ``token``: ``pi_prox / pi_engine`` per token; ``sequence``: the product over the row's policy tokens (exact
  sequence-level IS); ``geometric``: the geometric mean over the row (GSPO-style, length-normalized).
- mode ``truncate``: ``min(w, tis_cap)`` (TIS, Yao et al. 2025); ``clip``: ``clamp(w, is_floor, tis_cap)``;
  ``mask``: ``w`` inside ``[is_floor, tis_cap]``, 0 outside (MIS; IcePop's band, Ling team 2025; TRL's
  ``token_mask``); ``none``: 1.

Metrics (stable names): ``is/ratio_{min,mean,max}`` of ``w`` before the mode, over policy tokens; ``is/truncated_frac``
(weight clamped) and ``is/masked_frac`` (weight zeroed); ``mismatch/kl``, the k3 estimate of KL(engine || trainer)
per token on the engine's samples, and ``mismatch/abs_logprob_diff``. A "sequence" is a batch row: one segment of a
trajectory. Log-weights are clamped to [-20, 20] before ``exp`` so a sequence product cannot overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .losses import LOG_RATIO_LIMIT, masked_mean
from .registry import resolve


@dataclass
class Correction:
    old_logprobs: torch.Tensor  # (N, T) PPO's old policy for this form
    weight: torch.Tensor  # (N, T) detached IS weight, 1 where there is nothing to correct
    metrics: dict[str, torch.Tensor]


# ----- levels: token log-ratios (N, T), 0 off the mask -> log-weights (N, T) -----
def token(log_r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_r


def sequence(log_r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_r.sum(-1, keepdim=True).expand_as(log_r)  # (N, T)


def geometric(log_r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(log_r, mask, dim=-1, keepdim=True).expand_as(log_r)  # (N, T)


# ----- modes: ratio (N, T) -> (weight, clamped, zeroed), each (N, T) -----
def unweighted(ratio, cfg):
    no = torch.zeros_like(ratio, dtype=torch.bool)
    return torch.ones_like(ratio), no, no


def truncate(ratio, cfg):
    return ratio.clamp(max=cfg.tis_cap), ratio > cfg.tis_cap, torch.zeros_like(ratio, dtype=torch.bool)


def clip(ratio, cfg):
    outside = (ratio > cfg.tis_cap) | (ratio < cfg.is_floor)
    return ratio.clamp(cfg.is_floor, cfg.tis_cap), outside, torch.zeros_like(outside)


def band_mask(ratio, cfg):
    outside = (ratio > cfg.tis_cap) | (ratio < cfg.is_floor)
    return torch.where(outside, 0.0, ratio), torch.zeros_like(outside), outside


# ----- forms: which logprobs PPO's ratio is taken against -----
def decoupled(prox: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    return prox


def bypass(prox: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    return engine


IS_LEVELS: dict[str, Callable] = {"token": token, "sequence": sequence, "geometric": geometric}
IS_MODES: dict[str, Callable] = {"none": unweighted, "truncate": truncate, "clip": clip, "mask": band_mask}
IS_FORMS: dict[str, Callable] = {"decoupled": decoupled, "bypass": bypass}


@torch.no_grad()
def off_policy(prox: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, cfg) -> Correction:
    """The old logprobs for PPO and the IS weight of each policy token (all (N, T), detached)."""
    prox, engine = prox.detach(), engine.detach()
    log_r = torch.where(mask, prox - engine, 0.0)  # (N, T) token log-ratio
    level = resolve(cfg.is_level, IS_LEVELS, "is_level")
    ratio = torch.exp(level(log_r, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # (N, T)
    weight, clamped, zeroed = resolve(cfg.is_mode, IS_MODES, "is_mode")(ratio, cfg)  # (N, T) each
    token_r = torch.exp(log_r)  # (N, T)
    metrics = {
        "is/ratio_mean": masked_mean(ratio, mask),
        "is/ratio_min": ratio[mask].min() if mask.any() else torch.tensor(1.0),
        "is/ratio_max": ratio[mask].max() if mask.any() else torch.tensor(1.0),
        "is/truncated_frac": masked_mean(clamped.float(), mask),
        "is/masked_frac": masked_mean(zeroed.float(), mask),
        "mismatch/kl": masked_mean(token_r - 1 - log_r, mask),  # k3 of KL(engine || trainer), Schulman 2020
        "mismatch/abs_logprob_diff": masked_mean(log_r.abs(), mask),
    }
    old = resolve(cfg.is_form, IS_FORMS, "is_form")(prox, engine)  # (N, T)
    return Correction(old, torch.where(mask, weight, 0.0), metrics)
