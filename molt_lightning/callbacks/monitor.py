"""``RolloutMonitor``: logs what the rollout side and the engine did during each step (the staleness bound is checked
once, where the batch is built: ``trajectory.collate``).

Per step, from the rollout source's counts (``rollout.RolloutCounts``; rank 0, which owns the source): samples
finished, ok, truncated, failed, trained, dropped (stale, filtered, empty groups), each new this step and as a
total (``samples/<name>``, ``samples/<name>_total``), and the truncated ones per cause (``trajectory.Truncation``:
``samples/truncated/max_tokens``, ``.../max_turns``, ``.../environment``, ``.../context``, each with ``_total``); the
share of the batch's completions that repeat another of their group token for token (``samples/duplicates``,
``trajectory.repeats``); the reward over all usable samples (``reward/all_samples``: with a group filter, ``reward``
covers only the groups kept); the events agents counted (``client.count``: ``agent/tool_error/timeout``,
``agent/endpoint_error/model_not_found``, ...). From the engine
(its own ``take_stats``): generated tokens per second and the share of wall time it had no request in flight. From
each model beside the policy (``engines.Auxiliary``: a teacher, a judge): its requests, tokens, mean latency,
failures and timeouts this step (``<name>/requests``, ...). The
step's wall time split on the trainer's side (``perf/trainer_idle_s`` waiting for rollouts, ``perf/train_compute_s``
the gradient step, ``perf/weight_sync_s``, and ``perf/overhead_s`` / ``perf/overhead_frac``: everything else, i.e.
collation, Lightning's loop, logging and callbacks, checkpoints).

Before any of that, at the start of fit (before ``train_dataloader`` launches the policy engine), each judge of the
agent at a URL (``data.judge.Judge.check``) answers a test question, so a wrong URL, key or model name fails the run
in seconds, naming what to check, instead of failing every sample once the engine is up.
"""

from __future__ import annotations

import time
from dataclasses import fields

import lightning as L

from ..data.judge import check_judges
from ..engines.auxiliary import Auxiliary
from ..rollout.source import RolloutCounts
from ..trainer import parallel
from ..trajectory import repeats

COUNTS = [f.name for f in fields(RolloutCounts) if f.type == "int" and f.name != "buffered_groups"]


class RolloutMonitor(L.Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        failed = None
        if trainer.global_rank == 0:  # rank 0 owns the rollout side; every rank raises what it found
            try:
                check_judges(pl_module.source.agent)
            except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                failed = e
        if (failed := parallel.broadcast(failed, trainer)) is not None:
            raise failed

    def on_train_start(self, trainer, pl_module) -> None:
        # what came before this run is not new: a resumed run's counts, a shared engine's generated tokens
        self._last, self._counts = time.perf_counter(), pl_module.source.counts_now()
        pl_module.engine.take_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now, record = time.perf_counter(), outputs["record"]
        wall, self._last = now - self._last, now
        overhead = max(0.0, wall - record.trainer_idle_s - record.train_compute_s - outputs.get("weight_sync_s", 0.0))
        metrics = {"perf/step_time_s": wall, "perf/trainer_idle_s": record.trainer_idle_s,
                   "perf/trainer_idle_frac": record.trainer_idle_s / wall,
                   "perf/train_compute_s": record.train_compute_s, "perf/overhead_s": overhead,
                   "perf/overhead_frac": overhead / wall}
        if trainer.global_rank == 0:
            # the batch: its tokens' versions were checked where it was built (trajectory.collate)
            metrics.update(self._rollout(pl_module.source.counts_now(), record.batch, wall))
            engine = pl_module.engine.take_stats()
            metrics["perf/engine_idle_frac"] = min(1.0, engine["engine_idle_s"] / wall)
            metrics["perf/gen_tokens_per_s"] = engine["generated_tokens"] / wall
            for aux in Auxiliary.started:  # models beside the policy: a teacher, judges
                metrics.update(aux.take_metrics())
        pl_module.log_dict(metrics, on_step=True, batch_size=1)

    def _rollout(self, now: RolloutCounts, batch, wall: float) -> dict[str, float]:
        before, self._counts = self._counts, now
        metrics = {}
        for prefix, totals, old in [("samples/", {k: getattr(now, k) for k in COUNTS}, vars(before)),
                                    ("samples/truncated/", now.truncated_by, before.truncated_by),
                                    ("agent/", now.agent, before.agent)]:
            for name, total in totals.items():
                metrics[f"{prefix}{name}"] = float(total - old.get(name, 0))
                metrics[f"{prefix}{name}_total"] = float(total)
        # reward over every usable sample generated for this step, the groups a group filter dropped included
        kept_n, kept_sum = len(batch.trajectories), sum(t.reward for t in batch.trajectories)
        filtered_n = now.dropped_filtered_samples - before.dropped_filtered_samples
        filtered_sum = now.filtered_reward_sum - before.filtered_reward_sum
        metrics["reward/all_samples"] = (kept_sum + filtered_sum) / (kept_n + filtered_n)
        metrics["samples/duplicates"] = repeats(batch.trajectories) / kept_n
        metrics["rollout/buffered_groups"] = float(now.buffered_groups)
        return metrics
