"""Admission (``molt_lightning.rollout.admission``), a pure record: the lag budget with and without ``admit_ahead``, the
staleness rule, the prompt ledger and its resume state. Then the same rules in a running rollout source: batches
oldest first, nothing lost, the switch interval ``switch_interval_ms`` sets while rollouts run, and a stop the
agents ignore fails naming where they wait."""

import asyncio
import itertools
import sys

import pytest
from modules import running
from scripted import ScriptedEngine

from molt_lightning.rollout.admission import Admission
from molt_lightning.config import Rollout
from molt_lightning.rollout import RolloutSource


class VersionedEngine(ScriptedEngine):
    """Tags each reply with the version the engine holds (``ScriptedEngine`` tags a fixed one)."""

    async def _generate(self, prompt_ids, sampling):
        self.reply_version = self.version
        return await super()._generate(prompt_ids, sampling)


@pytest.mark.parametrize("max_lag", [0, 1, 3])
def test_the_lag_budget_is_max_lag_plus_one_batches_beyond_what_was_consumed(max_lag):
    a, P = Admission(prompts_per_step=4, max_lag=max_lag), 4
    for version, consumed in [(0, 0), (2, 2), (5, 4), (3, 5)]:
        a.consumed = consumed
        budget = max(0, (version - consumed + max_lag + 1) * P)
        assert [a.may_admit(version, n, trainer_waits=False) for n in range(budget + 2)] == \
            [True] * budget + [False] * 2


def test_without_admit_ahead_a_waiting_trainer_caps_admission_at_one_batch():
    eager, lazy = Admission(4, max_lag=2), Admission(4, max_lag=2, admit_ahead=False)
    assert eager.may_admit(0, 11, trainer_waits=True) and not eager.may_admit(0, 12, trainer_waits=True)
    assert lazy.may_admit(0, 3, trainer_waits=True) and not lazy.may_admit(0, 4, trainer_waits=True)
    assert lazy.may_admit(0, 11, trainer_waits=False)  # the trainer busy training: the whole budget again


def test_the_staleness_rule():
    a = Admission(2, max_lag=1)
    assert not a.too_old(oldest_version=4, trainer_version=5) and a.too_old(oldest_version=3, trainer_version=5)
    assert not Admission(2, max_lag=0).too_old(5, 5) and Admission(2, max_lag=0).too_old(4, 5)


def test_the_ledger_skips_what_is_done_resumes_and_repeats_a_finite_stream_with_the_next_seed():
    seeds = []

    def tasks(seed):
        seeds.append(seed)
        return iter([{"seed": seed, "k": k} for k in range(3)])

    a = Admission(2, max_lag=1)
    for prompt in (0, 2, 1, 4):  # done out of order: the first not done is 3, 4 is done beyond it
        a.mark_done(prompt)
    assert (a.next_prompt, a.done_beyond) == (3, {4})
    resumed = Admission(2, max_lag=1)
    resumed.load_state_dict(a.state_dict())
    stream = resumed.prompts(tasks, task_seed=7)
    assert [next(stream) for _ in range(3)] == [(3, {"seed": 8, "k": 0}), (5, {"seed": 8, "k": 2}),
                                                (6, {"seed": 9, "k": 0})]
    assert seeds == [7, 8, 9]  # epoch e reads tasks(task_seed + e)
    with pytest.raises(ValueError, match="yielded no samples"):
        next(Admission(2, 0).prompts(lambda seed: iter(()), 0))


def test_a_running_source_gives_batches_oldest_first_and_loses_nothing():
    async def agent(client, sample):
        await client.generate([1, 2], max_tokens=2)
        return 1.0

    def tasks(seed):
        return ({"i": i} for i in range(10_000))

    for admit_ahead in (True, False):
        source = RolloutSource(agent, tasks, Rollout(group_size=1, prompts_per_step=2, max_lag=1,
                                                     admit_ahead=admit_ahead))
        engine = VersionedEngine(itertools.repeat([5, 6]))
        with running(source, engine):
            ids = []
            for step in range(3):
                ids.append(sorted(t.sample_id for t in source.next_batch(step)))
                engine.call(engine.commit_weights(step + 1))  # the trainer's push after its step
                source.wake()
        assert ids == [[0, 1], [2, 3], [4, 5]], admit_ahead
        assert source.counts_now().trained == 6


def test_stale_groups_are_dropped_their_prompts_run_again_and_the_wait_goes_on():
    """Every group the first wait holds is too old for the trainer (the engine tags version 0, the trainer is at 2):
    the wait drops them and wakes the producer (a wait with nothing running would otherwise never end), whose new
    groups make the batch."""

    async def agent(client, sample):
        await client.generate([1, 2], max_tokens=2)
        return 1.0

    source = RolloutSource(agent, lambda seed: ({"i": i} for i in range(10_000)),
                           Rollout(group_size=1, prompts_per_step=2, max_lag=1))
    engine = VersionedEngine(itertools.repeat([5, 6]))
    with running(source, engine):
        source.next_batch(0)  # four groups were admitted at version 0; two are left over, tagged 0
        engine.call(engine.commit_weights(2))  # a jump of two versions (the trainer would never push so)
        source.wake()
        batch = source.next_batch(2)
    counts = source.counts_now()
    assert counts.dropped_stale_groups == counts.dropped_stale_samples == 2  # the two left over, tagged 0
    assert len(batch) == 2 and {t.oldest_version for t in batch} == {2}


def test_switch_interval_is_set_while_rollouts_run_and_restored_after():
    async def agent(client, sample):
        await asyncio.sleep(0)
        return 1.0

    before = sys.getswitchinterval()
    source = RolloutSource(agent, lambda seed: iter([{"i": 0}] * 1000), Rollout(switch_interval_ms=0.5))
    with running(source, ScriptedEngine(itertools.repeat([5]))):
        assert sys.getswitchinterval() == pytest.approx(5e-4)
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="switch_interval_ms must be > 0"):
        RolloutSource(None, None, Rollout(switch_interval_ms=0))


def test_a_stop_the_agents_ignore_fails_naming_what_each_awaits(monkeypatch, caplog):
    """An agent that swallows its cancellation: ``stop`` gives up after ``STOP_TIMEOUT_S`` with an error and logs the
    stack of every task still pending on the engine's loop (where a stop that hangs waits)."""
    import logging
    import threading

    from molt_lightning.rollout import source as source_module

    monkeypatch.setattr(source_module, "STOP_TIMEOUT_S", 1)
    started = threading.Event()

    async def stubborn_agent(client, sample):
        await client.generate([1, 2], max_tokens=2)
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)  # ignores the stop

    source = RolloutSource(stubborn_agent, lambda seed: ({"i": i} for i in range(10_000)),
                           Rollout(group_size=1, prompts_per_step=1))
    with caplog.at_level(logging.ERROR, logger="molt_lightning.rollout.source"), pytest.raises(TimeoutError):
        with running(source, ScriptedEngine(itertools.repeat([5]))):
            assert started.wait(60)
    assert "did not end within 1 s of their cancellation" in caplog.text
    assert "in stubborn_agent" in caplog.text and "asyncio.sleep(3600)  # ignores the stop" in caplog.text
