"""Admission: which groups may start, which may still be trained on, and which prompts are done. A pure, thread-free
record; the rollout source calls it under its own lock. Its state is the run's rollout position in a checkpoint.

Staleness, bounded two ways (after AReaL's admission control, with a hard check behind it):
- **The lag budget** (``may_admit``): a new group starts only while ``outstanding < (engine_version - consumed + max_lag
  + 1) * P`` (outstanding = running or buffered groups, P = prompts per step, consumed = batches the trainer took).
  If groups were consumed in the order they started, every group's oldest token would be at most ``max_lag``
  versions old when trained on. With ``max_lag=0`` this is exactly synchronous: the groups of step s start only once
  the engine holds version s. While the trainer waits for a batch the budget already admits later batches' groups,
  which then share the engine with the batch waited for; ``admit_ahead=False`` closes admission beyond that batch
  meanwhile (for an engine whose cost grows with every sequence, e.g. vLLM on one CPU core).
- **The staleness rule** (``too_old``): groups complete out of order and the trainer takes the oldest complete ones
  first, so a straggler can be overtaken. A group whose oldest token is more than ``max_lag`` versions behind the
  trainer is dropped and its prompt queued again (``retry``), so no prompt is lost. Drop-and-retry rather than
  waiting for stragglers: waiting blocks the trainer on the slowest agent, which is what asynchrony is for.

The prompt ledger: prompt ``i`` is the ``i``-th sample of the task stream (epoch ``e`` reads ``tasks(task_seed + e)``);
a prompt is *done* once trained on or given up. ``next_prompt`` is the first prompt not done, ``done_beyond`` the done
ones after it; both go into checkpoints (``state_dict``), so a resumed run regenerates exactly the prompts that were
started but not trained on, and repeats none.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class Admission:
    prompts_per_step: int
    max_lag: int
    admit_ahead: bool = True
    consumed: int = 0  # batches the trainer took
    next_prompt: int = 0  # every prompt before this one is done
    done_beyond: set[int] = field(default_factory=set)  # done prompts from next_prompt on
    retry: list[tuple[int, dict]] = field(default_factory=list)  # prompts of dropped stale groups, to run again

    def may_admit(self, engine_version: int, outstanding: int, trainer_waits: bool) -> bool:
        budget = (engine_version - self.consumed + self.max_lag + 1) * self.prompts_per_step
        if trainer_waits and not self.admit_ahead:
            budget = min(budget, self.prompts_per_step)  # only the batch the trainer waits for runs
        return outstanding < budget

    def too_old(self, oldest_version: int, trainer_version: int) -> bool:
        return trainer_version - oldest_version > self.max_lag

    def mark_done(self, prompt: int) -> None:
        self.done_beyond.add(prompt)
        while self.next_prompt in self.done_beyond:
            self.done_beyond.discard(self.next_prompt)
            self.next_prompt += 1

    def prompts(self, tasks: Callable[[int], Iterator[dict]], task_seed: int) -> Iterator[tuple[int, dict]]:
        """The stream's (prompt, sample) pairs not yet done; a finite task stream is read again with the next seed."""
        skip, i = set(self.done_beyond), 0
        for epoch in itertools.count():
            before = i
            for sample in tasks(task_seed + epoch):
                if i >= self.next_prompt and i not in skip:
                    yield i, sample
                i += 1
            if i == before:
                raise ValueError(f"the task stream {tasks!r} yielded no samples")

    def state_dict(self) -> dict:
        return {"next_prompt": self.next_prompt, "done_beyond": sorted(self.done_beyond), "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.next_prompt, self.done_beyond, self.consumed = state["next_prompt"], set(state["done_beyond"]), \
            state["consumed"]
