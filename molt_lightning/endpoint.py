"""A loopback endpoint in front of the engine that speaks the OpenAI and the Anthropic wire, so agents written with
either stock client (or any harness built on one) run unchanged and still train only on the engine's tokens.

Each run serves ``POST /v1/chat/completions``, ``POST /v1/messages`` (Anthropic's Messages API, translated in
``molt_lightning.anthropic_messages``) and ``GET /v1/models`` on 127.0.0.1, on the engine's event loop,
where the agents run too. A request is tied to its trajectory by its API key: every agent run gets its own key
(``client.api_key``) next to the shared ``client.base_url``, so an agent does
``openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)`` and nothing else changes (``client.openai()``
gives the same client cheaper: one shared connection pool, this run's key). Every request goes
through ``AgentClient.chat_turn``: the policy's chat template renders the messages and tools, only the template
delta since the previous turn is tokenized, the assistant's tokens are the engine's (never re-tokenized), a rewritten
history starts a new segment, and tool calls are parsed with the tokenizer's ``response_template``.

Supported: ``messages`` (text content, or lists of text parts), ``tools`` with ``tool_choice`` ``auto``/``none``,
``max_tokens``/``max_completion_tokens``, ``n=1``, ``stream`` (the whole reply as one chunk, then the finish chunk),
and ``temperature``/``top_p`` only at the run's own values (the trainer recomputes logprobs under the run's sampling
distribution, so another one would make its importance weights wrong). Everything else that changes sampling
(``stop``, ``logit_bias``, ``response_format``, forced tool choice, ``n>1``, images) is refused with an OpenAI-style
400 naming the parameter. Every refused request is also recorded in its trajectory (``info["endpoint_errors"]``) and
counted in the step metrics (``agent/endpoint_error/<code>``). Both wires share all of this (``_turn``); each only
parses its request into chat messages and tools and shapes the reply and its errors.

Bad input is answered, never crashed on and never trained on: a body past ``max_body`` (4 MiB by default) gets 413; a
body that is not a UTF-8 JSON object (truncated, NaN, nested too deeply, lone surrogates), a field of the wrong type,
an unknown field, garbage inside a message, tool or block, and a conversation the chat template refuses get 400 naming
the field and the fix; unknown routes and methods get 404/405 in the wire's error shape. A turn that fails after
checking (a context overflow, a template error) is undone: the trajectory keeps no token, span or segment break of it.
Unknown fields are refused (they might change sampling); the fields accepted and ignored are listed in ``_FIELDS``
and in docs/agents.md. Message keys other than ``role``, ``content`` and ``tool_calls`` are ignored.

The HTTP layer is Starlette on uvicorn (both come with vLLM); request validation and the OpenAI response shapes are
written here by hand: they are the part no library offers without pulling in a serving engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

from .trajectory import ContextOverflow
from .wire import (RequestError, check_fields, check_max_tokens, check_sampling, check_tools, lone_surrogate, need,
                   short, text_of)

if TYPE_CHECKING:
    from .client import AgentClient

log = logging.getLogger("molt_lightning.endpoint")
_FIELDS = {  # every field a chat completion request may hold, with its type; any other field is refused
    "model": "a string", "messages": "a list", "tools": "a list", "tool_choice": "any JSON value",
    "max_tokens": "an integer", "max_completion_tokens": "an integer", "n": "an integer", "stream": "a boolean",
    "temperature": "a number", "top_p": "a number", "logprobs": "a boolean", "frequency_penalty": "a number",
    "presence_penalty": "a number",
    # accepted and ignored: they change nothing the policy samples
    "stream_options": "an object", "user": "a string", "seed": "an integer", "parallel_tool_calls": "a boolean",
    "metadata": "an object", "store": "a boolean", "service_tier": "a string", "prompt_cache_key": "a string",
    "safety_identifier": "a string"}
_ROUTES = "POST /v1/chat/completions, POST /v1/messages, GET /v1/models and GET /v1/models/{model}"
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate (paired, or a lone one)
_MAX_ERRORS = 100  # endpoint_errors kept per trajectory (the counter counts them all)


def check_host(host: str, token: str | None) -> None:
    """The endpoint stays on loopback unless a token guards it."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ValueError(f"endpoint host {host!r} is not an IP address (e.g. 127.0.0.1, or an interface's "
                         "address for harnesses in other namespaces)") from None
    if not loopback and not token:
        raise ValueError(f"binding the endpoint to {host} exposes the policy beyond this machine's loopback: set "
                         "model.rollout.endpoint_token to a secret too (every session key then carries it), or "
                         "keep endpoint_host at 127.0.0.1")


