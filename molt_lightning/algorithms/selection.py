"""Token selection: which of a batch's policy tokens the loss trains on, chosen before the mini-batch norms are counted.

A selection is ``fn(SelectionInputs, cfg) -> mask (N, T-1) bool``, a pure function of the whole batch (every rank's
rows, every micro-batch), so a batch-wide statistic is exact: the top-entropy quantile is taken over all of the
batch's policy tokens, not per micro-batch or per rank. The step applies it to the loss mask before ``trainer.plan``
counts the norms, so **a token a selection removes leaves the denominators** (token_mean divides by the tokens kept,
the sequence means by the rows that keep one); a loss-side weight (the IS weight, a loss function's own factor)
multiplies the per-token loss and keeps them. A selection only removes tokens (the result is and-ed with the mask);
advantages are estimated before it, over every sample. ``token_selection`` names one or a list (applied in turn).

- ``top_entropy`` (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's ``top_entropy_quantile``): the share
  ``top_entropy_share`` of tokens with the highest entropy under the policy before the update, at the sampling
  temperature (ties at the threshold are kept); it needs the entropies before the loss, so the step runs its no-grad
  pass over the batch (the one PPO's old logprobs use) when nothing else does.
- ``overlong_filter`` (DAPO's overlong filtering, Yu et al. 2025): a sample cut at ``max_tokens`` gets no loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .registry import resolve


@dataclass
class SelectionInputs:
    mask: torch.Tensor  # (N, T-1) bool: the batch's policy tokens
    entropy: torch.Tensor | None  # (N, T-1) the policy's entropies before the update (a selection with needs_entropy)
    truncation: list[str]  # per row (N): its trajectory's truncation cause ("max_tokens", "max_turns", ...), or ""


def none(inp: SelectionInputs, cfg) -> torch.Tensor:
    return inp.mask


def top_entropy(inp: SelectionInputs, cfg) -> torch.Tensor:
    values = inp.entropy[inp.mask].float()  # (K,) every policy token of the batch
    if values.numel() == 0:
        return inp.mask
    threshold = torch.quantile(values, 1.0 - cfg.top_entropy_share)
    return inp.mask & (inp.entropy >= threshold)


top_entropy.needs_entropy = True


def overlong_filter(inp: SelectionInputs, cfg) -> torch.Tensor:
    cut = torch.tensor([cause == "max_tokens" for cause in inp.truncation], device=inp.mask.device)  # (N,)
    return inp.mask & ~cut[:, None]


SELECTIONS: dict[str, Callable] = {"none": none, "top_entropy": top_entropy, "overlong_filter": overlong_filter}


def chained(names: list[str]) -> Callable:
    """The selections ``names`` (registered or dotted paths) applied in turn, as one function; it needs entropies
    when any of them does (``needs_entropy``)."""
    fns = [resolve(name, SELECTIONS, "token_selection") for name in names]

    def select(inp: SelectionInputs, cfg) -> torch.Tensor:
        mask = inp.mask
        for fn in fns:
            mask = mask & fn(SelectionInputs(mask, inp.entropy, inp.truncation), cfg).to(torch.bool)
        return mask

    select.needs_entropy = any(getattr(fn, "needs_entropy", False) for fn in fns)
    return select
