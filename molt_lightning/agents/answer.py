"""``Answer``: the agent program for tasks from data: one chat turn on the sample's messages, graded by its verifier
and, if given one, a judge model.

``model.agent: {class_path: molt_lightning.agents.Answer, init_args: {max_tokens: 256}}``. The reply is scored by the
verifier the sample's source names (``verifiers``); the result's ``info["answer"]`` is what the verifier read from
the reply (evaluation's maj@k votes on it). A verifier that raises, hangs or dies fails the sample (``VerifierFailed``:
counted as ``agent/verifier_failed`` and as a failed sample, never trained on). A sample's ``tools`` are rendered into
the prompt by the chat template; this agent runs no tool (a reply that calls one is graded as it is): an agent that
executes tools is an ordinary agent program of your own (docs/agents.md).

With a ``judge`` (``data.judge.Judge``) the reward is ``(1 - judge_weight) * rule + judge_weight * judge``: the
judge reads the last user message, the reply and the sample's reference answer, if any; ``info["judge"]`` keeps its
prompt, replies and score, ``info["rule_score"]`` the verifier's. The verifier still runs (its answer feeds maj@k),
except when the judge alone grades (``judge_weight: 1``) a sample without a reference. A judge that gives no verdict
fails the sample (``JudgeFailed``: counted as ``agent/judge_failed/<kind>``), never a silent 0.
"""

from __future__ import annotations

from .chat import message_text
from .client import AgentResult
from ..data.graders import DEFAULT_TIMEOUT_S, Verdict, VerifierFailed, verify
from ..data.judge import Judge, JudgeFailed, JudgeVerdict


class Answer:
    def __init__(self, max_tokens: int | None = None, verifier_timeout_s: float = DEFAULT_TIMEOUT_S,
                 judge: Judge | None = None, judge_weight: float = 1.0):
        """``max_tokens``: the reply's budget (None: the rest of the context, ``model.rollout.max_context`` or the
        policy's); ``judge``: a model grading the reply too, its share of the reward ``judge_weight``."""
        if (max_tokens is not None and max_tokens < 1) or verifier_timeout_s <= 0 or not 0 <= judge_weight <= 1:
            raise ValueError(f"Answer: max_tokens must be >= 1, verifier_timeout_s > 0 and judge_weight in [0, 1], "
                             f"got {max_tokens}, {verifier_timeout_s}, {judge_weight}")
        self.max_tokens, self.timeout_s = max_tokens, verifier_timeout_s
        self.judge, self.judge_weight = judge, judge_weight

    async def __call__(self, client, sample: dict) -> AgentResult:
        message, _ = await client.chat_turn(sample["messages"], max_tokens=self.max_tokens, tools=sample.get("tools"))
        reply = message.get("content") or ""
        if self.judge is None:
            verdict = await graded(client, sample["verifier"], reply, sample, self.timeout_s)
            return AgentResult(verdict.score, {"answer": verdict.answer})
        rule = None
        if self.judge_weight < 1 or sample.get("answer") is not None:
            rule = await graded(client, sample["verifier"], reply, sample, self.timeout_s)
        judged = await judge_graded(client, self.judge, reply, sample)
        if rule is None:
            return AgentResult(judged.score, {"answer": None, "rule_score": None, "judge": judged.info()})
        reward = (1 - self.judge_weight) * rule.score + self.judge_weight * judged.score
        return AgentResult(reward, {"answer": rule.answer, "rule_score": rule.score, "judge": judged.info()})


async def graded(client, verifier: str, reply: str, sample: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """``verify``, counting a verifier that raises, hangs or dies as ``agent/verifier_failed`` (also ``Harness``'s)."""
    try:
        return await verify(verifier, reply, sample, timeout_s)
    except VerifierFailed:
        client.count("verifier_failed")
        raise


async def judge_graded(client, judge: Judge, reply: str, sample: dict) -> JudgeVerdict:
    """``judge.grade`` on the sample's last user message, counting a failure as ``agent/judge_failed/<kind>``."""
    question = message_text(next((m.get("content") for m in reversed(sample["messages"]) if m.get("role") == "user"),
                                 ""))
    try:
        return await judge.grade(question, reply, sample.get("answer"))
    except JudgeFailed as e:
        client.count(f"judge_failed/{e.kind}")
        raise
