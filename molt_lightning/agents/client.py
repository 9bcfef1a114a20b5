"""The client an agent program talks to: token-level generation and chat turns, recorded as one trajectory.

An agent is ``async def agent(client, sample) -> float | AgentResult``. Whatever it asks for, the client appends to
the trajectory's current segment: context it supplies (prompt or environment tokens, never trained on) and the
engine's output (policy tokens, each with its engine logprob and version). The agent never sees a way to put a
policy token into the record that the engine did not return.

Agents written against the stock OpenAI client use ``client.base_url`` and ``client.api_key`` instead: the run's
loopback endpoint (``wire.endpoint``) serves each request through ``serve`` (a checked, locked, undoable
``chat_turn``) of the client whose key it carries: the client is the endpoint's ``Session``. ``sessions.AgentSessions``
sets up what the clients of a run share and makes each agent run's client.

Images (vision-language policies): messages may hold image content parts; ``chat_turn`` gets their expanded token
ids and pixel values from the template (the policy's processor), puts the pixel values on the context span that holds
their image tokens (``Span.images``), and sends the engine every image of the segment with its prompt. A reply in
which the policy sampled the image placeholder token itself cannot be trained on (the trainer's forward would read
it as an image the engine never saw): the client raises ``GeneratedImagePlaceholder`` and the trajectory fails,
counted like any agent failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import Generation, RolloutEngine, Sampling
from ..policies.vision import ImageInputs
from ..trajectory import ContextOverflow, Kind, Span, Trajectory, Truncation, place_routing, segment_images
from .chat import ChatTemplate, Message

MAX_NOTES = 100  # texts kept per key of a trajectory's info by ``note`` (the counter counts them all)


@dataclass
class AgentResult:
    """What an agent may return instead of a bare float reward.

    ``turn_rewards``: one reward per turn (a turn is one engine call: one ``generate``/``chat`` or one endpoint
    request, in order), for the turn-level estimators (``turn_grpo``, ``gigpo``); without them a trajectory's reward
    counts as its last turn's. ``turn_keys``: one hashable state key per turn (e.g. the observation the turn acted
    on); GiGPO compares the turns of a group that share a key. A list of the wrong length fails the trajectory."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    turn_rewards: list[float] | None = None
    turn_keys: list | None = None


class GeneratedImagePlaceholder(RuntimeError):
    """The policy sampled a vision-language policy's image placeholder token."""


