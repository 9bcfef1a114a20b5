"""Cross-check against an independent implementation: TRL's GRPO loss (``GRPOTrainer._compute_loss``, TRL's own code,
called on a minimal stub trainer) on identical inputs, for every configuration both support. Loss and gradient must
agree within 1e-6.

Inputs: per-token logprobs of the current policy (the gradient leaf), the old policy's (TRL's
``old_per_token_logps``, our decoupled ``prox``), the sampler's (TRL's ``sampling_per_token_logps``, our engine
logprobs), advantages and a completion mask with rows of different lengths (no row is empty: TRL counts empty rows in
its ``grpo``/``dr_grpo`` means, we do not, see objective.py).

TRL computes the vLLM importance-sampling ratio inside ``_generate_and_score_completions`` (it is not a function of its
own), so ``trl_is_ratio`` below is a transcription of those lines (trl 1.16, grpo_trainer.py, "Compute the importance
sampling ratio when using vLLM"); the loss that applies it is TRL's own code.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from molt_lightning.algorithms import LOSSES, Algorithm, LossInputs, objective, off_policy

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL warns about the vLLM version it was not tested with
    from trl.trainer.grpo_trainer import GRPOTrainer

B, P, T, MAX_LEN = 4, 2, 5, 8


def trl_is_ratio(old, sampling, mask, mode, clip_max, clip_min=None):
    """TRL 1.16's vLLM IS ratio (transcribed; see the module docstring)."""
    per_token_logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > clip_max), value=0.0)


def make_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3  # (B, T) current policy
    old = logps + torch.randn(B, T, generator=g) * 0.3  # ratios roughly in [0.4, 2.5]: both clip sides are hit
    sampling = old + torch.randn(B, T, generator=g) * 0.4
    lengths = torch.tensor([5, 3, 1, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    advantages = torch.randn(B, generator=g)  # (B,)
    ref = logps + torch.randn(B, T, generator=g) * 0.2
    entropies = torch.rand(B, T, generator=g) * 2
    return logps, old, sampling, mask, advantages, ref, entropies


def trl_loss(logps, old, sampling, mask, advantages, ref, entropies, *, loss_type, level="token", eps_low=0.2,
             eps_high=0.2, delta=None, is_mode=None, is_max=None, is_min=None, beta=0.0, entropy_coef=0.0):
    leaf = logps.clone().requires_grad_(True)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, entropies, None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=is_mode is not None, vllm_importance_sampling_correction=is_mode is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                    gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=entropy_coef != 0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, P, dtype=torch.long), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
        "ref_per_token_logps": ref,
    }
    if is_mode is not None:
        inputs["importance_sampling_ratio"] = trl_is_ratio(old, sampling, mask, is_mode, is_max, is_min)
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def molt_loss(logps, old, sampling, mask, advantages, ref, entropies, cfg: Algorithm):
    leaf = logps.clone().requires_grad_(True)
    m = mask.bool()
    corr = off_policy(old, sampling, m, cfg)
    inp = LossInputs(leaf, corr.old_logprobs, advantages[:, None].expand(B, T), m, is_weight=corr.weight,
                     entropy=entropies, ref_logprobs=ref if cfg.kl_coef else None)
    loss, _ = objective(inp, LOSSES[cfg.loss], cfg)
    loss.backward()
    return loss.detach(), leaf.grad