class Endpoint:
    """Serves the engine to the agents of one rollout source, on that source's event loop."""

    MAX_BODY = 4 << 20  # bytes: the default request body limit (413 past it)

    def __init__(self, model_names: list[str], temperature: float, host: str = "127.0.0.1", token: str | None = None,
                 max_body: int | None = None):
        """``host``: the address to listen on, loopback unless a ``token`` is given too (every session key then
        starts with it, so nobody who can reach the port can guess a session). ``max_body``: the largest request
        body in bytes (default ``Endpoint.MAX_BODY``, 4 MiB); a larger one is answered 413."""
        check_host(host, token)
        self.model_names, self.temperature, self.token = model_names, temperature, token
        self.max_body = self.MAX_BODY if max_body is None else max_body
        self.clients: dict[str, AgentClient] = {}
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only then; without it the reply's body waits ~40 ms for the
        # client's delayed ACK on every request after a connection's first (uvicorn writes headers and body apart)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.bind((host, 0))
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
        self.root_url = f"http://{shown}:{self.sock.getsockname()[1]}"  # ANTHROPIC_BASE_URL (the SDK adds /v1)
        self.base_url = f"{self.root_url}/v1"  # OPENAI_BASE_URL
        self._server = self._task = self._openai = self._anthropic = None

    def openai(self, api_key: str):
        """A stock ``openai.AsyncOpenAI`` for this endpoint with ``api_key``, sharing one HTTP connection pool: building
        a fresh client costs more CPU (its TLS context) than a tiny policy's whole turn."""
        if self._openai is None:
            import openai

            self._openai = openai.AsyncOpenAI(base_url=self.base_url, api_key="unset", max_retries=0)
        return self._openai.with_options(api_key=api_key)

    def anthropic(self, api_key: str):
        """A stock ``anthropic.AsyncAnthropic`` for this endpoint with ``api_key``, sharing one connection pool."""
        if self._anthropic is None:
            import anthropic

            self._anthropic = anthropic.AsyncAnthropic(base_url=self.root_url, api_key="unset", max_retries=0)
        return self._anthropic.with_options(api_key=api_key)

    # ----- lifecycle (on the engine loop) -----
    async def start(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]),
                                Route("/v1/messages", self._messages, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"]),
                                Route("/v1/models/{model:path}", self._model, methods=["GET"])],
                        exception_handlers={404: self._no_route, 405: self._no_route})
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the server's start-up error
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for name in ("_openai", "_anthropic"):
            if getattr(self, name) is not None:
                await getattr(self, name).close()
                setattr(self, name, None)
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 10)
            self._server = None
        self.sock.close()

    def register(self, client: AgentClient, label: str) -> None:
        """Give ``client`` its own API key (the trajectory's handle) and the endpoint's URL."""
        prefix = f"{self.token}-" if self.token else ""
        client.api_key, client.endpoint = f"{prefix}molt-{label}-{secrets.token_hex(6)}", self
        self.clients[client.api_key] = client

    def unregister(self, client: AgentClient) -> None:
        self.clients.pop(client.api_key, None)

    # ----- routes -----
    async def _models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [_model_card(name) for name in self.model_names]})

    async def _model(self, request):
        from starlette.responses import JSONResponse

        name = request.path_params["model"]
        if name in self.model_names:
            return JSONResponse(_model_card(name))
        err = RequestError(404, f"the model {short(name)} does not exist: this run serves {self.model_names}", "model",
                           "model_not_found")
        return JSONResponse(err.body(), status_code=404)

    async def _no_route(self, request, exc):
        """An unknown route or method: an error in the wire's shape (Anthropic's under /v1/messages), not bare text."""
        from starlette.responses import JSONResponse

        from . import anthropic_messages

        wire = anthropic_messages.WIRE if request.url.path.startswith("/v1/messages") else _OPENAI
        what = "route" if exc.status_code == 404 else "method for"
        err = RequestError(exc.status_code, f"no {what} {request.method} {short(request.url.path)}: this endpoint "
                                            f"serves {_ROUTES} (legacy completions, embeddings and the rest of the "
                                            "APIs are not served)", None, "not_found" if exc.status_code == 404
                           else "method_not_allowed")
        return JSONResponse(wire.error_body(err), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def _chat(self, request):
        return await self._turn(request, _OPENAI)

    async def _messages(self, request):
        from . import anthropic_messages

        return await self._turn(request, anthropic_messages.WIRE)

    async def _turn(self, request, wire):
        """One assistant turn for a request in ``wire``'s format (OpenAI chat completions or Anthropic messages): the
        key names the trajectory; a refused or failed request is answered in the wire's error shape, recorded in the
        trajectory and counted."""
        from starlette.responses import JSONResponse

        client = self.clients.get(wire.api_key(request))
        try:
            raw = await self._body(request)
            if client is None:
                raise RequestError(401, "unknown API key: each agent run has its own key, client.api_key (pass it "
                                        "as openai.AsyncOpenAI(api_key=client.api_key) or anthropic.AsyncAnthropic("
                                        "api_key=client.api_key)); a finished run's key is no longer valid",
                                   code="invalid_api_key", kind="authentication_error")
            body = _json_object(raw)
            model = body.get("model")
            need(isinstance(model, str), "model", f"a string naming one of {self.model_names}", model)
            if model not in self.model_names:
                raise RequestError(404, f"the model {short(model)} does not exist: this run serves "
                                        f"{self.model_names}", "model", "model_not_found")
            check_sampling(body, client.temperature)
            messages, tools, max_tokens = wire.parse(body, client)
            floor = client.template.min_tokens(messages)  # a 4 MB conversation is refused before it is rendered
            if floor + (max_tokens or 1) > client.max_context:
                raise RequestError(400, f"the conversation is at least {floor:,} tokens (its text over the longest "
                                        f"token), past this run's context of {client.max_context} tokens: shorten it "
                                        "(cut long tool results, drop old turns)", "messages",
                                   "context_length_exceeded")
            async with client.lock:
                kept = _record_of(client)
                try:
                    message, out = await client.chat_turn(messages, max_tokens=max_tokens, tools=tools)
                except BaseException:  # nothing of a refused or failed turn stays: no token, no segment break
                    _restore(client, kept)
                    raise
        except Exception as e:  # refused, or ContextOverflow and friends (the client's own clear errors)
            err = _request_error(e)
            if client is not None:  # recorded in the trajectory and counted
                errors = client.trajectory.info.setdefault("endpoint_errors", [])
                if len(errors) < _MAX_ERRORS:
                    errors.append(f"{err.status} {err.code}: {err.message}"[:500])
                client.count(f"endpoint_error/{err.code or err.status}")
            return JSONResponse(wire.error_body(err), status_code=err.status)
        if "unparsed" in message:
            client.trajectory.info.setdefault("unparsed_tool_calls", []).append(message["unparsed"])
            client.count("unparsed_tool_calls")
        return wire.respond(body, message, out, prompt_tokens=len(client.tokens) - len(out.token_ids))

    async def _body(self, request) -> bytes:
        """The request body, refused with 413 past ``max_body`` bytes (by its Content-Length, or as it streams in).
        The rest of a too large body is read and dropped, up to 16 times the limit, so that the client, still
        sending, gets the 413 rather than a reset connection."""
        size = request.headers.get("content-length", "")
        too_large = size.isdigit() and int(size) > self.max_body
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            too_large = too_large or n > self.max_body
            if not too_large:
                chunks.append(chunk)
            elif n > 16 * self.max_body:
                break
        if too_large:
            got = f"{int(size):,} bytes" if size.isdigit() else f"over {self.max_body:,} bytes"
            raise RequestError(413, f"the request body is {got}, more than this endpoint takes ({self.max_body:,} "
                                    "bytes): shorten the conversation or its tool results, or raise the limit "
                                    "(molt_lightning.endpoint.Endpoint.MAX_BODY = ... before the run starts)", None,
                                   "request_too_large")
        return b"".join(chunks)


class _OpenAIWire:
    """``POST /v1/chat/completions``: OpenAI's request, response, stream and error shapes."""

    @staticmethod
    def api_key(request) -> str:
        return request.headers.get("authorization", "").removeprefix("Bearer ").strip()

    @staticmethod
    def parse(body: dict, client: AgentClient) -> tuple[list[dict], list | None, int | None]:
        check_fields(body, _FIELDS, "the run trains on what the policy samples at its own settings, so parameters "
                                    "that change sampling (and ones this endpoint does not know) are refused")
        for name in ("frequency_penalty", "presence_penalty"):
            if body.get(name):
                raise RequestError(400, f"{name} changes sampling and is not supported; omit it", name,
                                   "unsupported_value")
        if body.get("logprobs"):
            raise RequestError(400, "logprobs are not returned here (the trainer keeps the engine's own); omit "
                                    "logprobs", "logprobs", "unsupported_value")
        if body.get("n") not in (None, 1):
            raise RequestError(400, "n must be 1: the run samples the group itself (model.group_size)", "n",
                               "unsupported_value")
        max_tokens = check_max_tokens(body.get("max_tokens"), "max_tokens", client.max_context)  # None: the rest
        max_tokens = check_max_tokens(body.get("max_completion_tokens"), "max_completion_tokens",
                                      client.max_context) or max_tokens  # the newer name wins
        tools = check_tools(body.get("tools"), body.get("tool_choice"), client)
        messages = body.get("messages")
        need(isinstance(messages, list) and bool(messages), "messages",
             "a non-empty list of {'role': ..., 'content': ...}", messages)
        return [hf_message(m, i) for i, m in enumerate(messages)], tools, max_tokens

    @staticmethod
    def error_body(err: RequestError) -> dict:
        return err.body()

    @staticmethod
    def respond(body: dict, message: dict, out, prompt_tokens: int):
        from starlette.responses import JSONResponse, StreamingResponse

        reply = _openai_message(message)
        finish = "tool_calls" if reply.get("tool_calls") else out.finish_reason
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:16]}"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
                 "total_tokens": prompt_tokens + len(out.token_ids)}
        if body.get("stream"):
            return StreamingResponse(_chunks(cid, created, body["model"], reply, finish),
                                     media_type="text/event-stream")
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": body["model"],
                             "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
                             "usage": usage})


