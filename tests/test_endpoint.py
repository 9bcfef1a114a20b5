"""The loopback OpenAI-compatible endpoint: the stock ``openai.AsyncOpenAI`` client drives multi-turn tool-calling
agents, and what is trained on is exactly the engine's tokens. Request-level tests use a scripted engine (the record
is pinned token by token); the end-to-end tests run the python-tool recipe's agent on both engines."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import openai
import pytest
from lightning.pytorch.loggers import CSVLogger

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.engines import TorchEngine
from molt_lightning import Rollout
from molt_lightning.tasks import python_tool
from molt_lightning.trajectory import Kind

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from invariant import check_trained_tokens, fit_recorded  # noqa: E402
from scripted import run_at_endpoint  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 12*34?"}]


@pytest.fixture(scope="module")
def tool_tokenizer():
    """The python-tool policy's tokenizer (chat template with tools, Hermes tool calls, response_template)."""
    from molt_lightning.models.tiny import train_tokenizer

    return train_tokenizer(400, 0, python_tool)


def serve(tokenizer, replies, scenario, max_context=256):
    """Run ``scenario(llm, client)`` against an endpoint in front of a scripted engine; returns (result, client)."""
    async def run(client):
        async with openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as llm:
            return await scenario(llm, client)

    return run_at_endpoint(ChatTemplate(tokenizer), replies, run, max_context=max_context, version=3)


CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call>'


def test_tool_call_turns_record_exactly_the_engine_tokens(tool_tokenizer):
    async def scenario(llm, client):
        messages = list(QUESTION)
        first = await llm.chat.completions.create(model="policy", messages=messages, tools=python_tool.TOOLS,
                                                  max_tokens=48)
        message = first.choices[0].message
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "408"}]
        second = await llm.chat.completions.create(model="policy", messages=messages, tools=python_tool.TOOLS)
        return first, second

    (first, second), client = serve(tool_tokenizer, [CALL, "408"], scenario)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert call.function.name == "python" and json.loads(call.function.arguments) == {"code": "print(12*34)"}
    assert second.choices[0].message.content == "408" and second.choices[0].finish_reason == "stop"
    t, tools = client.template, python_tool.TOOLS
    gen1, gen2 = t.encode(CALL) + [t.eos_id], t.encode("408") + [t.eos_id]
    spans = client.trajectory.segments[0]
    assert len(client.trajectory.segments) == 1
    assert [s.kind for s in spans] == [Kind.PROMPT, Kind.POLICY, Kind.ENV, Kind.POLICY]
    assert spans[1].token_ids == gen1 and spans[3].token_ids == gen2  # the engine's ids, never re-tokenized
    assert spans[1].logprobs == [-0.5] * len(gen1) and spans[3].versions == [3] * len(gen2)
    conversation = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(12*34)"}}}]},
        {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    whole = t.encode(t.render(conversation, tools=tools))  # the same tokens as rendering the conversation at once
    assert client.tokens + t.close_turn_ids(gen2) == whole
    assert first.usage.completion_tokens == len(gen1) and second.usage.prompt_tokens == len(client.tokens) - len(gen2)


def test_rewritten_history_starts_a_new_segment(tool_tokenizer):
    async def scenario(llm, client):
        await llm.chat.completions.create(model="policy", messages=QUESTION, max_tokens=8)
        rewritten = [{"role": "user", "content": "Forget that. What is 1+1?"}]
        await llm.chat.completions.create(model="policy", messages=rewritten, max_tokens=8)

    _, client = serve(tool_tokenizer, ["12", "2"], scenario)
    segments = client.trajectory.segments
    assert len(segments) == 2 and [s.kind for s in segments[1]] == [Kind.PROMPT, Kind.POLICY]


def test_streaming_returns_the_same_reply(tool_tokenizer):
    async def scenario(llm, client):
        stream = await llm.chat.completions.create(model="policy", messages=QUESTION, tools=python_tool.TOOLS,
                                                   stream=True)
        return [chunk async for chunk in stream]

    chunks, _ = serve(tool_tokenizer, [CALL], scenario)
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert json.loads(calls[0].function.arguments) == {"code": "print(12*34)"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_unparsable_tool_call_comes_back_as_text_and_is_recorded(tool_tokenizer):
    broken = '<tool_call>{"name": "python", "argum</tool_call>'

    async def scenario(llm, client):
        return await llm.chat.completions.create(model="policy", messages=QUESTION, tools=python_tool.TOOLS)

    response, client = serve(tool_tokenizer, [broken], scenario)
    assert response.choices[0].message.tool_calls is None and "argum" in response.choices[0].message.content
    assert "JSON" in client.trajectory.info["unparsed_tool_calls"][0]


@pytest.mark.parametrize("kwargs, error, code", [
    (dict(model="gpt-4o"), openai.NotFoundError, "model_not_found"),
    (dict(temperature=0.7), openai.BadRequestError, "unsupported_value"),
    (dict(n=2), openai.BadRequestError, "unsupported_value"),
    (dict(tool_choice="required", tools=python_tool.TOOLS), openai.BadRequestError, "unsupported_value"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), openai.BadRequestError,
     "invalid_tool_schema"),
    (dict(tools=[{"type": "retrieval"}]), openai.BadRequestError, "invalid_tool_schema"),
    (dict(stop=["\n"]), openai.BadRequestError, "unsupported_parameter"),
    (dict(max_tokens=250), openai.BadRequestError, "context_length_exceeded"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     openai.BadRequestError, "unsupported_content"),
])
def test_bad_requests_get_openai_errors_and_the_trajectory_records_why(tool_tokenizer, kwargs, error, code):
    async def scenario(llm, client):
        with pytest.raises(error) as caught:
            await llm.chat.completions.create(**{"model": "policy", "messages": QUESTION, **kwargs})
        return caught.value

    err, client = serve(tool_tokenizer, ["12"], scenario)
    assert err.body["code"] == code and err.body["message"]
    assert client.trajectory.info["endpoint_errors"][0].split()[1] == code + ":"
    assert client.trajectory.num_policy_tokens == 0  # nothing was generated for a refused request


def test_unknown_key_and_a_policy_without_tool_parsing_are_refused(tokenizer, tool_tokenizer):
    async def stranger(llm, client):
        other = openai.AsyncOpenAI(base_url=client.base_url, api_key="not-a-trajectory", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="client.api_key"):
            await other.chat.completions.create(model="policy", messages=QUESTION)
        await other.close()

    serve(tool_tokenizer, [], stranger)

    async def with_tools(llm, client):  # the default policy's tokenizer has no response_template
        with pytest.raises(openai.BadRequestError, match="response_template"):
            await llm.chat.completions.create(model="policy", messages=QUESTION, tools=python_tool.TOOLS)

    serve(tokenizer, [], with_tools)


# ----- end to end: the python-tool recipe's agent (stock OpenAI client + sandboxed Python) on both engines -----

@pytest.fixture(scope="module")
def tool_policy():
    from molt_lightning.models.tiny import python_tool_policy

    return python_tool_policy()


@pytest.fixture(scope="module")
def tool_vllm(tool_policy):
    """One vLLM engine on the python-tool policy for this module's runs (start-up costs 25-60 s)."""
    pytest.importorskip("vllm")
    from molt_lightning.engines import VLLMEngine

    engine = VLLMEngine(seed=0)
    engine.launch(tool_policy)
    yield engine
    engine.release()


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="the python tool's sandbox needs bubblewrap: apt-get install bubblewrap")


