"""Truncation by its cause (``trajectory.Truncation``): each producer records its own (the client at a turn's
max_tokens or at the context's end, ``EnvAgent`` at max_turns, the verifiers adapter at verifiers' limits), the first
cause stays, ``Outcomes.truncation`` codes it per trajectory, and the rollout source counts each cause, which the
monitor logs as ``samples/truncated/<cause>``."""

import asyncio
import itertools
from types import SimpleNamespace

import pytest
import torch
from modules import running
from scripted import CutEngine, ScriptedEngine

from molt_lightning.agents.adapters.verifiers_env import VerifiersAgent
from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.agents.env import EnvAgent, Environment, Step
from molt_lightning.callbacks.monitor import RolloutMonitor
from molt_lightning.config import Rollout
from molt_lightning.rollout import RolloutCounts, RolloutSource
from molt_lightning.trajectory import (TRUNCATION_CODES, Kind, Outcomes, Span, Status, Trajectory, Truncation,
                                       collate)

CAUSES = ["max_tokens", "max_turns", "environment", "context"]


def made(**kw) -> Trajectory:
    return Trajectory(0, 0, [[Span.context(Kind.PROMPT, [1]), Span.policy([2, 3], [-0.1, -0.2], [0, 0])]],
                      reward=1.0, **kw)


def test_the_codes_are_one_plus_the_causes_order_and_the_first_cause_stays():
    assert [c.value for c in Truncation] == CAUSES
    assert TRUNCATION_CODES == {Truncation.MAX_TOKENS: 1, Truncation.MAX_TURNS: 2, Truncation.ENVIRONMENT: 3,
                                Truncation.CONTEXT: 4}
    t = made()
    assert t.truncation is None and t.status == Status.OK
    t.truncate(Truncation.MAX_TOKENS, "a turn hit max_tokens=4")
    t.truncate(Truncation.MAX_TURNS, "the environment was not done after max_turns=2")
    assert (t.status, t.truncation, t.reason) == (Status.TRUNCATED, Truncation.MAX_TOKENS, "a turn hit max_tokens=4")
    t.fail("the agent raised")  # a failed one is not truncated (and never trained on)
    assert (t.status, t.truncation) == (Status.FAILED, None)
    t.truncate(Truncation.CONTEXT, "late")
    assert (t.status, t.truncation, t.reason) == (Status.FAILED, None, "the agent raised")


def test_outcomes_code_each_trajectorys_cause():
    trajs = [made()]
    for cause in Truncation:
        trajs.append(made())
        trajs[-1].truncate(cause, cause.value)
    trajs.append(made(status=Status.TRUNCATED))  # marked by hand, without a cause
    out = collate(trajs, pad_id=0).outcomes
    assert out.truncation.dtype == torch.long and out.truncation.tolist() == [0, 1, 2, 3, 4, 0]
    assert out.truncated.tolist() == [False, True, True, True, True, True]
    assert out.to("cpu").truncation.tolist() == [0, 1, 2, 3, 4, 0]
    by_hand = Outcomes(torch.ones(2), torch.tensor([2, 3]), torch.zeros(2, dtype=torch.long))  # no truncation
    assert by_hand.truncation is None and by_hand.to("cpu").truncation is None


def generate(engine, max_context: int, calls) -> Trajectory:
    """Run ``calls`` (context ids, max_tokens) through one client; the trajectory."""
    traj = Trajectory(0, 0)
    client = AgentClient(engine, traj, None, temperature=1.0, max_context=max_context)

    async def agent():
        for context, max_tokens in calls:
            await client.generate(context, max_tokens=max_tokens)

    asyncio.run(agent())
    return traj


def test_the_client_records_max_tokens_or_the_context_as_the_cause():
    reply = itertools.repeat([5, 6, 7, 8, 9, 10])  # six tokens, unless cut
    at_max_tokens = generate(CutEngine(reply), 16, [([1, 2], 4)])
    assert at_max_tokens.truncation == Truncation.MAX_TOKENS and at_max_tokens.reason == "a turn hit max_tokens=4"
    assert at_max_tokens.num_policy_tokens == 4
    # no max_tokens: the client asks for the rest of the context (16 - 12 = 4 tokens) and the turn fills it
    at_context = generate(CutEngine(reply), 16, [([1] * 12, None)])
    assert at_context.truncation == Truncation.CONTEXT and at_context.num_policy_tokens == 4
    assert at_context.reason == "a turn hit the context's end (max_context=16)"
    ended = generate(CutEngine(reply), 16, [([1, 2], 6), ([3], None)])  # stopped by itself: 2 + 6 + 1 + 6 <= 16
    assert (ended.status, ended.truncation) == (Status.OK, None)
    # the first turn hit its max_tokens, the second the context's end: the first cause stays
    both = generate(CutEngine(reply), 10, [([1, 2], 3), ([4], None)])  # the second gets 10 - 6 = 4 tokens
    assert both.truncation == Truncation.MAX_TOKENS and both.turns == 2 and both.num_policy_tokens == 3 + 4


def test_a_turn_undone_leaves_no_truncation():
    traj = Trajectory(0, 0)
    client = AgentClient(CutEngine(itertools.repeat([5, 6, 7])), traj, None, temperature=1.0, max_context=16)

    async def agent():
        with pytest.raises(RuntimeError), client.undone_on_failure():
            await client.generate([1, 2], max_tokens=2)
            assert traj.truncation == Truncation.MAX_TOKENS
            raise RuntimeError("the endpoint's turn failed after the engine answered")

    asyncio.run(agent())
    assert (traj.status, traj.truncation, traj.reason, traj.turns) == (Status.OK, None, "", 0)