_OPENAI = _OpenAIWire()


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


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "molt-lightning"}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (use a finite number)")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _json_object(raw: bytes) -> dict:
    """The request body as a JSON object; refused (400) unless it is one, in UTF-8, with finite numbers and Unicode
    strings."""
    if not raw.strip():
        raise RequestError(400, 'the request body is empty: send a JSON object, e.g. {"model": "policy", '
                                '"messages": [...]}', None, "invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise RequestError(400, "the request body nests JSON too deeply to parse: flatten it", None,
                           "invalid_json") from None
    except ValueError as e:  # UnicodeDecodeError is one
        raise RequestError(400, f"the request body is not JSON ({str(e)[:120]}): send a JSON object encoded as "
                                "UTF-8", None, "invalid_json") from None
    need(isinstance(body, dict), "the request body", "a JSON object", body)
    where = lone_surrogate(body) if _SURROGATE.search(raw) else None
    if where is not None:
        raise RequestError(400, f"{where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                                "pair): no Unicode text; send valid Unicode", where, "invalid_type")
    return body


def _request_error(e: Exception) -> RequestError:
    """Any failure of a request as the error it is answered with: 400 for what the request asked (a context overflow,
    JSON too deep, a conversation the chat template refuses), 500 for a failure of the run's own."""
    from jinja2 import TemplateError
    from starlette.requests import ClientDisconnect

    if isinstance(e, RequestError):
        return e
    if isinstance(e, ContextOverflow):
        return RequestError(400, f"ContextOverflow: {e}", "messages", "context_length_exceeded")
    if isinstance(e, RecursionError):
        return RequestError(400, "the request nests too deeply to render (tool schemas, arguments): flatten it",
                            None, "invalid_request")
    if isinstance(e, TemplateError):
        return RequestError(400, f"the policy's chat template cannot render these messages: {str(e)[:200]}; "
                                 "send a conversation it accepts (e.g. roles in the order it expects)", "messages",
                            "template_error")
    if isinstance(e, ClientDisconnect):
        return RequestError(400, "the client disconnected before the whole request body arrived")
    return RequestError(500, f"{type(e).__name__}: {str(e)[:300]}", None, None, "server_error")


def _record_of(client: AgentClient) -> tuple:
    """What a turn changes in a client and its trajectory, to put back if the turn fails (``_restore``)."""
    t = client.trajectory
    return ([list(seg) for seg in t.segments], t.turns, t.status, t.reason, client._messages, client._tools,
            client._last_gen, client._requests)


def _restore(client: AgentClient, kept: tuple) -> None:
    t = client.trajectory
    segments, t.turns, t.status, t.reason, client._messages, client._tools, client._last_gen, client._requests = kept
    t.segments[:] = segments


def _openai_message(message: dict) -> dict:
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        reply["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in message["tool_calls"]]
    return reply


async def _chunks(cid: str, created: int, model: str, reply: dict, finish: str):
    def event(delta: dict, finish_reason: str | None) -> str:
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(chunk)}\n\n"

    delta = dict(reply)
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    yield event(delta, None)
    yield event({}, finish)
    yield "data: [DONE]\n\n"
