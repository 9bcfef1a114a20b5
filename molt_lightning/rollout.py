"""The rollout source: agents run concurrently on a background event loop; the trainer takes one batch per step.

Producer (background thread, asyncio): draws prompts from the task stream and runs a *group* of ``group_size``
agent programs per prompt against the engine. Consumer (trainer thread): ``next_batch`` blocks until
``prompts_per_step`` groups are complete and returns them.

Staleness, bounded two ways (after AReaL's admission control, with a hard check behind it):
- *Admission*: a new group starts only while ``outstanding < (engine_version - consumed_batches + max_lag + 1) * P``
  (outstanding = running or buffered groups, P = prompts per step). If groups were consumed in the order they
  started, every group's oldest token would be at most ``max_lag`` versions old when trained on. With ``max_lag=0``
  this is exactly synchronous: the groups of step s start only once the engine holds version s.
- *Check at consumption*: groups complete out of order and the consumer takes the oldest complete ones first, so a
  straggler can be overtaken. A group whose oldest token is more than ``max_lag`` versions behind the trainer is
  dropped (counted, logged) and its prompt is queued again, so no prompt is lost. We chose drop-and-retry over
  waiting for stragglers: waiting blocks the trainer on the slowest agent, which is what asynchrony is for.
- *While the trainer waits* for a batch, the budget above already admits the next batch's groups, which then share
  the engine with the batch being waited for. That fills the idle tail of a batch on an engine whose step costs
  about the same for more sequences (a GPU). On an engine whose cost grows with every sequence (vLLM on one CPU
  core) it only delays the awaited batch, and the engine then idles through the next training step: with
  ``admit_ahead=False`` nothing beyond the awaited batch starts until the trainer takes it (SmolLM2 recipe: 8.7 ->
  7.4 s/step; the tiny default: no change; ``benchmarks/results/smollm2_admission_cpu2.md``).

Agents run on a background thread of the trainer's process. Python hands the interpreter lock between threads every
5 ms, and a trainer thread that releases it around every torch op waits up to that long each time a busy agent
thread holds it: ``switch_interval_ms`` (``sys.setswitchinterval`` from ``begin`` to ``stop``) shortens it. Measured:
within run-to-run noise on the SmolLM2 recipe (7.4 -> 7.1 s/step with ``admit_ahead=False``), ~5% slower on the tiny
default (more switches); off unless set.

Failed samples (agent raised, timed out, returned a non-finite reward) are counted, logged and never trained on; the
rest of their group still is. A group with no usable sample is dropped, counted, and its prompt is not retried.
Each kind of failure is logged a few times, then at every power of ten (the counts are exact either way).

The failure breaker: when more than ``max_failure_rate`` of the last ``failure_window`` agent runs failed, the
source stops admitting groups and the trainer's next wait raises ``RolloutFailures`` with the most frequent
reasons: a recipe that makes every agent fail (a context too short, a broken tool) stops within one window instead
of cycling through the task stream forever. ``should_stop`` (the module passes "SIGTERM received") ends a wait for
rollouts within a second, raising ``RolloutStopped``.

Sampling is seeded per request: turn ``k`` of member ``j`` of prompt ``i`` asks for its own seed, derived from
(``task_seed``, ``i``, ``j``, ``k``), so what a prompt's agents sample does not depend on which requests the engine
batched together. With the torch engine and ``max_lag=0`` a run is then reproducible, including one resumed from a
checkpoint (vLLM ignores the seeds: see ``engines.vllm_engine``).

Agents written with the stock OpenAI client: each source serves a loopback OpenAI-compatible endpoint on its event
loop (``molt_lightning.endpoint``); every agent run gets its own API key for it (``client.api_key``, next to
``client.base_url``), which ties its requests to its trajectory.

Dynamic sampling (DAPO): an optional ``group_filter(rewards) -> keep?`` sees every completed group's usable rewards;
a rejected group is dropped and counted (``dropped_filtered_groups``/``_samples``), its prompt is done, and its
admission slot opens for a new prompt, so batches are refilled with groups that pass. After ``FILTER_PATIENCE``
batches' worth of rejected groups in a row the source fails loudly (the task is solved or unsolvable for the policy).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import os
import re
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

from .chat import ChatTemplate
from .client import AgentClient, AgentResult
from .endpoint import Endpoint
from .engines.base import Adapter, RolloutEngine
from .trajectory import Status, Trajectory
from .vision import load_processor

log = logging.getLogger("molt_lightning.rollout")
Group = list[Trajectory]
FILTER_PATIENCE = 20  # batches' worth of consecutively rejected groups before dynamic sampling gives up
LOGGED_PER_KIND = 5  # failures of one kind logged in full; after that only at every power of ten


class RolloutFailures(RuntimeError):
    """The failure breaker tripped: too many agent runs failed."""


class RolloutStopped(RuntimeError):
    """The run was asked to stop (SIGTERM) while the trainer waited for rollouts."""


class RolloutSource:
    def __init__(
        self,
        agent: Callable[..., Any],
        tasks: Callable[..., Iterator[dict]],
        group_size: int = 8,
        prompts_per_step: int = 8,
        max_lag: int = 1,
        temperature: float = 1.0,
        max_context: int = 1024,
        timeout_s: float = 300.0,
        task_seed: int = 0,
        group_filter: Callable[[list[float]], bool] | None = None,
        max_failure_rate: float = 0.5,
        failure_window: int | None = None,
        admit_ahead: bool = True,
        switch_interval_ms: float | None = None,
    ):
        for name, value, least in (("group_size", group_size, 1), ("prompts_per_step", prompts_per_step, 1),
                                   ("max_lag", max_lag, 0)):
            if value < least:
                raise ValueError(f"model.{name} must be >= {least}, got {value}")
        if not 0 < max_failure_rate <= 1:
            raise ValueError(f"max_failure_rate must be in (0, 1] (1 turns the breaker off), got {max_failure_rate}")
        if switch_interval_ms is not None and switch_interval_ms <= 0:
            raise ValueError(f"model.switch_interval_ms must be > 0 (or null: Python's own), got {switch_interval_ms}")
        if temperature <= 0:
            raise ValueError("temperature must be > 0 for RL (greedy sampling has no logprobs to correct against)")
        self.agent, self.tasks, self.G, self.P = agent, tasks, group_size, prompts_per_step
        self.max_lag, self.temperature, self.max_context = max_lag, temperature, max_context
        self.timeout_s, self.task_seed, self.group_filter = timeout_s, task_seed, group_filter
        self._rejected_in_a_row = 0
        self._filtered_reward = 0.0  # reward sum of the samples dynamic sampling dropped since the last batch
        self.engine: RolloutEngine | None = None
        self.endpoint: Endpoint | None = None
        self.counts: Counter = Counter()  # cumulative counters, reported by the monitor
        self._reported: Counter = Counter()
        self.consumed_batches = 0
        self._done_prompts: set[int] = set()  # prompts trained on or given up
        self._next_prompt = 0  # every prompt before this one is done
        self._retry: list[tuple[int, dict]] = []
        self._ready: list[tuple[int, Group]] = []  # complete groups, keyed by the order they started
        self._running = 0
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._loading = None
        self.max_failure_rate = max_failure_rate
        self.failure_window = failure_window or max(64, 2 * group_size * prompts_per_step)
        self._recent: deque[str | None] = deque(maxlen=self.failure_window)  # None: ok, else the failure kind
        self._failure_kinds: Counter = Counter()
        self.should_stop: Callable[[], bool] = lambda: False
        self.admit_ahead, self._trainer_waits = admit_ahead, False
        self.switch_interval_ms = switch_interval_ms
        self._switch_s: float | None = None  # the switch interval before begin, restored by stop

    # ----- lifecycle (trainer thread) -----
    def start(self, engine: RolloutEngine, model_path: str, tokenizer, adapter: Adapter | None = None) -> None:
        """Launch (or join) the engine, serving the LoRA ``adapter`` if given; agents will run on its event loop."""
        self.engine = engine
        self.template = None
        if getattr(tokenizer, "chat_template", None):
            processor = load_processor(model_path)  # a vision-language policy's (expands images), else None
            if processor is not None and not engine.accepts_images:
                raise ValueError(f"{model_path} is a vision-language policy but {type(engine).__name__} cannot take "
                                 "images: use molt_lightning.engines.TorchEngine (vLLM's vision models need "
                                 "torchvision, which PyPI builds for CUDA only)")
            self.template = ChatTemplate(tokenizer, processor)
        engine.launch(model_path, adapter)
        self._loop = engine.loop
        self.endpoint = None
        if self.template is not None:  # the loopback OpenAI-compatible endpoint, for agents using the openai client
            self.endpoint = Endpoint(["policy", os.path.basename(model_path.rstrip("/")), model_path], self.temperature)
            self.call(self.endpoint.start(), timeout=60)
        self._wake = self.call(_make_event())
        self._tasks: set[asyncio.Task] = set()
        self._producer = None
        self._loading = None  # the engine's weight load in flight (a concurrent future), if any

    def begin(self) -> None:
        """Start producing rollouts (after the engine holds the trainer's weights)."""
        self.settle_weights()
        if self.switch_interval_ms is not None and self._switch_s is None:
            self._switch_s = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_ms / 1000)
        if self._producer is None:
            self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self._loop)

    def call(self, coro, timeout: float | None = None):
        return self.engine.call(coro, timeout)

    def stop(self) -> None:
        """Cancel this source's producer and agents, then release the engine."""
        if self._loop is None:
            return
        self._stopping = True
        if self._switch_s is not None:
            sys.setswitchinterval(self._switch_s)
            self._switch_s = None

        async def _cancel():
            tasks = [t for t in self._tasks if not t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            if self._producer is not None:
                self._producer.cancel()
                self._producer = None
            self.call(_cancel(), timeout=60)
            try:  # a weight load in flight finishes (or is given up on) before the engine is released
                self.settle_weights(timeout=15)
            except Exception as e:  # stopping anyway: the next start pushes the weights again
                log.warning("a weight load was still pending or failed while stopping: %r", e)
            if self.endpoint is not None:
                self.call(self.endpoint.stop(), timeout=30)
        finally:
            self._loop = None
            self._stopping = False
            self.engine.release()

    def stage_weights(self, bucket) -> None:
        self.settle_weights()  # the previous load is done (its files read, its version serving) before the next
        self.call(self.engine.stage_weights(bucket))

    def commit_weights(self, version: int) -> None:
        """Have the engine load the staged weights as ``version``, and return at once: the trainer goes on with its
        next step while the engine pauses, loads and resumes (tokens stay tagged exactly: the engine switches versions
        between tokens). One load is in flight at most; the next push, a batch that needs this version, ``begin`` and
        ``stop`` wait for it, and its error, if any, is raised there."""
        self._loading = asyncio.run_coroutine_threadsafe(self.engine.commit_weights(version), self._loop)
        self._loading.add_done_callback(lambda _: self._notify())

    def settle_weights(self, timeout: float | None = None) -> None:
        """Wait for the weight load in flight, if any."""
        loading, self._loading = self._loading, None
        if loading is not None:
            loading.result(timeout)

    def update_weights(self, state, version: int) -> None:
        self.stage_weights(state)
        self.commit_weights(version)
        self.settle_weights()

    # ----- consumer (trainer thread) -----
    def next_batch(self, trainer_version: int) -> list[Trajectory]:
        """Block until ``prompts_per_step`` usable groups no older than ``max_lag`` are ready; return their samples."""
        if self.engine.version < trainer_version - self.max_lag:
            self.settle_weights()  # the version this batch needs may be loading
        if self.engine.version < trainer_version - self.max_lag:  # only the trainer pushes: waiting = forever
            raise RuntimeError(
                f"the engine serves policy version {self.engine.version} but the trainer is at {trainer_version}: "
                f"with max_lag={self.max_lag} nothing it generates could be trained on. Push weights at least every "
                f"max_lag + 1 steps (the WeightSync callback does, unless it was removed or replaced)."
            )
        with self._cond:
            self._trainer_waits = True  # admit_ahead=False: admission closes beyond this batch meanwhile
            try:
                self._wait_for_batch(trainer_version)
            finally:
                self._trainer_waits = False
            self._ready.sort(key=lambda x: x[0])  # oldest first
            taken, self._ready = self._ready[: self.P], self._ready[self.P:]
            for _, group in taken:
                self._mark_done(group[0].sample_id)
            self.consumed_batches += 1
        self._notify()
        return [t for _, group in taken for t in group]

    def _wait_for_batch(self, trainer_version: int) -> None:
        """(Holding ``_cond``.) Until ``P`` usable groups are ready; stale ones are dropped meanwhile."""
        while True:
            if isinstance(self._error, RolloutFailures):
                raise self._error
            if self._error is not None:
                raise RuntimeError("the rollout producer died") from self._error
            self.engine.check()  # an engine gone for good (a remote server down too long) fails the wait
            if self.should_stop():
                raise RolloutStopped(f"stopped while waiting for rollouts ({len(self._ready)} of {self.P} groups "
                                     "ready); to resume, run the same command with --ckpt_path last (the "
                                     "checkpoint callback's last.ckpt) or a checkpoint file")
            for item in [x for x in self._ready if self._too_old(x[1], trainer_version)]:
                self._ready.remove(item)
                self._drop_stale(item[1], trainer_version)
            if len(self._ready) >= self.P:
                break
            self._cond.wait(timeout=1.0)

    def take_stats(self) -> dict[str, float]:
        """Counters since the previous call (``new/...``), their running totals, the reward sum of the samples the
        group filter dropped since the previous call (``filtered_reward_sum``), and the engine's idle time."""
        with self._cond:
            delta = self.counts - self._reported
            self._reported = Counter(self.counts)
            stats = {f"new/{k}": float(v) for k, v in delta.items()}
            stats.update({f"total/{k}": float(v) for k, v in self.counts.items()})
            stats.update(buffered_groups=float(len(self._ready)), running_groups=float(self._running),
                         filtered_reward_sum=self._filtered_reward)
            self._filtered_reward = 0.0
        stats.update(self.engine.take_stats())
        return stats

    def _too_old(self, group: Group, trainer_version: int) -> bool:
        return trainer_version - min(t.oldest_version for t in group) > self.max_lag

    def _drop_stale(self, group: Group, trainer_version: int) -> None:
        oldest = min(t.oldest_version for t in group)
        self.counts["dropped_stale_groups"] += 1
        self.counts["dropped_stale_samples"] += len(group)
        log.warning("dropped a group of sample %d: oldest token version %d, trainer %d, max_lag %d "
                    "(prompt queued again)", group[0].sample_id, oldest, trainer_version, self.max_lag)
        self._retry.append((group[0].sample_id, group[0].info["sample"]))

    # ----- checkpoint state -----
    def state_dict(self) -> dict:
        with self._cond:
            beyond = sorted(i for i in self._done_prompts if i >= self._next_prompt)
            return {"next_prompt": self._next_prompt, "done_beyond": beyond, "counts": dict(self.counts),
                    "consumed_batches": self.consumed_batches}

    def load_state_dict(self, state: dict) -> None:
        self._next_prompt = state["next_prompt"]
        self._done_prompts = set(state["done_beyond"])
        self.counts = Counter(state["counts"])
        self._reported = Counter(self.counts)
        self.consumed_batches = state["consumed_batches"]

    # ----- producer (rollout loop) -----
    def _mark_done(self, sample_id: int) -> None:
        self._done_prompts.add(sample_id)
        while self._next_prompt in self._done_prompts:
            self._done_prompts.discard(self._next_prompt)
            self._next_prompt += 1

    def _admit(self) -> bool:
        budget = (self.engine.version - self.consumed_batches + self.max_lag + 1) * self.P
        if self._trainer_waits and not self.admit_ahead:
            budget = min(budget, self.P)  # only the batch the trainer waits for runs
        return self._running + len(self._ready) < budget

    def _prompts(self) -> Iterator[tuple[int, dict]]:
        """(index, sample) pairs not yet done; a finite task stream is repeated with the next seed."""
        skip, i = set(self._done_prompts), 0
        for epoch in itertools.count():
            before = i
            for sample in self.tasks(self.task_seed + epoch):
                if i >= self._next_prompt and i not in skip:
                    yield i, sample
                i += 1
            if i == before:
                raise ValueError(f"the task stream {self.tasks!r} yielded no samples")

    async def _produce(self) -> None:
        try:
            prompts, order = self._prompts(), 0
            while self._error is None:
                while not self._admit():
                    self._wake.clear()
                    if not self._admit():
                        await self._wake.wait()
                sample_id, sample = self._retry.pop(0) if self._retry else next(prompts)
                self._running += 1
                task = asyncio.get_running_loop().create_task(self._run_group(order, sample_id, sample))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                log.debug("admitted group %d (sample %d) at engine version %d, %d batches consumed",
                          order, sample_id, self.engine.version, self.consumed_batches)
                order += 1
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaces in next_batch instead of hanging the trainer
            log.exception("rollout producer failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _notify(self) -> None:
        """Wake the producer (from any thread): admission may have opened."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run_group(self, order: int, sample_id: int, sample: dict) -> None:
        group = await asyncio.gather(*[self._run_agent(sample_id, order, i, sample) for i in range(self.G)])
        usable = [t for t in group if t.status != Status.FAILED and t.num_policy_tokens > 0]
        with self._cond:
            self._running -= 1
            for t in group:
                self.counts["samples"] += 1
                self.counts[f"status_{t.status.value}"] += 1
                self._recent.append(_kind(t.reason) if t.status == Status.FAILED else None)
            self._breaker()
            if not usable:
                self.counts["dropped_empty_groups"] += 1
                self._mark_done(sample_id)
            elif self.group_filter is not None and not self.group_filter([t.reward for t in usable]):
                self._reject(sample_id, usable)
            else:
                self._ready.append((order, usable))
                self._rejected_in_a_row = 0
            self._cond.notify_all()
        self._wake.set()

    def _count_agent_event(self, name: str, n: int = 1) -> None:
        with self._cond:
            self.counts[f"agent/{name}"] += n

    def _breaker(self) -> None:
        """Under ``self._cond``: trip when the failed share of the last ``failure_window`` runs passes the limit."""
        failed = [k for k in self._recent if k is not None]
        if len(self._recent) < self.failure_window or len(failed) <= self.max_failure_rate * self.failure_window:
            return
        if self._error is None:
            top = "; ".join(f"{n}x {k}" for k, n in Counter(failed).most_common(3))
            self._error = RolloutFailures(
                f"{len(failed)} of the last {self.failure_window} agent runs failed (more than "
                f"{self.max_failure_rate:.0%}), so the run stops instead of cycling through the task stream. Most "
                f"frequent reasons: {top}. Fix the cause (e.g. raise model.max_context, fix the agent or its tool), "
                "or set model.max_failure_rate (1 turns this check off).")
            log.error("%s", self._error)

    def _reject(self, sample_id: int, usable: Group) -> None:
        """Dynamic sampling dropped this group (under ``self._cond``); its slot is refilled by a new prompt."""
        self.counts["dropped_filtered_groups"] += 1
        self.counts["dropped_filtered_samples"] += len(usable)
        self._filtered_reward += sum(t.reward for t in usable)
        self._mark_done(sample_id)
        self._rejected_in_a_row += 1
        if self._rejected_in_a_row >= FILTER_PATIENCE * self.P:
            self._error = RuntimeError(
                f"the group filter rejected {self._rejected_in_a_row} groups in a row (e.g. every reward equal): "
                "the task is solved or unsolvable for this policy; turn the filter off (algo.group_filter: none)")

    async def _run_agent(self, sample_id: int, order: int, index: int, sample: dict) -> Trajectory:
        traj = Trajectory(sample_id=sample_id, group_id=order, info={"sample": sample, "index": index})
        client = AgentClient(self.engine, traj, self.template, self.temperature, self.max_context,
                             seed=request_seed(self.task_seed, sample_id, index), counter=self._count_agent_event)
        if self.endpoint is not None:
            self.endpoint.register(client, f"{sample_id}-{index}")
        try:
            result = await asyncio.wait_for(self.agent(client, sample), self.timeout_s)
        except asyncio.TimeoutError:
            return self._failed(traj, f"timed out after {self.timeout_s}s")
        except Exception as e:
            return self._failed(traj, f"agent raised {type(e).__name__}: {e}")
        finally:
            if self.endpoint is not None:
                self.endpoint.unregister(client)
        reward = result.reward if isinstance(result, AgentResult) else result
        try:
            traj.reward = float(reward)
        except (TypeError, ValueError):
            return self._failed(traj, f"agent returned {reward!r}, not a float or AgentResult")
        if not math.isfinite(traj.reward):
            return self._failed(traj, f"non-finite reward {traj.reward}")
        if isinstance(result, AgentResult):
            traj.info.update(result.info)
        return traj

    def _failed(self, traj: Trajectory, reason: str) -> Trajectory:
        kind = _kind(reason)
        self._failure_kinds[kind] += 1
        n = self._failure_kinds[kind]
        if not self._stopping and (n <= LOGGED_PER_KIND or math.log10(n).is_integer()):
            log.warning("sample %d failed and will not be trained on (%d so far of this kind): %s",
                        traj.sample_id, n, reason)
        return traj.fail(reason)


def request_seed(task_seed: int, sample_id: int, member: int) -> int:
    """The base seed of one agent run; its k-th request samples with ``base + k`` (see the module docstring)."""
    digest = hashlib.blake2b(f"{task_seed}:{sample_id}:{member}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # leaves room for + k below 2**63


def _kind(reason: str | None) -> str:
    """A failure reason with its numbers blanked, to count failures of one kind together."""
    return re.sub(r"\d+(\.\d+)?", "N", reason or "unknown")[:160]


async def _make_event() -> asyncio.Event:
    return asyncio.Event()  # bound to the rollout loop
