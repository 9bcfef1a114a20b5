"""A loopback endpoint in front of the engine that speaks the OpenAI and the Anthropic wire, so agents written with
either stock client (or any harness built on one) run unchanged and still train only on the engine's tokens.

Each run serves ``POST /v1/chat/completions``, ``POST /v1/messages`` (Anthropic's Messages API, translated in
``molt_lightning.agents.wire.anthropic_messages``) and ``GET /v1/models`` on 127.0.0.1, on the engine's event loop,
where the agents run too. A request is tied to its trajectory by its API key: every agent run gets its own key
(``client.api_key``) next to the shared ``client.base_url``, so an agent does
``openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)`` and nothing else changes (``client.openai()``
gives the same client cheaper: one shared connection pool, this run's key). The endpoint knows an agent run only
through the narrow ``Session`` interface (its temperature, context and whether it takes tools; one turn; a note in its
record), which ``AgentClient`` implements: the policy's chat template renders the messages and tools, only the
template delta since the previous turn is tokenized, the assistant's tokens are the engine's (never re-tokenized), a
rewritten history starts a new segment, and tool calls are parsed with the tokenizer's ``response_template``.

Supported: ``messages`` (text content, or lists of text parts), ``tools`` with ``tool_choice`` ``auto``/``none``,
``max_tokens``/``max_completion_tokens``, ``n=1``, ``stream`` (the whole reply as one chunk, then the finish chunk),
and ``temperature``/``top_p`` only at the run's own values (the trainer recomputes logprobs under the run's sampling
distribution, so another one would make its importance weights wrong). Everything else that changes sampling
(``stop``, ``logit_bias``, ``response_format``, forced tool choice, ``n>1``, images) is refused with an OpenAI-style
400 naming the parameter. Every refused request is also recorded in its trajectory (``info["endpoint_errors"]``) and
counted in the step metrics (``agent/endpoint_error/<code>``). Both wires share all of this (``_turn``); each only
parses its request into chat messages and tools and shapes the reply and its errors (``openai_chat``,
``anthropic_messages``).

Bad input is answered, never crashed on and never trained on: a body past ``max_body`` (4 MiB by default) gets 413; a
body that is not a UTF-8 JSON object (truncated, NaN, nested too deeply, lone surrogates), a field of the wrong type,
an unknown field, garbage inside a message, tool or block, and a conversation the chat template refuses get 400 naming
the field and the fix; unknown routes and methods get 404/405 in the wire's error shape. A turn that fails after
checking (a context overflow, a template error) is undone: the trajectory keeps no token, span or segment break of it.
Unknown fields are refused (they might change sampling); the fields accepted and ignored are listed in
``openai_chat._FIELDS`` (``anthropic_messages._FIELDS``) and in docs/agents.md. Message keys other than ``role``,
``content`` and ``tool_calls`` are ignored.

The HTTP layer is Starlette on uvicorn (both come with vLLM); request validation and the OpenAI response shapes are
written here by hand: they are the part no library offers without pulling in a serving engine.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from functools import partial
from typing import Any, Protocol

from starlette.responses import JSONResponse, StreamingResponse

from ...config import check_host, imported
from ...trajectory import ContextOverflow
from . import anthropic_messages, openai_chat
from .checks import RequestError, check_sampling, json_object, need, short

log = logging.getLogger(__name__)
_ROUTES = "POST /v1/chat/completions, POST /v1/messages, GET /v1/models and GET /v1/models/{model}"


class Session(Protocol):
    """What the endpoint needs of one agent run (``AgentClient`` is one)."""

    temperature: float  # the run's sampling temperature and top-p: a request may only ask for them
    top_p: float
    max_context: int  # the longest token sequence the run's segments may hold
    handles_tools: bool  # whether the policy's chat template renders tools and its tokenizer parses calls

    async def serve(self, messages: list[dict], max_tokens: int | None, tools: list | None
                    ) -> tuple[dict, Any, int]:
        """One turn (one at a time, undone if it fails): the assistant message, the engine's ``Generation`` and the
        prompt's token count."""

    def note(self, key: str, text: str, counter: str) -> None:
        """Keep ``text`` in the trajectory's ``info[key]`` and count it (``agent/<counter>``)."""


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
        self.sessions: dict[str, Session] = {}
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only then; without it the reply's body waits ~40 ms for the
        # client's delayed ACK on every request after a connection's first (uvicorn writes headers and body apart)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.bind((host, 0))
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
        self.root_url = f"http://{shown}:{self.sock.getsockname()[1]}"  # ANTHROPIC_BASE_URL (the SDK adds /v1)
        self.base_url = f"{self.root_url}/v1"  # OPENAI_BASE_URL
        self._server = self._task = None
        self._sdks: dict[str, Any] = {}  # the stock clients made so far

    def openai(self, api_key: str):
        """A stock ``openai.AsyncOpenAI`` for this endpoint with ``api_key``, sharing one HTTP connection pool: building
        a fresh client costs more CPU (its TLS context) than a tiny policy's whole turn."""
        return self._sdk("openai.AsyncOpenAI", self.base_url, api_key)

    def anthropic(self, api_key: str):
        """A stock ``anthropic.AsyncAnthropic`` for this endpoint with ``api_key``, sharing one connection pool."""
        return self._sdk("anthropic.AsyncAnthropic", self.root_url, api_key)

    def _sdk(self, name: str, base_url: str, api_key: str):
        if name not in self._sdks:  # made once (one connection pool), closed by ``stop``
            self._sdks[name] = imported(name, "the stock client")(base_url=base_url, api_key="unset", max_retries=0)
        return self._sdks[name].with_options(api_key=api_key)

    # ----- lifecycle (on the engine loop) -----
    async def start(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/v1/chat/completions", partial(self._turn, wire=openai_chat), methods=["POST"]),
                                Route("/v1/messages", partial(self._turn, wire=anthropic_messages), methods=["POST"]),
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
        for sdk in self._sdks.values():
            await sdk.close()
        self._sdks.clear()
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 10)
            self._server = None
        self.sock.close()

    def register(self, session: Session, label: str) -> str:
        """A new API key for ``session`` (its trajectory's handle here), until ``unregister``."""
        prefix = f"{self.token}-" if self.token else ""
        key = f"{prefix}molt-{label}-{secrets.token_hex(6)}"
        self.sessions[key] = session
        return key

    def unregister(self, key: str) -> None:
        self.sessions.pop(key, None)

    # ----- routes -----
    async def _models(self, request):
        return JSONResponse({"object": "list", "data": [_model_card(name) for name in self.model_names]})

    async def _model(self, request):
        name = request.path_params["model"]
        if name in self.model_names:
            return JSONResponse(_model_card(name))
        return JSONResponse(self._unknown_model(name).body(), status_code=404)

    def _unknown_model(self, name: str) -> RequestError:
        return RequestError(404, f"the model {short(name)} does not exist: this run serves {self.model_names}", "model",
                            "model_not_found")

    async def _no_route(self, request, exc):
        """An unknown route or method: an error in the wire's shape (Anthropic's under /v1/messages), not bare text."""
        wire = anthropic_messages if request.url.path.startswith("/v1/messages") else openai_chat
        what = "route" if exc.status_code == 404 else "method for"
        err = RequestError(exc.status_code, f"no {what} {request.method} {short(request.url.path)}: this endpoint "
                                            f"serves {_ROUTES} (legacy completions, embeddings and the rest of the "
                                            "APIs are not served)", None, "not_found" if exc.status_code == 404
                           else "method_not_allowed")
        return JSONResponse(wire.error_body(err), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def _turn(self, request, wire):
        """One assistant turn for a request in ``wire``'s format (the module ``openai_chat`` or ``anthropic_messages``):
        the key names the trajectory; a refused or failed request is answered in the wire's error shape, recorded in
        the trajectory and counted."""
        session = self.sessions.get(wire.api_key(request))
        try:
            raw = await self._body(request)
            if session is None:
                raise RequestError(401, "unknown API key: each agent run has its own key, client.api_key (pass it "
                                        "as openai.AsyncOpenAI(api_key=client.api_key) or anthropic.AsyncAnthropic("
                                        "api_key=client.api_key)); a finished run's key is no longer valid",
                                   code="invalid_api_key", kind="authentication_error")
            body = json_object(raw)
            model = body.get("model")
            need(isinstance(model, str), "model", f"a string naming one of {self.model_names}", model)
            if model not in self.model_names:
                raise self._unknown_model(model)
            check_sampling(body, session.temperature, session.top_p)
            messages, tools, max_tokens = wire.parse(body, session.max_context, session.handles_tools)
            message, out, prompt_tokens = await session.serve(messages, max_tokens, tools)
        except Exception as e:  # refused, or ContextOverflow and friends (the client's own clear errors)
            err = _request_error(e)
            if session is not None:  # recorded in the trajectory and counted
                session.note("endpoint_errors", f"{err.status} {err.code}: {err.message}"[:500],
                             f"endpoint_error/{err.code or err.status}")
            return JSONResponse(wire.error_body(err), status_code=err.status)
        if "unparsed" in message:
            session.note("unparsed_tool_calls", message["unparsed"], "unparsed_tool_calls")
        reply = wire.reply_body(body, message, out, prompt_tokens)
        if body.get("stream"):
            return StreamingResponse(wire.events(reply), media_type="text/event-stream")
        return JSONResponse(reply)

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
                                    "(molt_lightning.agents.wire.endpoint.Endpoint.MAX_BODY = ... before the run "
                                    "starts)", None,
                                   "request_too_large")
        return b"".join(chunks)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "molt-lightning"}


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
