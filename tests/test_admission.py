"""Admission while the trainer waits: ``admit_ahead=False`` starts nothing beyond the batch the trainer waits for,
the default starts the next batches too (up to the lag budget); both keep the lag bound. And the switch interval
that ``switch_interval_ms`` sets while rollouts run."""

import asyncio
import itertools
import threading
import time

import pytest

from helpers.scripted import ScriptedEngine
from molt_lightning.rollout import RolloutSource


class VersionedEngine(ScriptedEngine):
    """Tags each reply with the version the engine holds (``ScriptedEngine`` tags a fixed one)."""

    async def _generate(self, prompt_ids, sampling):
        self.reply_version = self.version
        return await super()._generate(prompt_ids, sampling)


def run(admit_ahead: bool):
    started, lock = [], threading.Lock()

    async def agent(client, sample):
        with lock:  # the batches the trainer had taken when this group's agent started
            started.append((sample["i"], source.consumed_batches))
        await asyncio.sleep(0.3)
        await client.generate([1, 2], max_tokens=2)
        return 1.0

    def tasks(seed):
        return ({"i": i} for i in range(10_000))

    source = RolloutSource(agent, tasks, group_size=1, prompts_per_step=2, max_lag=1, admit_ahead=admit_ahead)
    engine = VersionedEngine(itertools.repeat([5, 6]))
    source.start(engine, "scripted", None)
    seen, taken = [], {}
    try:
        for step in range(3):
            trainer = threading.Thread(target=lambda: taken.setdefault(step, source.next_batch(step)))
            trainer.start()
            if step == 0:  # the trainer waits before the producer starts
                while not source._trainer_waits:
                    time.sleep(0.001)
                source.begin()
            trainer.join(30)
            with lock:
                seen.append((sorted(t.sample_id for t in taken[step]), sum(c <= step for _, c in started)))
            source.call(engine.commit_weights(step + 1))  # the trainer's push after its step
    finally:
        source.stop()
    return seen


@pytest.mark.parametrize("admit_ahead", [True, False])
def test_admission_while_the_trainer_waits(admit_ahead):
    seen = run(admit_ahead)
    assert [ids for ids, _ in seen] == [[0, 1], [2, 3], [4, 5]]  # oldest first either way, nothing lost
    # the first wait (engine version 0, nothing consumed): the default fills the lag budget, (version - consumed +
    # max_lag + 1) x P = 4 groups; admit_ahead=False starts only the 2 of the batch the trainer waits for. (Later
    # waits depend on how far the producer got while the trainer "trained", which this test does not pin.)
    assert seen[0][1] == (4 if admit_ahead else 2)


def test_switch_interval_is_set_while_rollouts_run_and_restored_after():
    import sys

    async def agent(client, sample):
        return 1.0

    before = sys.getswitchinterval()
    source = RolloutSource(agent, lambda seed: iter([{"i": 0}] * 1000), switch_interval_ms=0.5)
    source.start(VersionedEngine(itertools.repeat([5])), "scripted", None)
    try:
        source.begin()
        assert sys.getswitchinterval() == pytest.approx(5e-4)
    finally:
        source.stop()
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="switch_interval_ms must be > 0"):
        RolloutSource(None, None, switch_interval_ms=0)
