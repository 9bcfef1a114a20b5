"""``RolloutMonitor``: logs what the rollout side did during each step, and re-checks the staleness bound.

Per step: samples failed / truncated / dropped (new this step and totals), the reward over all usable samples
(``reward/all_samples``: with a group filter, ``reward`` covers only the groups kept), generated tokens per second,
the seconds the trainer waited for data and the share of wall time the engine had no request in flight; the step's
wall time split on the trainer's side (``perf/trainer_idle_s`` waiting for rollouts, ``perf/train_compute_s`` the
gradient step, ``perf/weight_sync_s``, and ``perf/overhead_s`` / ``perf/overhead_frac``: everything else, i.e.
collation, Lightning's loop, logging and callbacks, checkpoints); the events agents counted (``client.count``:
``agent/tool_error/timeout``, ``agent/endpoint_error/model_not_found``, ...).
"""

from __future__ import annotations

import time

import lightning as L

from ..trajectory import ConsistencyError


class RolloutMonitor(L.Callback):
    COUNTERS = ("status_failed", "status_truncated", "dropped_stale_groups", "dropped_stale_samples",
                "dropped_empty_groups", "dropped_filtered_groups", "dropped_filtered_samples", "samples")

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        wall, self._last = now - self._last, now
        b = outputs["batch"]
        s = b.stats
        lag = (pl_module.policy_version - 1) - b.versions[b.loss_mask]  # versions seen by the step that just ran
        if lag.numel() and int(lag.max()) > pl_module.source.max_lag:
            raise ConsistencyError(f"trained on a token {int(lag.max())} versions old; max_lag is "
                                   f"{pl_module.source.max_lag}")
        metrics = {f"samples/{k}": s.get(f"new/{k}", 0.0) for k in self.COUNTERS}
        metrics.update({f"samples/{k}_total": s.get(f"total/{k}", 0.0) for k in self.COUNTERS})
        for key, total in s.items():  # what agents counted (client.count): tool errors, refused requests
            if key.startswith("total/agent/"):
                name = key[len("total/"):]
                metrics[name], metrics[f"{name}_total"] = s.get(f"new/{name}", 0.0), total
        # reward over every usable sample generated for this step, the groups a group filter dropped included
        kept_n, filtered_n = len(b.trajectories), s.get("new/dropped_filtered_samples", 0.0)
        kept_sum = sum(t.reward for t in b.trajectories)
        metrics["reward/all_samples"] = (kept_sum + s.get("filtered_reward_sum", 0.0)) / (kept_n + filtered_n)
        overhead = max(0.0, wall - outputs["trainer_idle_s"] - outputs["train_compute_s"]
                       - outputs.get("weight_sync_s", 0.0))
        metrics.update({
            "perf/step_time_s": wall,
            "perf/trainer_idle_s": outputs["trainer_idle_s"],
            "perf/trainer_idle_frac": outputs["trainer_idle_s"] / wall,
            "perf/train_compute_s": outputs["train_compute_s"],
            "perf/overhead_s": overhead,
            "perf/overhead_frac": overhead / wall,
            "perf/engine_idle_frac": min(1.0, s["engine_idle_s"] / wall),
            "perf/gen_tokens_per_s": s["generated_tokens"] / wall,
            "rollout/buffered_groups": s["buffered_groups"],
        })
        pl_module.log_dict(metrics, on_step=True, batch_size=1)