@needs_bwrap
@pytest.mark.parametrize("wire", ["openai", "anthropic"])
# serial: on vLLM, the Anthropic agents' cancellation at the end of the run outlasted RolloutSource.stop's 60 s in both
# full runs on two xdist workers (2026-12-05; alone it takes 12 s, also with OMP_NUM_THREADS=1), cause not found yet:
# make test runs it after the parallel part, in one process
@pytest.mark.parametrize("kind", ["torch", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.serial])])
def test_stock_client_agents_train_only_on_engine_tokens(kind, wire, tool_policy, tmp_path, monkeypatch, request):
    """The python-tool agent written against the stock OpenAI client (chat completions) and the same agent written
    against the stock Anthropic client (messages) train on both engines; every trained token is the engine's."""
    from transformers import AutoTokenizer

    engine = TorchEngine(seed=0) if kind == "torch" else request.getfixturevalue("tool_vllm")
    agent = python_tool.openai_agent if wire == "openai" else python_tool.anthropic_agent
    module, _, records, batches = fit_recorded(
        agent, python_tool.tasks, monkeypatch, engine=engine, steps=3, logger=CSVLogger(tmp_path),
        rollout=Rollout(group_size=8, prompts_per_step=4, max_lag=1, task_seed=1))
    tokenizer = AutoTokenizer.from_pretrained(tool_policy)
    tool_turns = check_trained_tokens(records, batches, tokenizer)
    assert tool_turns > 0, "no trained trajectory called the python tool"
    trajectories = [t for _, b in batches.seen for t in b.trajectories]
    assert all("endpoint_errors" not in t.info for t in trajectories)
    assert module.source.counts.failed == 0


@needs_bwrap
@pytest.mark.slow
def test_python_tool_recipe_runs_through_the_cli(tool_policy, tmp_path):
    import os
    import subprocess

    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", "recipes/python_tool.yaml",
         "--model.engine", "molt_lightning.engines.TorchEngine", "--trainer.max_steps", "2",
         "--model.rollout.prompts_per_step", "4", "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / "python_tool").iterdir())
    df = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(df["step"].dropna().unique()) == [0, 1]
    assert df["samples/failed"].dropna().sum() == 0
