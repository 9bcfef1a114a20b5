"""The client an agent program talks to: token-level generation and chat turns, recorded as one trajectory.

An agent is ``async def agent(client, sample) -> float | AgentResult``. Whatever it asks for, the client appends to
the trajectory's current segment: context it supplies (prompt or environment tokens, never trained on) and the
engine's output (policy tokens, each with its engine logprob and version). The agent never sees a way to put a
policy token into the record that the engine did not return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .chat import ChatTemplate, Message
from .engines.base import Generation, RolloutEngine, Sampling
from .trajectory import Kind, Span, Status, Trajectory


@dataclass
class AgentResult:
    """What an agent may return instead of a bare float reward."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class ContextOverflow(RuntimeError):
    pass


class AgentClient:
    def __init__(
        self, engine: RolloutEngine, trajectory: Trajectory, template: ChatTemplate | None,
        temperature: float, max_context: int, seed: int | None = None,
    ):
        self.engine, self.trajectory, self.template = engine, trajectory, template
        self.temperature, self.max_context = temperature, max_context
        self.seed, self._requests = seed, 0  # request k samples with seed + k (None: the engine's shared stream)
        self._messages: list[Message] | None = None  # what the current segment's tokens render (chat mode)
        self._last_gen: list[int] = []

    @property
    def tokens(self) -> list[int]:
        """All token ids of the current segment, in order."""
        return [t for span in self.trajectory.segments[-1] for t in span.token_ids]

    def new_segment(self) -> None:
        """Start a new training sequence (for agents that rewrite their context)."""
        if self.trajectory.segments[-1]:
            self.trajectory.segments.append([])
        self._messages, self._last_gen = None, []

    def add_context(self, token_ids: list[int]) -> None:
        """Append prompt (at a segment's start) or environment tokens: context the policy did not generate."""
        if token_ids:
            kind = Kind.ENV if self.trajectory.segments[-1] else Kind.PROMPT
            self.trajectory.segments[-1].append(Span.context(kind, token_ids))

    async def generate(self, context_ids: list[int] | None = None, *, max_tokens: int) -> Generation:
        """Append ``context_ids``, then sample up to ``max_tokens`` tokens continuing the whole segment."""
        self.add_context(context_ids or [])
        prompt = self.tokens
        if not prompt:
            raise ValueError("generate needs context: pass the prompt token ids")
        if len(prompt) + max_tokens > self.max_context:
            raise ContextOverflow(
                f"segment of {len(prompt)} tokens + max_tokens {max_tokens} exceeds max_context {self.max_context}; "
                "start a new segment, shorten the context, or raise max_context"
            )
        seed = None if self.seed is None else self.seed + self._requests
        self._requests += 1
        out = await self.engine.generate(prompt, Sampling(max_tokens=max_tokens, temperature=self.temperature,
                                                          seed=seed))
        if out.token_ids:
            self.trajectory.segments[-1].append(Span.policy(out.token_ids, out.logprobs, out.versions))
        if out.finish_reason == "length" and self.trajectory.status == Status.OK:
            self.trajectory.status = Status.TRUNCATED
            self.trajectory.reason = f"a turn hit max_tokens={max_tokens}"
        return out

    async def chat(self, messages: list[Message], *, max_tokens: int) -> str:
        """One assistant turn for ``messages``; returns its text.

        Only the template delta since the previous turn is tokenized; if ``messages`` does not extend what this
        segment already holds (history rewritten), a new segment starts from the rendered conversation.
        """
        if self.template is None:
            raise ValueError("client.chat needs a tokenizer with a chat template")
        t = self.template
        seen = self._messages
        if seen is not None and len(messages) > len(seen) and messages[: len(seen)] == seen:
            delta = t.delta_ids(seen, messages[len(seen):])
            if delta is None:
                self.new_segment()
                context = t.prompt_ids(messages)
            else:
                context = t.close_turn_ids(self._last_gen) + delta
        else:
            self.new_segment()
            context = t.prompt_ids(messages)
        out = await self.generate(context, max_tokens=max_tokens)
        reply = t.decode_reply(out.token_ids)
        self._messages = [*messages, {"role": "assistant", "content": reply}]
        self._last_gen = out.token_ids
        return reply
