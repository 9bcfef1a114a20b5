"""Agents written with the OpenAI Agents SDK and LangChain train unchanged through the run's loopback endpoint
(``molt_lightning.tasks.framework_agents``): against a scripted engine each framework's episode leaves the same token
record as the stock-client agent's (``python_tool.openai_agent``) and ends an overflowing one unanswered; trained on
the tiny python-tool policy, what is trained on is exactly the engine's tokens (the shared invariant)."""

from __future__ import annotations

import shutil

import pytest
from invariant import check_trained_tokens, fit_recorded
from lightning.pytorch.loggers import CSVLogger
from scripted import run_at_endpoint

from molt_lightning import Rollout
from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.engines import TorchEngine
from molt_lightning.tasks import framework_agents, python_tool

FRAMEWORKS = {"agents_sdk_agent": "agents", "langchain_agent": "langchain_openai"}  # agent: the package it needs
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="the python tool's sandbox needs bubblewrap: apt-get install bubblewrap")
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call>'
SAMPLE = {"question": "What is 12*34?", "answer": 408}


def framework_agent(name):
    pytest.importorskip(FRAMEWORKS[name])
    return getattr(framework_agents, name)


@pytest.fixture(scope="module")
def tool_tokenizer():
    from molt_lightning.models.tiny import train_tokenizer

    return train_tokenizer(400, 0, python_tool)


def episode(agent, tokenizer, replies):
    """One run of ``agent`` on SAMPLE against an endpoint whose engine answers ``replies`` in turn: (reward, the
    trajectory's spans as (kind, token ids), its info, the counted events)."""
    counts = {}
    reward, client = run_at_endpoint(ChatTemplate(tokenizer), replies, lambda client: agent(client, dict(SAMPLE)),
                                     counter=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))
    trajectory = client.trajectory
    spans = [(s.kind, s.token_ids) for segment in trajectory.segments for s in segment]
    return reward, spans, trajectory.info, counts


@needs_bwrap
@pytest.mark.parametrize("name", FRAMEWORKS)
@pytest.mark.slow
def test_a_framework_episode_records_the_same_tokens_as_the_stock_client(name, tool_tokenizer):
    agent = framework_agent(name)
    replies = [CALL, "408"]  # a python call, then the answer
    reward, spans, info, counts = episode(agent, tool_tokenizer, replies)
    expected = episode(python_tool.openai_agent, tool_tokenizer, replies)
    assert reward == expected[0] == 1.0
    assert spans == expected[1]  # same prompt, tool turn and answer tokens: no system prompt, nothing re-tokenized
    assert info == {} and counts == {}  # no request refused


@needs_bwrap
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_framework_episode_that_outgrows_the_context_ends_unanswered(name, tool_tokenizer):
    agent = framework_agent(name)
    reward, spans, info, counts = episode(agent, tool_tokenizer, [CALL + "x" * 300] * 3)  # ~180 tokens a turn
    assert reward == 0.0
    assert [e.split(":")[0] for e in info["endpoint_errors"]] == ["400 context_length_exceeded"]
    assert counts == {"endpoint_error/context_length_exceeded": 1}


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_an_unknown_tool_or_arguments_that_are_no_object_are_counted_not_raised(name, tool_tokenizer):
    agent = framework_agent(name)  # (the Agents SDK raises on an unknown tool, LangChain on non-object arguments,
    # which the endpoint never sends: such a call comes back as text, counted as an unparsed tool call)
    for call, event in ((CALL.replace('"python"', '"pyth"'), "tool_error/unknown_tool"),
                        (CALL.replace('{"code": "print(12*34)"}', '"print(1)"'), "unparsed_tool_calls")):
        _, _, info, counts = episode(agent, tool_tokenizer, [call, "408", "408"])  # returns: the agent did not raise
        assert "endpoint_errors" not in info
        assert counts == {event: 1}


@pytest.fixture(scope="module")
def tool_policy():
    from molt_lightning.models.tiny import python_tool_policy

    return python_tool_policy()


@needs_bwrap
@pytest.mark.parametrize("name", FRAMEWORKS)
@pytest.mark.slow
def test_a_framework_agent_trains_only_on_engine_tokens(name, tool_policy, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    agent = framework_agent(name)
    traces = []
    if name == "agents_sdk_agent":  # the SDK would send every run's trace to OpenAI: the agent turns tracing off
        from agents import add_trace_processor
        from agents.tracing.processor_interface import TracingProcessor

        class Recorder(TracingProcessor):
            def on_trace_start(self, trace): traces.append(trace)
            def on_trace_end(self, trace): ...
            def on_span_start(self, span): traces.append(span)
            def on_span_end(self, span): ...
            def shutdown(self): ...
            def force_flush(self): ...

        add_trace_processor(Recorder())
    module, _, records, batches = fit_recorded(
        agent, python_tool.tasks, monkeypatch, engine=TorchEngine(seed=0), steps=3, logger=CSVLogger(tmp_path),
        rollout=Rollout(group_size=8, prompts_per_step=4, max_lag=1, task_seed=1))
    tool_turns = check_trained_tokens(records, batches, AutoTokenizer.from_pretrained(tool_policy))
    assert tool_turns > 0, "no trained trajectory called the python tool"
    assert len(batches.seen) == 3
    trajectories = [t for _, b in batches.seen for t in b.trajectories]
    assert all("endpoint_errors" not in t.info for t in trajectories)
    assert module.source.counts.failed == 0
    assert traces == []
