"""``UpdateKL``: how far each step moved the policy, as KL(before || after) on the tokens it trained.

A diagnostic built on the step's record (``trainer.record.StepRecord``): the logprobs before the update are the
step's own (no pass of ours), the ones after come from one no-grad pass of ``trainer.plan.policy_forward`` over the
same batch, cut the way the step cut it (its micro-batches; under FSDP2 every rank takes part, as it must). The
tokens were sampled by the engine from (nearly) the policy before the update, so ``update/kl`` is the k1 estimate
``mean(log p_before - log p_after)`` and ``update/kl_k3`` Schulman's k3, over every rank's trained tokens; the
after-pass costs about one forward of the batch per logged step (``every_n_steps``).
"""

from __future__ import annotations

import lightning as L
import torch

from ..trainer import parallel
from ..trainer.plan import policy_forward


class UpdateKL(L.Callback):
    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"UpdateKL: every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = outputs["record"]
        if record.version % self.every_n_steps:
            return
        after, _ = policy_forward(pl_module.policy, record.batch, record.minis, pl_module.rollout.temperature)
        mask = torch.zeros_like(record.loss_mask)  # (N, T-1): this rank's trained tokens
        mask[record.rows] = record.loss_mask[record.rows]
        log_r = (after - record.logprobs)[mask].double()  # (K,) log p_after - log p_before
        sums = torch.stack([-log_r.sum(), (log_r.exp() - 1 - log_r).sum(), torch.tensor(float(log_r.numel()))])
        k1, k3, n = parallel.all_reduce(sums.cpu(), trainer).tolist()
        pl_module.log_dict({"update/kl": k1 / max(n, 1.0), "update/kl_k3": k3 / max(n, 1.0)}, on_step=True,
                           batch_size=1)