class NeverDone(Environment):
    async def reset(self, sample):
        return sample["question"]

    async def step(self, action):
        return Step("go on", 0.0, False)


@pytest.mark.parametrize("engine, cause", [(ScriptedEngine, Truncation.MAX_TURNS),
                                           (CutEngine, Truncation.MAX_TOKENS)])
def test_env_agent_at_max_turns_unless_a_turn_was_cut_first(tokenizer, engine, cause):
    t = ChatTemplate(tokenizer)
    replies = itertools.repeat(t.encode("ANSWER 1 and a few more words") + [t.eos_id])  # more than 3 tokens
    traj = Trajectory(0, 0)
    client = AgentClient(engine(replies), traj, t, temperature=1.0, max_context=256)
    result = asyncio.run(EnvAgent(NeverDone, max_turns=2, max_tokens=3 if engine is CutEngine else 64)(
        client, {"question": "q?"}))
    assert result.info["env_truncated"] and traj.turns == 2
    assert (traj.status, traj.truncation) == (Status.TRUNCATED, cause)
    assert traj.reason == ("a turn hit max_tokens=3" if cause == Truncation.MAX_TOKENS
                           else "the environment was not done after max_turns=2")


@pytest.mark.parametrize("stop, cause", [("max_turns", Truncation.MAX_TURNS),
                                         ("max_total_tokens", Truncation.ENVIRONMENT), ("completed", None)])
def test_the_verifiers_adapter_records_verifiers_limits(stop, cause):
    """``VerifiersAgent.result`` on a finished episode as verifiers returns it (its fields, without running one)."""
    trace = SimpleNamespace(agent=SimpleNamespace(name="agent", trainable=True), rewards={}, metrics={}, errors=[],
                            num_turns=3, stop_condition=stop, is_truncated=cause is not None, reward=0.5)
    episode = SimpleNamespace(ok=True, errors=[], traces=[trace])
    client = SimpleNamespace(trajectory=Trajectory(0, 0))
    result = VerifiersAgent("unused").result(episode, client)
    assert result.reward == 0.5 and result.info["stop_condition"] == stop
    assert client.trajectory.truncation == cause
    assert client.trajectory.status == (Status.OK if cause is None else Status.TRUNCATED)
    if cause is not None:
        assert client.trajectory.reason == f"verifiers stopped the episode: {stop}"
    cut = SimpleNamespace(trajectory=made())  # its client marked a turn at max_tokens first: that cause stays
    cut.trajectory.truncate(Truncation.MAX_TOKENS, "a turn hit max_tokens=48")
    VerifiersAgent("unused").result(episode, cut)
    assert cut.trajectory.truncation == Truncation.MAX_TOKENS


def test_the_source_counts_each_cause_and_the_monitor_logs_them():
    """Five prompts, one run each, all in the first batch (max_lag 0: nothing else is admitted): cut at max_tokens,
    at the context's end, at max_turns and by the environment (marked as ``play`` and the adapter mark them), and ok."""

    async def agent(client, sample):
        i = sample["i"]
        if i == 1:  # no max_tokens: the rest of the context (8 - 4), and the reply of 6 fills it
            await client.generate([1, 2, 3, 4], max_tokens=None)
        else:
            await client.generate([1, 2], max_tokens=3 if i == 0 else 6)
        if i in (2, 3):
            client.trajectory.truncate([Truncation.MAX_TURNS, Truncation.ENVIRONMENT][i - 2], "stopped")
        return 1.0

    source = RolloutSource(agent, lambda seed: ({"i": i} for i in range(5)),
                           Rollout(group_size=1, prompts_per_step=5, max_lag=0))
    with running(source, CutEngine(itertools.repeat([5, 6, 7, 8, 9, 10])), max_context=8):
        batch = source.next_batch(0)
        counts = source.counts_now()
    assert sorted((t.sample_id, t.truncation) for t in batch) == [
        (0, Truncation.MAX_TOKENS), (1, Truncation.CONTEXT), (2, Truncation.MAX_TURNS), (3, Truncation.ENVIRONMENT),
        (4, None)]
    assert counts.finished == 5 and counts.truncated == 4
    assert counts.truncated_by == {"max_tokens": 1, "max_turns": 1, "environment": 1, "context": 1}
    monitor = RolloutMonitor()
    monitor._counts = RolloutCounts()  # what on_train_start keeps: nothing yet
    metrics = monitor._rollout(counts, SimpleNamespace(trajectories=batch), wall=1.0)
    for cause in CAUSES:
        assert metrics[f"samples/truncated/{cause}"] == metrics[f"samples/truncated/{cause}_total"] == 1.0
    assert metrics["samples/truncated"] == 4.0
    again = monitor._rollout(counts, SimpleNamespace(trajectories=batch), wall=1.0)  # nothing new this step
    assert again["samples/truncated/max_tokens"] == 0.0 and again["samples/truncated/max_tokens_total"] == 1.0


def test_a_checkpoint_without_a_cause_resumes_with_it_at_zero():
    source = RolloutSource(None, None, Rollout())
    state = source.state_dict()
    del state["counts"]["truncated_by"]  # a checkpoint from before the causes were counted
    source.load_state_dict(state)
    assert source.counts.truncated_by == dict.fromkeys(CAUSES, 0)
    state["counts"]["truncated_by"] = {"max_tokens": 3}  # one from before a cause was added
    source.load_state_dict(state)
    assert source.counts.truncated_by == {"max_tokens": 3, "max_turns": 0, "environment": 0, "context": 0}
