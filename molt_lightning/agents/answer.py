"""``Answer``: the agent program for tasks from data: one chat turn on the sample's messages, graded by its verifier.

``model.agent: {class_path: molt_lightning.agents.Answer, init_args: {max_tokens: 256}}``. The reply is scored by the
verifier the sample's source names (``verifiers``); the result's ``info["answer"]`` is what the verifier read from
the reply (evaluation's maj@k votes on it). A verifier that raises, hangs or dies fails the sample (``VerifierFailed``:
counted as ``agent/verifier_failed`` and as a failed sample, never trained on). A sample's ``tools`` are rendered into
the prompt by the chat template; this agent runs no tool (a reply that calls one is graded as it is): an agent that
executes tools is an ordinary agent program of your own (docs/agents.md).
"""

from __future__ import annotations

from .client import AgentResult
from ..data.graders import DEFAULT_TIMEOUT_S, Verdict, VerifierFailed, verify


class Answer:
    def __init__(self, max_tokens: int | None = None, verifier_timeout_s: float = DEFAULT_TIMEOUT_S):
        """``max_tokens``: the reply's budget (None: the rest of the context, ``model.rollout.max_context`` or the
        policy's)."""
        if (max_tokens is not None and max_tokens < 1) or verifier_timeout_s <= 0:
            raise ValueError(f"Answer: max_tokens must be >= 1 and verifier_timeout_s > 0, got {max_tokens}, "
                             f"{verifier_timeout_s}")
        self.max_tokens, self.timeout_s = max_tokens, verifier_timeout_s

    async def __call__(self, client, sample: dict) -> AgentResult:
        message, _ = await client.chat_turn(sample["messages"], max_tokens=self.max_tokens, tools=sample.get("tools"))
        verdict = await graded(client, sample["verifier"], message.get("content") or "", sample, self.timeout_s)
        return AgentResult(verdict.score, {"answer": verdict.answer})


async def graded(client, verifier: str, reply: str, sample: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """``verify``, counting a verifier that raises, hangs or dies as ``agent/verifier_failed`` (also ``Harness``'s)."""
    try:
        return await verify(verifier, reply, sample, timeout_s)
    except VerifierFailed:
        client.count("verifier_failed")
        raise
