"""The Anthropic Messages wire (``POST /v1/messages``) with the stock ``anthropic`` client: tool_use / tool_result turns
record exactly the engine's tokens, the reply and the event stream have Anthropic's shapes, bad requests get
Anthropic-style errors that the trajectory records and counts; and the python-tool agent written against the
Anthropic client trains on both engines with the shared invariant check (tests/test_endpoint.py)."""

from __future__ import annotations

import asyncio

import pytest

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.agents.wire.endpoint import Endpoint
from molt_lightning.tasks import python_tool
from molt_lightning.trajectory import Kind, Trajectory

anthropic = pytest.importorskip("anthropic")
from scripted import ScriptedEngine, run_at_endpoint  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 12*34?"}]
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call>'
TOOLS = python_tool.ANTHROPIC_TOOLS


@pytest.fixture(scope="module")
def tool_tokenizer():
    from molt_lightning.models.tiny import train_tokenizer

    return train_tokenizer(400, 0, python_tool)


def serve(tokenizer, replies, scenario, max_context=256):
    """Run ``scenario(llm, client)`` with a stock AsyncAnthropic against an endpoint in front of a scripted engine."""
    async def run(client):
        async with anthropic.AsyncAnthropic(base_url=client.anthropic_base_url, api_key=client.api_key,
                                            max_retries=0) as llm:
            return await scenario(llm, client)

    return run_at_endpoint(ChatTemplate(tokenizer), replies, run, max_context=max_context, version=3)


def test_tool_use_turns_record_exactly_the_engine_tokens(tool_tokenizer):
    async def scenario(llm, client):
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is 12*34?"}]}]
        first = await llm.messages.create(model="policy", system="Be brief.", messages=messages, tools=TOOLS,
                                          max_tokens=48)
        [call] = first.content
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "408"}]}]}]
        second = await llm.messages.create(model="policy", system="Be brief.", messages=messages, tools=TOOLS,
                                           max_tokens=48)
        messages += [{"role": "assistant", "content": second.content[0].text},
                     {"role": "user", "content": "And 2*3?"}]
        third = await llm.messages.create(model="policy", system="Be brief.", messages=messages, tools=TOOLS,
                                          max_tokens=48)
        return first, second, third

    (first, second, third), client = serve(tool_tokenizer, [CALL, "408", "6"], scenario)
    [call] = first.content
    assert first.stop_reason == "tool_use" and call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "python" and call.input == {"code": "print(12*34)"}
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == "408"
    assert second.stop_reason == "end_turn" and third.content[0].text == "6"
    t, tools = client.template, [{"type": "function", "function": {
        "name": "python", "description": TOOLS[0]["description"], "parameters": TOOLS[0]["input_schema"]}}]
    gens = [t.encode(r) + [t.eos_id] for r in (CALL, "408", "6")]
    assert len(client.trajectory.segments) == 1  # three turns, one growing token list
    spans = client.trajectory.segments[0]
    assert [s.kind for s in spans] == [Kind.PROMPT, Kind.POLICY, Kind.ENV, Kind.POLICY, Kind.ENV, Kind.POLICY]
    assert [s.token_ids for s in spans if s.kind == Kind.POLICY] == gens  # the engine's ids, never re-tokenized
    assert all(s.versions == [3] * len(s.token_ids) for s in spans if s.kind == Kind.POLICY)
    conversation = [{"role": "system", "content": "Be brief."}, *QUESTION,
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(12*34)"}}}]},
                    {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"},
                    {"role": "user", "content": "And 2*3?"}, {"role": "assistant", "content": "6"}]
    whole = t.encode(t.render(conversation, tools=tools))  # the same tokens as rendering the conversation at once
    assert client.tokens + t.close_turn_ids(gens[2]) == whole
    assert first.usage.output_tokens == len(gens[0])
    assert third.usage.input_tokens == len(client.tokens) - len(gens[2])


def test_rewritten_history_starts_a_new_segment(tool_tokenizer):
    async def scenario(llm, client):
        await llm.messages.create(model="policy", messages=QUESTION, max_tokens=8)
        await llm.messages.create(model="policy", messages=[{"role": "user", "content": "What is 1+1?"}],
                                  max_tokens=8)

    _, client = serve(tool_tokenizer, ["12", "2"], scenario)
    segments = client.trajectory.segments
    assert len(segments) == 2 and [s.kind for s in segments[1]] == [Kind.PROMPT, Kind.POLICY]


def test_the_event_stream_carries_the_same_reply(tool_tokenizer):
    async def scenario(llm, client):
        async with llm.messages.stream(model="policy", messages=QUESTION, tools=TOOLS, max_tokens=48) as stream:
            events = [event.type async for event in stream]
            return events, await stream.get_final_message()

    (events, message), client = serve(tool_tokenizer, [CALL], scenario)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    [call] = message.content
    assert call.type == "tool_use" and call.input == {"code": "print(12*34)"} and message.stop_reason == "tool_use"
    assert message.usage.output_tokens == client.trajectory.num_policy_tokens


def test_a_reply_cut_at_max_tokens_says_so(tool_tokenizer):
    template = ChatTemplate(tool_tokenizer)
    engine = ScriptedEngine([template.encode("1 2 3 4 5 6")])
    engine._generate = _cut(engine._generate)

    async def main():
        endpoint = Endpoint(["policy"], temperature=1.0)
        await endpoint.start()
        client = AgentClient(engine, Trajectory(0, 0), template, 1.0, 256)
        client.attach(endpoint, "0-0")
        async with anthropic.AsyncAnthropic(base_url=client.anthropic_base_url, api_key=client.api_key,
                                            max_retries=0) as llm:
            reply = await llm.messages.create(model="policy", messages=QUESTION, max_tokens=4)
        await endpoint.stop()
        return reply

    assert asyncio.run(main()).stop_reason == "max_tokens"


def _cut(generate):
    async def cut(prompt_ids, sampling):
        out = await generate(prompt_ids, sampling)
        out.token_ids, out.logprobs = out.token_ids[:sampling.max_tokens], out.logprobs[:sampling.max_tokens]
        out.versions, out.finish_reason = out.versions[:sampling.max_tokens], "length"
        return out
    return cut


@pytest.mark.parametrize("kwargs, error, code", [
    (dict(model="claude-sonnet-4-5"), anthropic.NotFoundError, "model_not_found"),
    (dict(extra_body={"temperature": 0.7}), anthropic.BadRequestError, "unsupported_value"),
    (dict(extra_body={"top_k": 5}), anthropic.BadRequestError, "unsupported_value"),
    (dict(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
     anthropic.BadRequestError, "unsupported_value"),
    (dict(stop_sequences=["\n"]), anthropic.BadRequestError, "unsupported_value"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), anthropic.BadRequestError, "unsupported_value"),
    (dict(tools=TOOLS, tool_choice={"type": "any"}), anthropic.BadRequestError, "unsupported_value"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), anthropic.BadRequestError,
     "unsupported_tool"),
    (dict(tools=[{"name": "python"}]), anthropic.BadRequestError, "invalid_tool_schema"),
    (dict(max_tokens=250), anthropic.BadRequestError, "context_length_exceeded"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), anthropic.BadRequestError,
     "unsupported_content"),
    (dict(extra_body={"container": "x"}), anthropic.BadRequestError, "unsupported_parameter"),
])
def test_bad_requests_get_anthropic_errors_and_the_trajectory_records_why(tool_tokenizer, kwargs, error, code):
    async def scenario(llm, client):
        with pytest.raises(error) as caught:
            await llm.messages.create(**{"model": "policy", "messages": QUESTION, "max_tokens": 8, **kwargs})
        return caught.value

    err, client = serve(tool_tokenizer, ["12"], scenario)
    assert err.body["type"] == "error" and err.body["error"]["message"]
    assert err.body["error"]["type"] == ("not_found_error" if err.status_code == 404 else "invalid_request_error")
    assert client.trajectory.info["endpoint_errors"][0].split()[1] == code + ":"
    assert client.trajectory.num_policy_tokens == 0  # nothing was generated for a refused request
    if code == "context_length_exceeded":  # the words harnesses written for Anthropic's API look for
        assert err.body["error"]["message"].startswith("prompt is too long")