class AgentClient:
    def __init__(self, engine: RolloutEngine, trajectory: Trajectory, template: ChatTemplate | None,
                 temperature: float, max_context: int, seed: int | None = None,
                 counter: Callable[[str, int], None] | None = None, top_p: float = 1.0):
        self.engine, self.trajectory, self.template = engine, trajectory, template
        self.temperature, self.max_context, self.top_p = temperature, max_context, top_p
        self.seed, self._requests = seed, 0  # request k samples with seed + k (None: the engine's shared stream)
        self._counter = counter
        self._messages: list[Message] | None = None  # what the current segment's tokens render (chat mode)
        self._last_gen: list[int] = []
        self._tools: list | None = None  # the tools the current segment was rendered with
        self.endpoint = None  # the run's OpenAI-compatible endpoint, when one serves this client (``AgentSessions``)
        self.api_key: str | None = None  # this run's key there: it ties the endpoint's requests to this trajectory
        self._lock = asyncio.Lock()  # the endpoint serves one request of a trajectory at a time
        # every engine stops a turn on the ids the template closes turns after (chat.end_of_turn_ids)
        self._end_ids = () if template is None else tuple(sorted(template.end_ids))

    @property
    def tokens(self) -> list[int]:
        """All token ids of the current segment, in order."""
        return [t for span in self.trajectory.segments[-1] for t in span.token_ids]

    def new_segment(self) -> None:
        """Start a new training sequence (for agents that rewrite their context)."""
        if self.trajectory.segments[-1]:
            self.trajectory.segments.append([])
        self._messages, self._last_gen = None, []

    @contextmanager
    def undone_on_failure(self):
        """A turn that raises inside leaves this client and its trajectory as they were: no token, span, segment
        break, turn or request count of it stays (the endpoint's refused and failed turns)."""
        t = self.trajectory
        kept = ([list(seg) for seg in t.segments], t.turns, t.status, t.reason, t.truncation, self._messages,
                self._tools, self._last_gen, self._requests)
        try:
            yield
        except BaseException:
            (segments, t.turns, t.status, t.reason, t.truncation, self._messages, self._tools, self._last_gen,
             self._requests) = kept
            t.segments[:] = segments
            raise

    def add_context(self, token_ids: list[int], images: ImageInputs | None = None) -> None:
        """Append prompt (at a segment's start) or environment tokens: context the policy did not generate (with the
        pixel values of the images whose image tokens it holds, for a VLM)."""
        if token_ids:
            kind = Kind.ENV if self.trajectory.segments[-1] else Kind.PROMPT
            self.trajectory.segments[-1].append(Span.context(kind, token_ids, images))

    def attach(self, endpoint, label: str) -> None:
        """Serve this client's trajectory on ``endpoint`` (``wire.endpoint.Endpoint``) under a key of its own until
        ``detach`` (``AgentSessions`` does it for every agent run)."""
        self.endpoint, self.api_key = endpoint, endpoint.register(self, label)

    def detach(self) -> None:
        if self.endpoint is not None:
            self.endpoint.unregister(self.api_key)

    @property
    def handles_tools(self) -> bool:
        return self.template is not None and self.template.handles_tools

    def note(self, key: str, text: str, counter: str) -> None:
        """Keep ``text`` under the trajectory's ``info[key]`` (the first ``MAX_NOTES``) and count it (``count``)."""
        kept = self.trajectory.info.setdefault(key, [])
        if len(kept) < MAX_NOTES:
            kept.append(text)
        self.count(counter)

    def count(self, name: str, n: int = 1) -> None:
        """Count an agent-side event (a tool error, a refused request): the step metrics show ``agent/<name>`` (new
        this step) and ``agent/<name>_total``."""
        if self._counter is not None:
            self._counter(name, n)

    @property
    def base_url(self) -> str | None:
        """The run's OpenAI-compatible endpoint: ``openai.AsyncOpenAI(base_url=client.base_url,
        api_key=client.api_key)``."""
        return None if self.endpoint is None else self.endpoint.base_url

    def openai(self):
        """A stock ``openai.AsyncOpenAI`` bound to this trajectory: ``AsyncOpenAI(base_url=client.base_url,
        api_key=client.api_key)`` without the cost of building one (its TLS context; it shares the run's connection
        pool)."""
        if self.endpoint is None:
            raise RuntimeError("no OpenAI-compatible endpoint serves this client (it needs a chat template)")
        return self.endpoint.openai(self.api_key)

    @property
    def anthropic_base_url(self) -> str | None:
        """The same endpoint for the Anthropic SDK (``/v1/messages``; the SDK adds ``/v1``): ``anthropic.AsyncAnthropic(
        base_url=client.anthropic_base_url, api_key=client.api_key)``."""
        return None if self.endpoint is None else self.endpoint.root_url

    def anthropic(self):
        """A stock ``anthropic.AsyncAnthropic`` bound to this trajectory, sharing the run's connection pool."""
        if self.endpoint is None:
            raise RuntimeError("no endpoint serves this client (it needs a chat template)")
        return self.endpoint.anthropic(self.api_key)

    async def generate(self, context_ids: list[int] | None = None, *, max_tokens: int | None,
                       images: ImageInputs | None = None) -> Generation:
        """Append ``context_ids`` (and the ``images`` its image tokens stand for), then sample up to ``max_tokens``
        tokens (``None``: up to ``max_context``) continuing the whole segment."""
        n = len(self.tokens) + len(context_ids or [])  # checked before the context is appended: a refused call
        if not n:  # leaves the trajectory as it was
            raise ValueError("generate needs context: pass the prompt token ids")
        # None: the rest of the context (the limit is then the context's end); a max_tokens given is never cut down
        cause = Truncation.CONTEXT if max_tokens is None else Truncation.MAX_TOKENS
        max_tokens = self.max_context - n if max_tokens is None else max_tokens
        if max_tokens < 1 or n + max_tokens > self.max_context:
            raise ContextOverflow(f"segment of {n} tokens + max_tokens {max_tokens} exceeds max_context "
                                  f"{self.max_context}; start a new segment, shorten the context, or raise max_context")
        self.add_context(context_ids or [], images)
        seed = None if self.seed is None else self.seed + self._requests
        self._requests += 1
        t = self.trajectory  # route_key: an engine pool sends every turn of this trajectory to one engine
        sampling = Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed,
                            route_key=f"{t.group_id}/{t.member}", stop_token_ids=self._end_ids)
        out = await self.engine.generate(self.tokens, sampling, images=segment_images(t.segments[-1]))
        t.turns += 1  # a turn is an engine call: the agent's per-turn rewards count them (AgentResult)
        if out.token_ids:
            t.segments[-1].append(Span.policy(out.token_ids, out.logprobs, out.versions, turn=t.turns - 1))
        placeholder = None if self.template is None else self.template.image_token_id
        if placeholder is not None and placeholder in out.token_ids:
            raise GeneratedImagePlaceholder(
                f"the policy generated the image placeholder token (id {placeholder}): the trainer's forward would "
                "read it as an image, so this trajectory is not trained on")
        place_routing(self.trajectory.segments[-1], out.routing)  # MoE: each position keeps its first record
        if out.finish_reason == "length":
            self.trajectory.truncate(cause, f"a turn hit max_tokens={max_tokens}" if cause == Truncation.MAX_TOKENS
                                     else f"a turn hit the context's end (max_context={self.max_context})")
        return out

    async def chat(self, messages: list[Message], *, max_tokens: int) -> str:
        """One assistant turn for ``messages``; returns its text.

        Only the template delta since the previous turn is tokenized; if ``messages`` does not extend what this
        segment already holds (history rewritten), a new segment starts from the rendered conversation.
        """
        message, _ = await self.chat_turn(messages, max_tokens=max_tokens)
        return message["content"]

    async def chat_turn(self, messages: list[Message], *, max_tokens: int | None, tools: list | None = None,
                        ) -> tuple[Message, Generation]:
        """``chat`` with tools: the assistant message (``content``, parsed ``tool_calls``) and the engine's output.

        The segment continues when ``messages`` extends the conversation it holds (same tools); otherwise a new one
        starts. The OpenAI-compatible endpoint serves every request through this (``serve``)."""
        if self.template is None:
            raise ValueError("client.chat needs a tokenizer with a chat template")
        t, tools, seen = self.template, tools or None, self._messages or []
        extends = seen and tools == self._tools and len(messages) > len(seen) and messages[:len(seen)] == seen
        delta = t.delta_inputs(seen, messages[len(seen):], tools) if extends else None  # None: not stably rendered
        if delta is None:
            self.new_segment()
            context, images = t.prompt_inputs(messages, tools)
        else:
            context, images = t.close_turn_ids(self._last_gen) + delta[0], delta[1]
        out = await self.generate(context, max_tokens=max_tokens, images=images)
        message = t.parse_reply(out.token_ids, tools)
        self._messages = [*messages, {k: v for k, v in message.items() if k != "unparsed"}]
        self._tools, self._last_gen = tools, out.token_ids
        return message, out

    async def serve(self, messages: list[Message], max_tokens: int | None, tools: list | None
                    ) -> tuple[Message, Generation, int]:
        """The endpoint's turn (``wire.endpoint.Session``): refused before rendering when the conversation cannot fit,
        one at a time, and undone if it fails; returns the message, the engine's output and the prompt's tokens."""
        floor = self.template.min_tokens(messages)  # a 4 MB conversation is refused before it is rendered
        if floor + (max_tokens or 1) > self.max_context:
            raise ContextOverflow(f"the conversation is at least {floor:,} tokens (its text over the longest token), "
                                  f"past this run's context of {self.max_context} tokens: shorten it (cut long tool "
                                  "results, drop old turns)")
        async with self._lock:
            with self.undone_on_failure():  # nothing of a refused or failed turn stays: no token, no segment
                message, out = await self.chat_turn(messages, max_tokens=max_tokens, tools=tools)
        return message, out, len(self.tokens) - len(out.token_ids)
