"""``StepRecord``: what one training step computed, handed to every callback as ``outputs["record"]`` in
``on_train_batch_end`` (detached; nothing recomputed, no extra forward pass).

A diagnostic reads the step's own numbers from it instead of editing the step: the batch as trained, this rank's
rows, the advantages, the trainer's logprobs before the update, the engine's, the importance weights, the loss mask
as trained (after token selection) beside the policy tokens it started from, the entropies. A callback that needs a
forward pass of its own (e.g. the policy after the update) runs ``trainer.plan.policy_forward(module.policy,
record.batch, record.minis, temperature)``, which computes logprobs exactly as the step does (its micro-batches, an
empty one running a row with weight 0 so that FSDP2's collectives line up). ``callbacks.UpdateKL`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trajectory import Batch
from .plan import MiniBatch


@dataclass
class StepRecord:
    """Per-token tensors are (N, T-1) over the whole batch (position t: the token at t+1), filled on this rank's
    ``rows`` (0 elsewhere) unless said otherwise."""

    batch: Batch  # the batch as trained (its loss_mask: after token selection)
    rows: list[int]  # this rank's rows of it, sorted
    minis: list[MiniBatch]  # this rank's plan: mini-batches of micro-batches (trainer.plan.policy_forward takes it)
    version: int  # the policy version the step trained (the weights pushed after it are version + 1)
    advantages: torch.Tensor  # every row: the estimator's advantages (distillation's term included)
    policy_mask: torch.Tensor  # bool, every row: the policy tokens (what the engine sampled)
    loss_mask: torch.Tensor  # bool, every row: the tokens the loss trained on (policy_mask after token selection)
    engine_logprobs: torch.Tensor  # every row: the engine's logprobs of the sampled tokens (what IS corrects for)
    logprobs: torch.Tensor  # the trainer's, at the sampling temperature, before the step's first optimizer step
    entropy: torch.Tensor  # the policy's entropies in the loss pass of the first update epoch
    is_weight: torch.Tensor | None  # the off-policy correction's weight in the first update epoch (None: no weight)
    trainer_idle_s: float = 0.0  # waiting for the batch
    train_compute_s: float = 0.0  # the step's own compute

    @classmethod
    def start(cls, batch: Batch, policy_mask: torch.Tensor, minis: list[MiniBatch], version: int,
              advantages: torch.Tensor, old: torch.Tensor | None) -> StepRecord:
        """The record before the update's passes fill it; ``old``: PPO's old logprobs when the constants pass made
        them (then they are the logprobs before the update for every row of this rank)."""
        zeros = torch.zeros_like(policy_mask, dtype=torch.float32)  # (N, T-1)
        rows = sorted(r for mb in minis for micro in mb.micro for r in micro)
        return cls(batch, rows, minis, version, advantages.detach(), policy_mask, batch.loss_mask[:, 1:],
                   batch.engine_logprobs[:, 1:], zeros if old is None else old, zeros.clone(), None)

    def fill(self, idx: torch.Tensor, cut: int, logprobs: torch.Tensor, entropy: torch.Tensor,
             is_weight: torch.Tensor | None, old_known: bool) -> None:
        """One micro-batch of the first update epoch: rows ``idx``, their first ``cut`` positions."""
        if not old_known:  # one optimizer step: the loss pass is the pass before the update
            self.logprobs[idx, :cut] = logprobs.detach()
        self.entropy[idx, :cut] = entropy.detach()
        if is_weight is not None:
            if self.is_weight is None:
                self.is_weight = torch.zeros_like(self.entropy)
            self.is_weight[idx, :cut] = is_weight.detach().float()
