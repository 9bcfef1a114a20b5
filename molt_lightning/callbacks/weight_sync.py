"""``WeightSync``: when the policy's weights go to the rollout engine, tagged with the policy version; how they go
(gathered, bucketed, pushed) is the weight flow's (``molt_lightning.trainer.weights``). The bytes sent are logged as
``perf/sync_bytes``, the trainer's seconds as ``perf/weight_sync_s``."""

from __future__ import annotations

import lightning as L


class WeightSync(L.Callback):
    """At train start (the engine may hold stale weights, e.g. after a resume) and after every ``every_n_steps``
    training steps (rollout batches, i.e. policy versions; a step may hold several optimizer steps), in buckets of
    about ``bucket_mb`` MiB. A larger ``every_n_steps`` trades staleness for fewer transfers; the staleness bound
    still holds because the rollout source admits work by the engine's version."""

    def __init__(self, every_n_steps: int = 1, bucket_mb: int = 64):
        if every_n_steps < 1 or bucket_mb < 1:
            raise ValueError(f"WeightSync: every_n_steps and bucket_mb must be >= 1, got {every_n_steps}, {bucket_mb}")
        self.every_n_steps, self.bucket_bytes = every_n_steps, bucket_mb * 2**20

    def push(self, trainer, pl_module) -> tuple[float, int]:
        return pl_module.weights.push(pl_module.policy.lm, pl_module.policy_version, trainer, self.bucket_bytes)

    def on_train_start(self, trainer, pl_module) -> None:
        max_lag = pl_module.rollout.max_lag
        if self.every_n_steps > max_lag + 1:
            raise ValueError(
                f"WeightSync(every_n_steps={self.every_n_steps}) with max_lag={max_lag} would stall: the engine would "
                f"still serve a version the trainer may no longer use. Use every_n_steps <= max_lag + 1."
            )
        self.push(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.policy_version % self.every_n_steps == 0:
            seconds, sent = self.push(trainer, pl_module)
            outputs["weight_sync_s"], outputs["sync_bytes"] = seconds, sent  # RolloutMonitor's split; RunTrace
            pl_module.log("perf/weight_sync_s", seconds, on_step=True, batch_size=1)
            pl_module.log("perf/sync_bytes", float(sent), on_step=True, batch_size=1)
