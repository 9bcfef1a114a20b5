"""``Evaluate``: held-out evaluation during training, on the rollout engine, without stalling the trainer.

In a recipe (``trainer.callbacks``)::

    - class_path: molt_lightning.callbacks.Evaluate
      init_args:
        tasks: {class_path: molt_lightning.data.Tasks, init_args: {sources: [{path: data/test.jsonl}]}}
        k: 4                 # runs per prompt: avg@4, pass@1, pass@4, maj@4
        temperature: 0.7     # the evaluation's sampling (0: greedy, with k: 1); default the run's
        every_n_steps: 25    # and at_start, at_end (both on by default)

When (``evaluation.run_round`` does the work, ``evaluation.summarize`` the metrics):
- **at the start** (before the first step, the weights the run starts from) and **at the end** (after the last
  step's weights reached the engine; the rollouts stop first): the trainer waits for these, so each measures exactly
  one policy version;
- **every ``every_n_steps`` policy versions** a round starts at the next step, once that version's weights have
  reached the engine, and runs beside training: the trainer keeps stepping (its wait is the round's share of the
  engine), and weights that arrive meanwhile serve the rest of the round (in-flight updates), so its metrics name the
  versions they measured (``version_min``/``version_max``). One round at a time: a round due while another runs
  starts when that one has ended (at a later version, which it names).
The metrics go to the run's logger as ``eval/<source>/<metric>`` at the step the round started (``RewardPlot`` draws
``avg@k`` with its interval beside the training reward), every round to ``eval.jsonl`` in the run folder (with each
prompt's mean reward, for before/after comparisons), and a table to the log.

Held out means never trained on. When the run's tasks are a ``data.Tasks`` (finite), ``overlap`` says which side gives
up a prompt both hold: ``drop_from_training`` (the default) leaves the training rows that hold a held-out prompt out
of training, so the held-out set keeps the distribution it was drawn from (with a generator's small problem space,
dropping from the evaluation instead would leave only its rare, harder problems); ``drop_from_eval`` drops those
prompts from the evaluation. Both are counted and logged (``eval/excluded_from_training``, ``eval/dropped_seen``).
A task generator (``tasks(seed)`` without end) cannot be checked: give it a seed of its own (``seed``) and know that
a disjoint seed draws different problems, not necessarily unseen ones. Repeated held-out prompts count once.

``keep_best: eval/<source>/avg@4``: a checkpoint of the weights a periodic round measures is saved when the round
starts and kept as ``best.ckpt`` in the checkpoint folder while its metric is the highest seen (``mode: min`` for
lower is better); the others are deleted when their round ends. Only rank 0 evaluates; every rank saves its shard.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable

import lightning as L

from ..rollout import heldout as evaluation
from ..trainer import parallel
from ..data.sources import prompt_key

log = logging.getLogger(__name__)


class Evaluate(L.Callback):
    def __init__(self, tasks: Callable, k: int = 4, temperature: float | None = None, every_n_steps: int = 0,
                 at_start: bool = True, at_end: bool = True, max_prompts: int | None = None, seed: int = 0,
                 agent: Callable | None = None, success: float = 1.0, concurrency: int = 64,
                 keep_best: str | None = None, mode: str = "max", overlap: str = "drop_from_training"):
        if k < 1 or every_n_steps < 0 or concurrency < 1 or (max_prompts is not None and max_prompts < 1):
            raise ValueError(f"Evaluate: k, concurrency and max_prompts must be >= 1 and every_n_steps >= 0, got k={k}"
                             f", concurrency={concurrency}, max_prompts={max_prompts}, every_n_steps={every_n_steps}")
        if temperature is not None and temperature < 0:
            raise ValueError(f"Evaluate: temperature must be >= 0 (0: greedy), got {temperature}")
        if temperature == 0 and k > 1:
            raise ValueError(f"Evaluate: greedy sampling (temperature 0) gives {k} identical runs per prompt: use "
                             "k: 1, or a temperature > 0 for avg@k / pass@k")
        if keep_best is not None and (not keep_best.startswith("eval/") or mode not in ("max", "min")):
            raise ValueError(f"Evaluate: keep_best names a logged metric (eval/<source>/avg@{k}) and mode is max or "
                             f"min, got {keep_best!r}, {mode!r}")
        if overlap not in ("drop_from_training", "drop_from_eval"):
            raise ValueError(f"Evaluate: overlap is drop_from_training or drop_from_eval, got {overlap!r}")
        if keep_best is not None and not every_n_steps:
            raise ValueError("Evaluate: keep_best keeps the best of the periodic rounds: set every_n_steps")
        self.tasks, self.k, self.temperature, self.every_n_steps = tasks, k, temperature, every_n_steps
        self.at_start, self.at_end, self.max_prompts, self.seed = at_start, at_end, max_prompts, seed
        self.agent, self.success, self.concurrency = agent, success, concurrency
        self.keep_best, self.mode, self.overlap = keep_best, mode, overlap
        self.finished: list[dict] = []  # the last rounds that ended, for the run's record (callbacks.trace)
        self.samples = self.held_out()
        self.dropped_seen = self.excluded_from_training = 0
        self._round = None  # (future, step, version, candidate checkpoint) of the round in flight
        self._due: int | None = None  # the version whose round starts at the next batch
        self._started = False
        self._best: float | None = None

    def held_out(self) -> list[dict]:
        """The held-out samples: all of a finite task set (``len``), else the first ``max_prompts`` of the stream;
        repeated prompts once (``select`` then trims them to ``max_prompts``)."""
        finite = hasattr(self.tasks, "__len__")
        if self.max_prompts is None and not finite:
            raise ValueError("Evaluate: the evaluation tasks are a stream without end: set max_prompts")
        samples = {}  # prompt -> the first sample that holds it
        for sample in self.tasks(self.seed):
            samples.setdefault(prompt_key(sample) if "messages" in sample else repr(sample), sample)
            if not finite and len(samples) >= self.max_prompts:
                break
        if not samples:
            raise ValueError("Evaluate: the evaluation tasks yielded no samples")
        return list(samples.values())

    def select(self, train_tasks, fitting: bool = True) -> None:
        """Settle the held-out prompts against the training tasks (``overlap``, see the module docstring; only a
        ``data.Tasks`` can tell), then keep the first ``max_prompts``; outside a fit (``molt eval``) training gives
        nothing up, so the set is the one a fit would evaluate. Tasks that follow the run's (``held_out_of``: Harbor
        tasks that name no folders) are first replaced by the held-out part of the run's own."""
        follow = getattr(self.tasks, "held_out_of", None)
        if follow is not None and (tasks := follow(train_tasks)) is not self.tasks:
            log.warning("evaluation: on the held-out tasks of the run's own folders (%d)", len(tasks))
            self.tasks = tasks
            self.samples = self.held_out()
        chats = "messages" in self.samples[0]
        if self.overlap == "drop_from_eval" and callable(getattr(train_tasks, "keys", None)) and chats:
            seen = train_tasks.keys()
            kept = [s for s in self.samples if prompt_key(s) not in seen]
            if not kept:
                raise ValueError("Evaluate: every held-out prompt also occurs in the training data: evaluate on "
                                 "another file, split or generator seed (reasoning-gym seeds item i with seed + i: "
                                 "seeds closer than the sizes share items)")
            if len(kept) < len(self.samples):
                log.warning("evaluation: %d of %d held-out prompts also occur in the training data and are dropped",
                            len(self.samples) - len(kept), len(self.samples))
            self.dropped_seen += len(self.samples) - len(kept)
            self.samples = kept
        self.samples = self.samples[: self.max_prompts]
        if self.overlap == "drop_from_training" and fitting and callable(getattr(train_tasks, "exclude", None)) \
                and chats:
            removed = train_tasks.exclude({prompt_key(s) for s in self.samples})
            self.excluded_from_training += removed
            if removed:
                log.warning("evaluation: %d training rows hold a held-out prompt and are left out of training",
                            removed)

    # ----- hooks -----
    def on_fit_start(self, trainer, pl_module) -> None:
        self._started, self._due, self._round = False, False, None
        self.select(pl_module.source.tasks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._started:
            self._started = True
            if self.at_start:
                self._finish(trainer, self._start(trainer, pl_module))
            return
        self._collect(trainer)
        # a due round starts once none is running (rank 0 knows; every rank must agree: keep_best saves on all)
        if self._due and parallel.broadcast(self._round is None, trainer):
            self._round = self._start(trainer, pl_module, self._candidate(trainer, pl_module))
            self._due = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._collect(trainer)
        if self.every_n_steps and pl_module.policy_version % self.every_n_steps == 0:
            self._due = True  # started at the next batch (WeightSync pushes this version after this hook)

    def _collect(self, trainer, wait: bool = False) -> None:
        """Log the round in flight if it has ended (``wait``: once it has)."""
        if self._round is not None and (wait or self._round[0] is None or self._round[0].done()):
            self._finish(trainer, self._round)
            self._round = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._collect(trainer, wait=True)
        if self.at_end and pl_module._started:
            pl_module.weights.settle()  # the last step's weights serve
            pl_module.source.stop()  # rollouts no longer needed: the engine is the evaluation's
            self._finish(trainer, self._start(trainer, pl_module))

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._round is not None and self._round[0] is not None:
            self._round[0].cancel()
            self._round = None

    # ----- rounds -----
    def _start(self, trainer, pl_module, candidate: str | None = None):
        """A round of the version the engine serves once the load in flight (if any) has ended."""
        version = pl_module.policy_version
        if trainer.global_rank != 0:
            return None, trainer.global_step, version, candidate
        pending = pl_module.weights.pending

        async def round_():
            if pending is not None:  # the weights this round measures are still loading
                await asyncio.wrap_future(pending)
            return await self.run(pl_module.sessions, pl_module.source.agent, pl_module.rollout)

        future = asyncio.run_coroutine_threadsafe(round_(), pl_module.engine.loop)
        return future, trainer.global_step, version, candidate

    async def run(self, sessions, agent: Callable, rollout, done: Callable[[], None] | None = None
                  ) -> tuple[list[evaluation.Outcome], float]:
        """One round on ``sessions``' engine (run on its loop): the outcomes and the seconds it took; ``agent`` is
        the run's (unless this callback names its own), ``rollout`` the run's ``config.Rollout``; ``done()`` after
        each agent run."""
        t0 = time.perf_counter()
        outcomes = await evaluation.run_round(
            self.samples, self.agent or agent, sessions, k=self.k,
            temperature=rollout.temperature if self.temperature is None else self.temperature, success=self.success,
            seed=self.seed, concurrency=self.concurrency, timeout_s=rollout.agent_timeout_s, done=done)
        return outcomes, time.perf_counter() - t0

    def _finish(self, trainer, round_) -> None:
        future, step, version, candidate = round_
        if future is None:  # another rank: rank 0 evaluates
            return
        outcomes, seconds = future.result()
        summary = evaluation.summarize(outcomes, self.k)
        metrics = {f"eval/{source}/{name}": value for source, m in summary.items() for name, value in m.items()}
        metrics.update({"eval/version": float(version), "eval/seconds": seconds,
                        "eval/dropped_seen": float(self.dropped_seen),
                        "eval/excluded_from_training": float(self.excluded_from_training)})
        if trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=step)
            if trainer.logger.log_dir:
                evaluation.dump(os.path.join(trainer.logger.log_dir, "eval.jsonl"), {
                    "step": step, "version": version, "seconds": seconds, "k": self.k, "metrics": summary,
                    "per_prompt": evaluation.per_prompt_rewards(outcomes)})
        log.info("evaluation of version %d (step %d, %.1f s):\n%s", version, step, seconds,
                 evaluation.report(summary, self.k))
        self.finished = [*self.finished[-3:], {  # for the run's record (callbacks.trace), the last few rounds
            "step": step, "version": version, "seconds": seconds, "end": time.time(), "metrics": summary,
            "trajectories": [o.traj for o in outcomes[:16] if o.traj is not None]}]
        if candidate is not None:
            self._keep(metrics, candidate)

    # ----- keep the best -----
    def _candidate(self, trainer, pl_module) -> str | None:
        if self.keep_best is None:
            return None
        logged = trainer.logger is not None and trainer.logger.log_dir
        folder = os.path.join(trainer.logger.log_dir if logged else trainer.default_root_dir, "checkpoints")
        path = os.path.join(folder, f"eval-candidate-v{pl_module.policy_version}.ckpt")
        trainer.save_checkpoint(path)  # every rank (a sharded checkpoint is written by all)
        return path

    def _keep(self, metrics: dict, candidate: str) -> None:
        if self.keep_best not in metrics:
            raise ValueError(f"Evaluate: keep_best {self.keep_best!r} is not among the logged metrics "
                             f"{sorted(metrics)}")
        value = metrics[self.keep_best]
        better = self._best is None or (value > self._best if self.mode == "max" else value < self._best)
        if better:
            self._best = value
            best = os.path.join(os.path.dirname(candidate), "best.ckpt")
            _remove(best)
            os.replace(candidate, best)
            log.info("evaluation: best.ckpt now holds the weights with %s = %.4f", self.keep_best, value)
        else:
            _remove(candidate)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
