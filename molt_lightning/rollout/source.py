"""The rollout source: agents run concurrently on the engine's event loop; the trainer takes one batch per step.

Producer (``_produce``, on the engine's loop): starts a *group* of ``group_size`` agent runs per prompt, as long as
admission allows (``admission.Admission``: the lag budget, the staleness rule and the prompt ledger live there).
Consumer (``next_batch``, the trainer's thread): blocks until ``prompts_per_step`` usable groups no older than
``max_lag`` are complete, drops the stale ones meanwhile (their prompts run again) and returns the oldest.

Failed samples (the agent raised, timed out, returned a non-finite reward) are counted, logged and never trained on;
the rest of their group still is. A group with no usable sample is dropped, counted, and its prompt is not retried.
Each kind of failure is logged a few times, then at every power of ten (the counts are exact either way).
The failure breaker: when more than ``max_failure_rate`` of the last ``failure_window`` agent runs failed, the
source stops admitting groups and the trainer's next wait raises ``RolloutFailures`` with the most frequent
reasons (each with a real one, numbers kept) and a fix fitting the first (a failing judge: its address), so a
recipe that makes every agent fail (a context too short, a broken tool, a judge's wrong key) stops within one window
instead of cycling through the task stream. ``should_stop`` (the module passes "SIGTERM received") ends a wait for
rollouts within a second, raising ``RolloutStopped``.

Dynamic sampling (DAPO): an optional ``group_filter(rewards) -> keep?`` sees every completed group's usable rewards;
a rejected group is dropped and counted, its prompt is done, and its admission slot opens for a new prompt, so
batches are refilled with groups that pass. After ``FILTER_PATIENCE`` batches' worth of rejected groups in a row the
source fails loudly (the task is solved or unsolvable for the policy). A teacher on an engine (``teacher``,
distillation) scores each group's usable trajectories as it completes (``rollout.teacher``); a trajectory it cannot
score is a failed sample.

What happened is counted in one record, ``RolloutCounts``, written here under the lock and read by the callbacks as a
copy (``counts_now``); the last ``OUTCASTS`` samples not trained on (failed, stale, filtered) wait with their cause in
``outcasts`` for a callback to take (``take_outcasts``: the run's record, ``callbacks.trace``).

Sampling is seeded per request: turn ``k`` of member ``j`` of prompt ``i`` asks for its own seed, derived from
(``task_seed``, ``i``, ``j``) plus ``k``, so what a prompt's agents sample does not depend on which requests the engine
batched together. With the torch engine and ``max_lag=0`` a run is then reproducible, including one resumed from a
checkpoint (vLLM ignores the seeds: see ``engines.vllm.engine``).

Agents run on the engine's loop, a background thread of the trainer's process. Python hands the interpreter lock
between threads every 5 ms, and a trainer thread that releases it around every torch op may wait that long each time
a busy agent thread holds it: ``switch_interval_ms`` (``sys.setswitchinterval`` from ``start`` to ``stop``) shortens
it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import re
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .admission import Admission
from .agent_run import request_seed, run_agent
from ..agents.sessions import AgentSessions
from ..config import Rollout
from .teacher import scored
from ..engines.auxiliary import Auxiliary
from ..trajectory import Status, Trajectory, Truncation

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 60  # for the agent runs to end once cancelled (an agent that swallows its cancellation never does)
Group = list[Trajectory]
FILTER_PATIENCE = 20  # batches' worth of consecutively rejected groups before dynamic sampling gives up
LOGGED_PER_KIND = 5  # failures of one kind logged in full; after that only at every power of ten
OUTCASTS = 256  # samples not trained on kept for ``take_outcasts`` (the oldest go first)


class RolloutFailures(RuntimeError):
    """The failure breaker tripped: too many agent runs failed."""


class RolloutStopped(RuntimeError):
    """The run was asked to stop (SIGTERM) while the trainer waited for rollouts."""


@dataclass
class RolloutCounts:
    """What the rollout side did so far (cumulative; in checkpoints)."""

    finished: int = 0  # agent runs that ended (ok, truncated or failed)
    truncated: int = 0  # cut short (any cause: ``truncated_by``); trained on like an ok one
    failed: int = 0  # the agent raised, timed out or returned a bad reward; never trained on
    trained: int = 0  # samples handed to the trainer in batches
    dropped_stale_groups: int = 0  # too old when the trainer came to them (their prompts ran again)
    dropped_stale_samples: int = 0
    dropped_empty_groups: int = 0  # groups with no usable sample (their failures are counted as failed)
    dropped_filtered_groups: int = 0  # rejected by the group filter (dynamic sampling)
    dropped_filtered_samples: int = 0
    filtered_reward_sum: float = 0.0  # the reward of those samples (the step's reward over every usable sample)
    agent: dict[str, int] = field(default_factory=dict)  # what agents counted (client.count): tool errors, ...
    truncated_by: dict[str, int] = field(default_factory=lambda: {c.value: 0 for c in Truncation})  # per cause
    buffered_groups: int = 0  # complete, not yet trained on (a gauge)


class RolloutSource:
    def __init__(self, agent: Callable[..., Any], tasks: Callable[..., Iterator[dict]], rollout: Rollout,
                 group_filter: Callable[[list[float]], bool] | None = None, teacher: Auxiliary | None = None):
        rollout.check()
        self.agent, self.tasks, self.rollout, self.group_filter = agent, tasks, rollout, group_filter
        self.teacher = teacher  # scores every usable trajectory's policy tokens (distillation); started with the source
        if teacher is not None:  # an engine that cannot score at the rollout temperature: said before anything starts
            teacher.engine.check_score(rollout.temperature)
        self.admission = Admission(rollout.prompts_per_step, rollout.max_lag, rollout.admit_ahead)
        self.counts = RolloutCounts()
        self.failure_window = max(64, 2 * rollout.group_size * rollout.prompts_per_step)  # the breaker's agent runs
        self.should_stop: Callable[[], bool] = lambda: False
        self.engine = self.sessions = self._loop = self._producer = None
        self._wake = asyncio.Event()  # set from any thread through the loop; bound to the loop at its first wait
        self._cond = threading.Condition()  # guards everything below, the admission and the counts
        self._ready: list[tuple[int, Group]] = []  # complete groups, keyed by the order they started
        self._running, self._trainer_waits = 0, False  # groups started, not complete; the trainer waits for a batch
        self._error, self._rejected_in_a_row = None, 0  # _error: what stopped the producer
        self._recent: deque[str | None] = deque(maxlen=self.failure_window)  # None: ok, else why it failed
        self._failure_kinds, self._tasks = Counter(), set()  # failures per kind; the running groups' tasks
        self._stopping, self._switch_s = False, None
        self.outcasts: deque[tuple[str, Trajectory]] = deque(maxlen=OUTCASTS)  # (cause, sample) not trained on

    # ----- lifecycle (trainer thread) -----
    def start(self, sessions: AgentSessions) -> None:
        """Start producing on the engine's loop (the engine holds the trainer's weights by now)."""
        self.engine, self.sessions, self._loop = sessions.engine, sessions, sessions.engine.loop
        if self.teacher is not None:
            self.teacher.start()
        if self.rollout.switch_interval_ms is not None:
            self._switch_s = sys.getswitchinterval()
            sys.setswitchinterval(self.rollout.switch_interval_ms / 1000)
        self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self._loop)

    def stop(self) -> None:
        """Cancel the producer and every agent run (their groups are not trained on)."""
        if self._producer is None:
            return
        self._stopping = True
        if self._switch_s is not None:
            sys.setswitchinterval(self._switch_s)
            self._switch_s = None

        async def cancel():
            # the producer's cancellation reaches it on a later turn of the loop (a concurrent future's cancel): a
            # group it starts before then is cancelled in the next round, not left running past the stop
            self._producer.cancel()
            while tasks := [t for t in self._tasks if not t.done()]:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(STOP_TIMEOUT_S)
        except TimeoutError:
            log.error("the agent runs did not end within %d s of their cancellation; what each still awaits:\n%s",
                      STOP_TIMEOUT_S, self._stacks())
            raise
        finally:
            self._producer, self._stopping = None, False

    def _stacks(self) -> str:
        """Where the engine loop's thread is and what every pending task of the loop awaits (for a stop that hangs)."""
        import io
        import traceback

        out = io.StringIO()
        thread = getattr(self.engine, "_thread", None)
        frame = sys._current_frames().get(getattr(thread, "ident", None))
        if frame is not None:
            out.write("the engine loop's thread:\n" + "".join(traceback.format_stack(frame)))
        for task in asyncio.all_tasks(self._loop):
            task.print_stack(limit=8, file=out)
        return out.getvalue()

    def wake(self) -> None:
        """Wake the producer (from any thread): admission may have opened (a batch taken, a new engine version)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ----- consumer (trainer thread) -----
    def next_batch(self, trainer_version: int) -> list[Trajectory]:
        """Block until ``prompts_per_step`` usable groups no older than ``max_lag`` are ready; return their samples."""
        if self.admission.too_old(self.engine.version, trainer_version):  # only the trainer pushes: waiting = forever
            raise RuntimeError(
                f"the engine serves policy version {self.engine.version} but the trainer is at {trainer_version}: "
                f"with max_lag={self.rollout.max_lag} nothing it generates could be trained on. Push weights at "
                "least every max_lag + 1 steps (the WeightSync callback does, unless it was removed or replaced)."
            )
        with self._cond:
            self._trainer_waits = True  # admit_ahead=False: admission closes beyond this batch meanwhile
            try:
                self._wait_for_batch(trainer_version)
            finally:
                self._trainer_waits = False
            self._ready.sort(key=lambda x: x[0])  # oldest first
            n = self.rollout.prompts_per_step
            taken, self._ready = self._ready[:n], self._ready[n:]
            for _, group in taken:
                self.admission.mark_done(group[0].sample_id)
            self.admission.consumed += 1
            samples = [t for _, group in taken for t in group]
            self.counts.trained += len(samples)
        self.wake()
        return samples

    def _wait_for_batch(self, trainer_version: int) -> None:
        """(Holding ``_cond``.) Until ``prompts_per_step`` usable groups are ready; stale ones are dropped meanwhile."""
        while True:
            if isinstance(self._error, RolloutFailures):
                raise self._error
            if self._error is not None:
                raise RuntimeError("the rollout producer died") from self._error
            self.engine.check()  # an engine gone for good (a remote server down too long) fails the wait
            if self.should_stop():
                raise RolloutStopped(f"stopped while waiting for rollouts ({len(self._ready)} of "
                                     f"{self.rollout.prompts_per_step} groups ready); to resume, run the same command "
                                     "with --ckpt_path last (the checkpoint callback's last.ckpt) or a checkpoint file")
            stale = [(order, group) for order, group in self._ready
                     if self.admission.too_old(min(t.oldest_version for t in group), trainer_version)]
            for order, group in stale:
                self._ready.remove((order, group))
                self.counts.dropped_stale_groups += 1
                self.counts.dropped_stale_samples += len(group)
                self.outcasts.extend(("stale", t) for t in group)
                log.warning("dropped a group of sample %d: oldest token version %d, trainer %d, max_lag %d "
                            "(prompt queued again)", group[0].sample_id, min(t.oldest_version for t in group),
                            trainer_version, self.rollout.max_lag)
                self.admission.retry.append((group[0].sample_id, group[0].sample))
            if stale:
                self.wake()  # their slots are free: the producer starts their prompts again
            if len(self._ready) >= self.rollout.prompts_per_step:
                return
            self._cond.wait(timeout=1.0)

    def take_outcasts(self) -> list[tuple[str, Trajectory]]:
        """The samples not trained on since the last call (at most ``OUTCASTS``), with their cause."""
        with self._cond:
            taken, self.outcasts = list(self.outcasts), deque(maxlen=OUTCASTS)
            return taken

    def counts_now(self) -> RolloutCounts:
        """A copy of the counts, taken under the lock."""
        with self._cond:
            self.counts.buffered_groups = len(self._ready)
            return copy.deepcopy(self.counts)

    # ----- checkpoint state -----
    def state_dict(self) -> dict:
        with self._cond:
            return {**self.admission.state_dict(), "counts": copy.deepcopy(vars(self.counts))}

    def load_state_dict(self, state: dict) -> None:
        self.admission.load_state_dict(state)
        self.counts = RolloutCounts(**state["counts"])
        self.counts.truncated_by = {**RolloutCounts().truncated_by, **self.counts.truncated_by}  # a newer cause: 0

    # ----- producer (engine loop) -----
    async def _produce(self) -> None:
        try:
            prompts, order = self.admission.prompts(self.tasks, self.rollout.task_seed), 0
            while self._error is None and not self._stopping:
                while not self._may_admit():
                    self._wake.clear()
                    if not self._may_admit():
                        await self._wake.wait()
                with self._cond:  # a dropped stale group's prompt first, else the stream's next
                    retry = self.admission.retry.pop(0) if self.admission.retry else None
                prompt, sample = retry or next(prompts)
                with self._cond:
                    self._running += 1
                task = asyncio.get_running_loop().create_task(self._run_group(order, prompt, sample))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                order += 1
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaces in next_batch instead of hanging the trainer
            log.exception("rollout producer failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _may_admit(self) -> bool:
        with self._cond:
            return self.admission.may_admit(self.engine.version, self._running + len(self._ready),
                                            self._trainer_waits)

    async def _run_group(self, order: int, prompt: int, sample: dict) -> None:
        group = await asyncio.gather(*[self._run_agent(prompt, order, i, sample)
                                       for i in range(self.rollout.group_size)])
        if self.teacher is not None:
            group = await asyncio.gather(*[scored(self.teacher, t, self.rollout.temperature, self._failed)
                                           for t in group])
        usable = [t for t in group if t.status != Status.FAILED and t.num_policy_tokens > 0]
        with self._cond:
            self._running -= 1
            for t in group:
                self.counts.finished += 1
                self.counts.truncated += t.status == Status.TRUNCATED
                if t.status == Status.TRUNCATED and t.truncation is not None:
                    self.counts.truncated_by[t.truncation.value] += 1
                self.counts.failed += t.status == Status.FAILED
                self._recent.append((t.reason or "unknown") if t.status == Status.FAILED else None)
                if t.status == Status.FAILED:
                    self.outcasts.append(("failed", t))
            self._breaker()
            if not usable:
                self.counts.dropped_empty_groups += 1
                self.admission.mark_done(prompt)
            elif self.group_filter is not None and not self.group_filter([t.reward for t in usable]):
                self._reject(prompt, usable)
            else:
                self._ready.append((order, usable))
                self._rejected_in_a_row = 0
            self._cond.notify_all()
        self._wake.set()

    def _count_agent_event(self, name: str, n: int = 1) -> None:
        with self._cond:
            self.counts.agent[name] = self.counts.agent.get(name, 0) + n

    def _breaker(self) -> None:
        """Under ``self._cond``: trip when the failed share of the last ``failure_window`` runs passes the limit."""
        failed = [r for r in self._recent if r is not None]
        limit = self.rollout.max_failure_rate
        if len(self._recent) < self.failure_window or len(failed) <= limit * self.failure_window:
            return
        if self._error is None:
            kinds, example = Counter(map(_kind, failed)), {_kind(r): r for r in failed}  # the latest of each kind
            top = "; ".join(f"{n}x {k} (e.g. {_short(example[k])!r})" for k, n in kinds.most_common(3))
            first = kinds.most_common(1)[0][0]
            self._error = RolloutFailures(
                f"{len(failed)} of the last {self.failure_window} agent runs failed (more than {limit:.0%}), so the "
                f"run stops instead of cycling through the task stream. Most frequent reasons: {top}. Fix the cause "
                f"({_fix(first, example[first])}), or set model.rollout.max_failure_rate (1 turns this check off).")
            log.error("%s", self._error)

    def _reject(self, prompt: int, usable: Group) -> None:
        """Dynamic sampling dropped this group (under ``self._cond``); its slot is refilled by a new prompt."""
        self.counts.dropped_filtered_groups += 1
        self.counts.dropped_filtered_samples += len(usable)
        self.counts.filtered_reward_sum += sum(t.reward for t in usable)
        self.outcasts.extend(("filtered", t) for t in usable)
        self.admission.mark_done(prompt)
        self._rejected_in_a_row += 1
        if self._rejected_in_a_row >= FILTER_PATIENCE * self.rollout.prompts_per_step:
            self._error = RuntimeError(
                f"the group filter rejected {self._rejected_in_a_row} groups in a row (e.g. every reward equal): "
                "the task is solved or unsolvable for this policy; turn the filter off (algo.group_filter: none)")

    async def _run_agent(self, prompt: int, order: int, index: int, sample: dict) -> Trajectory:
        traj = Trajectory(sample_id=prompt, group_id=order, member=index, sample=sample, started=time.time())
        why = await run_agent(self.agent, self.sessions, traj, request_seed(self.rollout.task_seed, prompt, index),
                              self.rollout.agent_timeout_s, self._count_agent_event)
        traj.ended = time.time()
        return traj if why is None else self._failed(traj, why)

    def _failed(self, traj: Trajectory, reason: str) -> Trajectory:
        kind = _kind(reason)
        self._failure_kinds[kind] += 1
        n = self._failure_kinds[kind]
        if not self._stopping and (n <= LOGGED_PER_KIND or math.log10(n).is_integer()):
            log.warning("sample %d failed and will not be trained on (%d so far of this kind): %s",
                        traj.sample_id, n, reason)
        return traj.fail(reason)


def _kind(reason: str | None) -> str:
    """A failure reason with its numbers blanked, to count failures of one kind together (the breaker's message
    shows a real reason of each kind beside it: the status, the URL and the port are in there)."""
    return re.sub(r"\d+(\.\d+)?", "N", reason or "unknown")[:160]


def _short(reason: str, n: int = 300) -> str:
    return reason if len(reason) <= n else reason[:n] + "..."


def _fix(kind: str, example: str) -> str:
    """What to fix when ``kind`` (``example``: one of its reasons) is the most frequent failure."""
    if "JudgeFailed" not in kind:
        return "e.g. raise model.rollout.max_context, fix the agent or its tool"
    if re.search(r"judge (unparsable|out_of_range|no_reference)", kind):
        return "the judge answers without a verdict: check its verdict, template and max_tokens"
    url = re.search(r"https?://[^\s)]+", example)
    where = f"the judge at {url[0].rstrip(':,.')}" if url else "the judge"
    return f"{where} is what fails: check its url, its key (api_key_env), its served_model name and timeout_s"
