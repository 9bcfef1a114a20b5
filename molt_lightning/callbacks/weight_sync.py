"""``WeightSync``: push the policy's weights to the rollout engine, tagged with the policy version.

What a push carries (every weight, or a LoRA policy's adapter only) is decided by ``lora.sync_buckets``; the bytes sent
are logged as ``perf/sync_bytes``."""

from __future__ import annotations

import lightning as L


class WeightSync(L.Callback):
    """At train start (the engine may hold stale weights, e.g. after a resume) and after every ``every_n_steps``
    training steps (rollout batches, i.e. policy versions; a step may hold several optimizer steps). A larger
    ``every_n_steps`` trades staleness for fewer transfers; the staleness bound still holds because the rollout
    source admits work by the engine's version."""

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        self.every_n_steps = every_n_steps

    def on_train_start(self, trainer, pl_module) -> None:
        max_lag = pl_module.source.max_lag
        if self.every_n_steps > max_lag + 1:
            raise ValueError(
                f"WeightSync(every_n_steps={self.every_n_steps}) with max_lag={max_lag} would stall: the engine would "
                f"still serve a version the trainer may no longer use. Use every_n_steps <= max_lag + 1."
            )
        pl_module.push_weights()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.policy_version % self.every_n_steps == 0:
            seconds, sent = pl_module.push_weights()
            outputs["weight_sync_s"] = seconds  # for RolloutMonitor's split of the step's wall time
            pl_module.log("perf/weight_sync_s", seconds, on_step=True, batch_size=1)
            pl_module.log("perf/sync_bytes", float(sent), on_step=True, batch_size=1)
