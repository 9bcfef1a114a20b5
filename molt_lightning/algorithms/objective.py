"""The training objective: a policy loss, weighted for off-policy tokens, aggregated, plus optional KL, entropy and
value terms. ``objective(inp, policy_loss, cfg) -> (loss, metrics)``; every piece below is a pure function.

    loss = agg(w * l_policy) + kl_coef * agg(KL(pi || pi_ref)) - entropy_coef * agg(H(pi)) + value_coef * L_value

Aggregations (``agg(x, mask, cfg, norm)``; a "sequence" is a batch row, and rows without policy tokens do not count).
Each divides a sum over ``mask`` by counts in ``norm`` (``Norm``: policy tokens and rows of the whole
mini-batch), so micro-batches and ranks add up to the whole batch's loss; without ``norm`` the counts are ``mask``'s:
- ``token_mean``: sum over all policy tokens / their number (DAPO; TRL ``bnpo``/``dapo``).
- ``seq_mean_token_mean``: mean over rows of the row's token mean (GRPO paper; TRL ``grpo``; GSPO).
- ``seq_mean_token_sum``: mean over rows of the row's token sum.
- ``seq_mean_token_sum_norm``: sum over all tokens / (rows * ``loss_norm_tokens``): Dr. GRPO's constant normalizer
  (TRL ``dr_grpo`` with ``max_completion_length``), so no sequence's tokens are up- or down-weighted by its length.

KL estimators of KL(pi || pi_ref) on tokens sampled from (approximately) pi, with ``log r = log pi_ref - log pi``
(Schulman 2020, "Approximating KL divergence"): ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r``.
The KL term is not IS-weighted (as TRL's default and verl). The value loss is ``0.5 * (V - return)^2``, token mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .losses import LOG_RATIO_LIMIT, LossInputs, masked_mean
from .registry import resolve


@dataclass(frozen=True)
class Norm:
    """The counts an aggregation divides by: those of the whole mini-batch (all its micro-batches, on all ranks)."""

    tokens: float  # policy tokens in the whole mini-batch
    rows: float  # rows holding at least one policy token

    @classmethod
    def of(cls, mask: torch.Tensor) -> Norm:
        return cls(float(mask.sum().clamp(min=1)), float(mask.any(-1).sum().clamp(min=1)))


# ----- aggregations: per-token values (N, T) -> scalar -----
def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum()


def token_mean(x: torch.Tensor, mask: torch.Tensor, cfg, norm: Norm | None = None) -> torch.Tensor:
    return _masked_sum(x, mask) / (norm or Norm.of(mask)).tokens


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor, cfg, norm: Norm | None = None) -> torch.Tensor:
    per_row = masked_mean(x, mask, dim=-1)  # (N,)
    return per_row.sum() / (norm or Norm.of(mask)).rows


def seq_mean_token_sum(x: torch.Tensor, mask: torch.Tensor, cfg, norm: Norm | None = None) -> torch.Tensor:
    return _masked_sum(x, mask) / (norm or Norm.of(mask)).rows


def seq_mean_token_sum_norm(x: torch.Tensor, mask: torch.Tensor, cfg, norm: Norm | None = None) -> torch.Tensor:
    return _masked_sum(x, mask) / ((norm or Norm.of(mask)).rows * cfg.loss_norm_tokens)


AGGREGATIONS: dict[str, Callable] = {
    "token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum, "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}


# ----- KL estimators: (logprobs, ref_logprobs) (N, T) -> per-token KL (N, T) -----
def _log_r(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # (N, T)


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return -_log_r(logprobs, ref_logprobs)


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * _log_r(logprobs, ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = _log_r(logprobs, ref_logprobs)
    return torch.exp(log_r) - 1 - log_r


KL_ESTIMATORS: dict[str, Callable] = {"k1": k1, "k2": k2, "k3": k3}
ADDITIVE_METRICS = frozenset({"loss/policy", "loss/kl", "loss/entropy", "loss/value", "loss/total"})  # sum over parts


def objective(inp: LossInputs, policy_loss: Callable, cfg,
              norm: Norm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss to minimize and its metrics (detached scalars; ``loss/*`` are the terms that sum to it).
    ``norm``: the counts of the whole mini-batch this micro-batch belongs to (default: this one's own)."""
    mask, norm = inp.mask, norm or Norm.of(inp.mask)
    agg = resolve(cfg.aggregation, AGGREGATIONS, "aggregation")
    per_token, metrics = policy_loss(inp, cfg)  # (N, T)
    if inp.is_weight is not None:
        per_token = inp.is_weight * per_token  # (N, T) off-policy correction
    terms = {"loss/policy": agg(per_token, mask, cfg, norm)}
    if inp.ref_logprobs is not None:
        kl = resolve(cfg.kl_estimator, KL_ESTIMATORS, "kl_estimator")(inp.logprobs, inp.ref_logprobs)  # (N, T)
        terms["loss/kl"] = cfg.kl_coef * agg(kl, mask, cfg, norm)
        metrics["kl/ref"] = masked_mean(kl.detach(), mask)
    if inp.entropy is not None:
        terms["loss/entropy"] = -cfg.entropy_coef * agg(inp.entropy, mask, cfg, norm)
        metrics["entropy"] = masked_mean(inp.entropy.detach(), mask)
    if inp.values is not None:
        terms["loss/value"] = cfg.value_coef * 0.5 * token_mean((inp.values - inp.returns) ** 2, mask, cfg, norm)
        metrics["value/mean"] = masked_mean(inp.values.detach(), mask)
    loss = sum(terms.values())
    metrics.update({k: v.detach() for k, v in terms.items()})
    metrics["loss/total"] = loss.detach()
    metrics["adv/mean"] = masked_mean(inp.advantages.detach(), mask)
    metrics["adv/abs_mean"] = masked_mean(inp.advantages.detach().abs(), mask)
    return loss, metrics