def test_an_unknown_key_is_refused_with_an_authentication_error(tool_tokenizer):
    async def scenario(llm, client):
        async with anthropic.AsyncAnthropic(base_url=client.anthropic_base_url, api_key="not-a-trajectory",
                                            max_retries=0) as other:
            with pytest.raises(anthropic.AuthenticationError, match="client.api_key"):
                await other.messages.create(model="policy", messages=QUESTION, max_tokens=8)
        bearer = anthropic.AsyncAnthropic(base_url=client.anthropic_base_url, auth_token=client.api_key,
                                          max_retries=0)  # ANTHROPIC_AUTH_TOKEN works too
        async with bearer:
            return await bearer.messages.create(model="policy", messages=QUESTION, max_tokens=8)

    reply, _ = serve(tool_tokenizer, ["12"], scenario)
    assert reply.content[0].text == "12"


def test_fields_that_change_nothing_sampled_are_accepted(tool_tokenizer):
    async def scenario(llm, client):
        return await llm.messages.create(
            model="policy", messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is 12*34?", "cache_control": {"type": "ephemeral"}}]}],
            max_tokens=8, metadata={"user_id": "u1"}, output_config={"effort": "low"},
            thinking={"type": "adaptive"}, service_tier="auto", extra_body={"temperature": 1.0})

    reply, client = serve(tool_tokenizer, ["408"], scenario)
    assert reply.content[0].text == "408" and "endpoint_errors" not in client.trajectory.info


@pytest.mark.parametrize("reply", ['<tool_call>5</tool_call>',
                                   '<tool_call>{"name": "python", "arguments": 5}</tool_call>'])
def test_a_tool_call_that_is_no_json_object_comes_back_as_text(tool_tokenizer, reply):
    async def scenario(llm, client):
        return await llm.messages.create(model="policy", messages=QUESTION, tools=TOOLS, max_tokens=48)

    message, client = serve(tool_tokenizer, [reply], scenario)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == reply
    assert message.stop_reason == "end_turn" and "not a JSON object" in client.trajectory.info["unparsed_tool_calls"][0]
