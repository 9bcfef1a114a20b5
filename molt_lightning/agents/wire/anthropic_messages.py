"""Anthropic's Messages API (``POST /v1/messages``) on the run's endpoint, for the stock ``anthropic`` client and the
harnesses built on it (``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``).

A request becomes the chat messages and tools the policy's chat template renders, and then it is served exactly like
a chat completion (``Endpoint._turn``: only the template delta is tokenized, the assistant's tokens are the engine's,
a rewritten history starts a new segment, tool calls are parsed by the tokenizer's ``response_template``):

- ``system`` (a string or text blocks) is the first message; ``user``/``assistant`` messages take a string or blocks;
- an assistant's ``text`` blocks are its content and its ``tool_use`` blocks its tool calls (``input`` as the
  arguments); a user's ``tool_result`` blocks become ``tool`` messages (in their order, before the user's text);
- ``tools`` (``name``, ``description``, ``input_schema``) become function tools; ``tool_choice`` ``auto``/``none``;
- the reply is a ``message`` with a ``text`` block (when the policy wrote text) and a ``tool_use`` block per parsed
  call; ``stop_reason`` is ``tool_use``, ``max_tokens`` or ``end_turn``; ``stream: true`` sends the same reply as
  Anthropic's event stream (``message_start`` ... ``message_stop``).

Refused with an Anthropic-style error (``{"type": "error", "error": {"type", "message"}}``), recorded in the
trajectory and counted like the OpenAI ones: ``temperature``/``top_p`` other than the run's, ``top_k``,
``stop_sequences``, ``thinking`` with a budget (``enabled``), ``output_config.format`` (structured outputs), a
forced ``tool_choice`` (``any``/``tool``: constrained decoding), server tools (``web_search``, ``bash``, ...: they
run on Anthropic's side), image/document blocks, a field or block of the wrong type (the message names it), and
any other unknown field. Accepted and ignored, as they change nothing the policy samples: ``metadata``,
``service_tier``, ``cache_control`` (also on blocks and tools), ``output_config.effort``, ``thinking``
``disabled``/``adaptive``, ``speed``, ``inference_geo``, ``diagnostics``, ``workspace_id``, ``user_profile_id``.
``max_tokens`` is required by the API and the SDK; omitted here, it means the rest of the context. (anthropic 2.x's
``messages.create`` no longer takes ``temperature``; harnesses that send it anyway must send the run's.)

The shapes are written by hand from Anthropic's API reference: no library translates this wire to a chat template.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .checks import RequestError, check_fields, check_max_tokens, check_tools, need, refuse, short, text_of

_FIELDS = {  # every field a request may hold, with its type; any other field is refused
    "model": "a string", "messages": "a list", "system": "any JSON value", "max_tokens": "an integer",
    "tools": "a list", "tool_choice": "any JSON value", "temperature": "a number", "top_p": "a number",
    "top_k": "an integer", "stop_sequences": "a list", "stream": "a boolean", "thinking": "an object",
    "output_config": "an object",
    # no effect on sampling: accepted and ignored
    "metadata": "an object", "service_tier": "a string", "cache_control": "an object", "diagnostics": "any JSON value",
    "inference_geo": "a string", "speed": "a string", "workspace_id": "a string", "user_profile_id": "a string"}
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "request_too_large", 500: "api_error"}


def _conversation(body: dict) -> list[dict]:
    """The Anthropic conversation as Hugging Face chat messages (tool-call arguments as dicts)."""
    out = []
    if body.get("system") is not None:
        system = text_of(body["system"], "system", "text blocks")
        out += [{"role": "system", "content": system}] if system else []
    messages = body.get("messages")
    need(isinstance(messages, list) and bool(messages), "messages",
         "a non-empty list of {'role': 'user' or 'assistant', 'content': ...}", messages)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        need(isinstance(m, dict), where, "an object like {'role': 'user', 'content': '...'}", m)
        need(m.get("role") in ("user", "assistant"), f"{where}.role",
             "user or assistant (the system prompt is the request's `system`)", m.get("role"))
        blocks = m.get("content")
        blocks = [{"type": "text", "text": blocks}] if isinstance(blocks, str) else blocks
        need(isinstance(blocks, list), f"{where}.content", "a string or a list of content blocks", blocks)
        texts, calls = [], []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            need(isinstance(b, dict), at, "a content block like {'type': 'text', 'text': '...'}", b)
            kind = b.get("type")
            if kind == "text":
                need(isinstance(b.get("text"), str), f"{at}.text", "a string", b.get("text"))
                texts.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                need(isinstance(b.get("name"), str), f"{at}.name", "a string (the tool's name)", b.get("name"))
                need(b.get("input") is None or isinstance(b["input"], dict), f"{at}.input",
                     "an object (the tool's arguments)", b.get("input"))
                calls.append({"type": "function", "function": {"name": b["name"], "arguments": b.get("input") or {}}})
            elif kind == "tool_result" and m["role"] == "user":
                out.append({"role": "tool", "content": text_of(b.get("content", ""), f"{at}.content", "text blocks")})
            else:
                raise refuse(f"{at}: a {short(kind)} block is not supported in a {m['role']} message "
                             "(text, tool_use from the assistant, tool_result from the user)", at,
                             "unsupported_content")
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _function_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    need(isinstance(tools, list), "tools", "a list of {'name', 'description', 'input_schema'}", tools)
    out = []
    for i, t in enumerate(tools):
        if isinstance(t, dict) and t.get("type") not in (None, "custom"):
            raise refuse(f"tools[{i}]: the server tool {short(t.get('type'))} runs on Anthropic's side and is not "
                         "available here; define it as a client tool (name, description, input_schema) and run it "
                         "in your agent", f"tools[{i}]", "unsupported_tool")
        if (not isinstance(t, dict) or not isinstance(t.get("input_schema"), dict)
                or not isinstance(t.get("description", ""), str)):
            raise RequestError(400, f"tools[{i}] is malformed ({short(t)}): expected {{'name': str, 'description': "
                                    "str, 'input_schema': JSON schema object}", f"tools[{i}]", "invalid_tool_schema")
        out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                     "parameters": t["input_schema"]}})
    return out


def api_key(request) -> str:
    key = request.headers.get("x-api-key")
    return key.strip() if key else request.headers.get("authorization", "").removeprefix("Bearer ").strip()


def parse(body: dict, max_context: int, tools_ok: bool) -> tuple[list[dict], list | None, int | None]:
    check_fields(body, _FIELDS, "the run trains on what the policy samples at its own settings, so fields that "
                                "change sampling or need Anthropic's servers (and ones this endpoint does not know) "
                                "are refused")
    if body.get("top_k") is not None:
        raise refuse("top_k changes sampling and is not supported; omit it", "top_k")
    if body.get("stop_sequences"):
        raise refuse("stop_sequences would cut the policy's reply short of what it sampled; omit them",
                     "stop_sequences")
    thinking = body.get("thinking")
    if thinking is not None and thinking.get("type") not in ("disabled", "adaptive"):
        raise refuse("extended thinking with a budget is not supported: the policy's reasoning is whatever its "
                     "chat template renders; omit `thinking` (or use adaptive)", "thinking")
    if (body.get("output_config") or {}).get("format"):
        raise refuse("output_config.format (structured outputs) needs constrained decoding, which would change "
                     "what the policy samples; omit it", "output_config")
    choice = body.get("tool_choice")
    kind = choice.get("type", "(no type)") if isinstance(choice, dict) else choice
    if kind not in (None, "auto", "none") or (isinstance(choice, dict) and kind is None):
        raise refuse(f"tool_choice {short(kind)} is not supported (forcing a tool needs constrained decoding); "
                     "use auto or none", "tool_choice")
    tools = check_tools(_function_tools(body.get("tools")), kind, tools_ok)
    max_tokens = check_max_tokens(body.get("max_tokens"), "max_tokens", max_context)
    return _conversation(body), tools, max_tokens


def error_body(err: RequestError) -> dict:
    # Anthropic says "prompt is too long" for a conversation past the context; harnesses look for those words
    message = f"prompt is too long: {err.message}" if err.code == "context_length_exceeded" else err.message
    return {"type": "error", "error": {"type": _KINDS.get(err.status, "api_error"), "message": message}}


def reply_body(body: dict, message: dict, out, prompt_tokens: int) -> dict:
    """The turn's ``message`` (``events``: as Anthropic's event stream)."""
    content: list[dict] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    content += [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": c["function"]["name"],
                 "input": c["function"]["arguments"]} for c in message.get("tool_calls", [])]
    stop = "tool_use" if message.get("tool_calls") else "max_tokens" if out.finish_reason == "length" else "end_turn"
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": body["model"], "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(out.token_ids)}}


async def events(reply: dict):
    """The reply as Anthropic's server-sent events: one delta per content block."""
    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    start = {**reply, "content": [], "stop_reason": None, "usage": {**reply["usage"], "output_tokens": 0}}
    yield event("message_start", {"message": start})
    for i, block in enumerate(reply["content"]):
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_start", {"index": i, "content_block": first})
        yield event("content_block_delta", {"index": i, "delta": delta})
        yield event("content_block_stop", {"index": i})
    yield event("message_delta", {"delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
                                  "usage": {"output_tokens": reply["usage"]["output_tokens"]}})
    yield event("message_stop", {})

