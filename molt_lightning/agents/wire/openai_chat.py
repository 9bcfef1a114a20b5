"""OpenAI's chat completions wire (``POST /v1/chat/completions``) on the run's endpoint: the fields a request may hold,
a request parsed into the chat messages and tools the policy's chat template renders (tool-call arguments as objects,
the Hugging Face form), and the reply, its stream and its errors in OpenAI's shapes. The module is a wire of
``Endpoint._turn`` (``api_key``, ``parse``, ``error_body``, ``reply_body``, ``events``), served exactly like the
Anthropic one (``anthropic_messages``); what both share is in ``checks``.

The shapes are written by hand from OpenAI's API reference: no library offers them without a serving engine.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .checks import (RequestError, check_fields, check_max_tokens, check_tools, lone_surrogate, need, refuse, short,
                     text_of)

_FIELDS = {  # every field a chat completion request may hold, with its type; any other field is refused
    "model": "a string", "messages": "a list", "tools": "a list", "tool_choice": "any JSON value",
    "max_tokens": "an integer", "max_completion_tokens": "an integer", "n": "an integer", "stream": "a boolean",
    "temperature": "a number", "top_p": "a number", "logprobs": "a boolean", "frequency_penalty": "a number",
    "presence_penalty": "a number",
    # accepted and ignored: they change nothing the policy samples
    "stream_options": "an object", "user": "a string", "seed": "an integer", "parallel_tool_calls": "a boolean",
    "metadata": "an object", "store": "a boolean", "service_tier": "a string", "prompt_cache_key": "a string",
    "safety_identifier": "a string"}


def api_key(request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ").strip()


def parse(body: dict, max_context: int, tools_ok: bool) -> tuple[list[dict], list | None, int | None]:
    check_fields(body, _FIELDS, "the run trains on what the policy samples at its own settings, so parameters "
                                "that change sampling (and ones this endpoint does not know) are refused")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            raise refuse(f"{name} changes sampling and is not supported; omit it", name)
    if body.get("logprobs"):
        raise refuse("logprobs are not returned here (the trainer keeps the engine's own); omit logprobs", "logprobs")
    if body.get("n") not in (None, 1):
        raise refuse("n must be 1: the run samples the group itself (model.group_size)", "n")
    max_tokens = check_max_tokens(body.get("max_tokens"), "max_tokens", max_context)  # None: the rest
    # the newer name wins
    max_tokens = check_max_tokens(body.get("max_completion_tokens"), "max_completion_tokens", max_context) or max_tokens
    tools = check_tools(body.get("tools"), body.get("tool_choice"), tools_ok)
    messages = body.get("messages")
    need(isinstance(messages, list) and bool(messages), "messages",
         "a non-empty list of {'role': ..., 'content': ...}", messages)
    return [hf_message(m, i) for i, m in enumerate(messages)], tools, max_tokens


error_body = RequestError.body  # OpenAI's error shape is the request error's own


def reply_body(body: dict, message: dict, out, prompt_tokens: int) -> dict:
    """The chat completion of the turn (``events``: as a stream)."""
    reply = _openai_message(message)
    finish = "tool_calls" if reply.get("tool_calls") else out.finish_reason
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
                      "total_tokens": prompt_tokens + len(out.token_ids)}}


def hf_message(m: Any, i: int) -> dict:
    """An OpenAI chat message as the Hugging Face chat template expects it (tool-call arguments as dicts). Keys other
    than ``role``, ``content`` and ``tool_calls`` (``name``, ``tool_call_id``, ``refusal``, ...) are ignored."""
    where = f"messages[{i}]"
    need(isinstance(m, dict), where, "an object like {'role': 'user', 'content': '...'}", m)
    role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
    need(role in ("system", "developer", "user", "assistant", "tool"), f"{where}.role",
         "one of system, developer, user, assistant or tool", role)
    if content is None and role == "assistant":  # an assistant turn that only calls tools
        content = ""
    out = {"role": "system" if role == "developer" else role,
           "content": text_of(content, f"{where}.content", "content parts")}
    if calls is not None:
        need(isinstance(calls, list) and (role == "assistant" or not calls), f"{where}.tool_calls",
             "a list, on an assistant message", calls)
        if calls:
            out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _tool_call(call: Any, where: str) -> dict:
    """An OpenAI tool call (arguments as a JSON string) in the Hugging Face form (arguments as an object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    need(isinstance(fn, dict) and isinstance(fn.get("name"), str), where,
         "{'type': 'function', 'function': {'name': str, 'arguments': a JSON object as a string}}", call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else None
        except ValueError:
            raise RequestError(400, f"{where}.function.arguments is not JSON: {short(args)}: send the arguments the "
                                    "reply carried, a JSON object as a string", f"{where}.function.arguments",
                               "invalid_type") from None
    need(args is None or isinstance(args, dict), f"{where}.function.arguments", "a JSON object (as a string)", args)
    bad = lone_surrogate(args)
    need(bad is None, f"{where}.function.arguments", "Unicode text", args, f"{bad} holds a lone UTF-16 surrogate")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args or {}}}


def _openai_message(message: dict) -> dict:
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        reply["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in message["tool_calls"]]
    return reply


async def events(completion: dict):
    """The completion as OpenAI's stream: the whole reply as one chunk, then the finish chunk."""
    def event(delta: dict, finish_reason: str | None) -> str:
        chunk = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
                 "model": completion["model"],
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(chunk)}\n\n"

    [choice] = completion["choices"]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    yield event(delta, None)
    yield event({}, choice["finish_reason"])
    yield "data: [DONE]\n\n"