NO_IS = dict(is_mode="none")
CASES = {  # name: (TRL settings, molt Algorithm)
    "clip, token mean (bnpo)": (dict(loss_type="bnpo"), Algorithm(**NO_IS)),
    "clip, token mean (dapo)": (dict(loss_type="dapo"), Algorithm(**NO_IS)),
    "clip-higher, token mean": (dict(loss_type="dapo", eps_low=0.2, eps_high=0.28),
                                Algorithm(clip_low=0.2, clip_high=0.28, **NO_IS)),
    "clip, seq-mean-token-mean (grpo)": (dict(loss_type="grpo"), Algorithm(aggregation="seq_mean_token_mean", **NO_IS)),
    "clip-higher, Dr. GRPO aggregation": (
        dict(loss_type="dr_grpo", eps_high=0.28),
        Algorithm(clip_high=0.28, aggregation="seq_mean_token_sum_norm", loss_norm_tokens=MAX_LEN, **NO_IS)),
    "dual-clip (TRL delta)": (dict(loss_type="dapo", delta=1.5), Algorithm(dual_clip=1.5, **NO_IS)),
    "token TIS": (dict(loss_type="dapo", is_mode="token_truncate", is_max=2.0), Algorithm(tis_cap=2.0)),
    "clip-higher + token TIS, grpo": (
        dict(loss_type="grpo", eps_high=0.28, is_mode="token_truncate", is_max=1.5),
        Algorithm(clip_high=0.28, tis_cap=1.5, aggregation="seq_mean_token_mean")),
    "token TIS, Dr. GRPO": (dict(loss_type="dr_grpo", is_mode="token_truncate", is_max=1.5),
                            Algorithm(tis_cap=1.5, aggregation="seq_mean_token_sum_norm", loss_norm_tokens=MAX_LEN)),
    "token clip (TIS with a floor)": (dict(loss_type="dapo", is_mode="token_truncate", is_max=1.5, is_min=0.5),
                                      Algorithm(is_mode="clip", tis_cap=1.5, is_floor=0.5)),
    "token mask (IcePop band)": (dict(loss_type="dapo", is_mode="token_mask", is_max=1.5, is_min=0.5),
                                 Algorithm(is_mode="mask", tis_cap=1.5, is_floor=0.5)),
    "sequence TIS": (dict(loss_type="dapo", is_mode="sequence_truncate", is_max=2.0),
                     Algorithm(is_level="sequence", tis_cap=2.0)),
    "sequence mask": (dict(loss_type="dapo", is_mode="sequence_mask", is_max=2.0, is_min=0.5),
                      Algorithm(is_level="sequence", is_mode="mask", tis_cap=2.0, is_floor=0.5)),
    "GSPO (sequence ratio), seq-mean-token-mean": (
        dict(loss_type="grpo", level="sequence", eps_low=0.1, eps_high=0.15),
        Algorithm(loss="gspo", clip_low=0.1, clip_high=0.15, aggregation="seq_mean_token_mean", **NO_IS)),
    "CISPO + token TIS": (dict(loss_type="cispo", eps_high=1.2, is_mode="token_truncate", is_max=2.0),
                          Algorithm(loss="cispo", clip_low=1.0, clip_high=0.2, tis_cap=2.0)),
    "KL k3 to the reference": (dict(loss_type="dapo", beta=0.05), Algorithm(kl_coef=0.05, kl_estimator="k3", **NO_IS)),
    "entropy bonus, token mean": (dict(loss_type="dapo", entropy_coef=0.01), Algorithm(entropy_coef=0.01, **NO_IS)),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_trl_grpo_loss(case, seed):
    trl_kw, cfg = CASES[case]
    data = make_inputs(seed)
    trl_value, trl_grad = trl_loss(*data, **trl_kw)
    molt_value, molt_grad = molt_loss(*data, cfg)
    assert abs(trl_value.item() - molt_value.item()) < 1e-6, (trl_value.item(), molt_value.item())
    assert torch.allclose(trl_grad, molt_grad, atol=1e-6, rtol=0), (trl_grad - molt_grad).abs().max()


def test_the_inputs_exercise_both_clip_sides_and_the_is_cap():
    logps, old, sampling, mask, advantages, *_ = make_inputs(0)
    m = mask.bool()
    ratio, is_ratio = (logps - old).exp()[m], (old - sampling).exp()[m]
    assert (ratio > 1.28).any() and (ratio < 0.8).any() and (is_ratio > 2.0).any() and (is_ratio < 0.5).any()
