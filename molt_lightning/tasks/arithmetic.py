"""The embedded default task: arithmetic with a calculator tool, as a multi-turn agent.

A question ``"What is 37*58?"`` is answered either directly (``ANSWER 2146``) or by calling the tool first
(``CALC 37*58``), reading the tool's reply (an environment turn, never trained on) and then answering. The tiny default
policy cannot multiply in its head, so the reward measures whether it learned to use the tool and copy its result:
the warm start (``molt_lightning.models.tiny``) calls the tool in a small share of its answers (and then answers right);
RL raises that.

Everything here is ordinary Python: ``tasks`` yields samples, ``calculator_agent`` is the agent program.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

OPS = "+-*"
MAX_TURNS = 3
_CALL = re.compile(r"^\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*$")


def make_problem(rng: random.Random) -> dict[str, Any]:
    """One problem: two 2-3 digit operands and an operator; ``answer`` is the exact integer result."""
    a, b, op = rng.randint(10, 999), rng.randint(10, 99), rng.choice(OPS)
    expr = f"{a}{op}{b}"
    return {"question": f"What is {expr}?", "expression": expr, "answer": calculator_value(expr)}


def tasks(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The endless, seeded stream of samples the rollout source draws prompts from."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng)


def calculator_value(expr: str) -> int | None:
    """Evaluate ``a op b`` exactly (no ``eval``); ``None`` when the call is malformed."""
    m = _CALL.match(expr)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def calculator(expr: str) -> str:
    """The tool: the result as text, or an error message the policy sees as an environment turn."""
    value = calculator_value(expr)
    return "error" if value is None else str(value)


def parse_answer(reply: str) -> int | None:
    m = re.match(r"^\s*ANSWER\s+(-?\d+)\s*$", reply)
    return int(m.group(1)) if m else None


def reward(reply: str, sample: dict[str, Any]) -> float:
    """1.0 for a final ``ANSWER n`` with the exact result, else 0.0."""
    return float(parse_answer(reply) == sample["answer"])


async def calculator_agent(client, sample: dict[str, Any]) -> float:
    """The agent program: chat with the policy, run the calculator when it asks, score the final answer."""
    messages = [{"role": "user", "content": sample["question"]}]
    reply = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat(messages, max_tokens=16)
        messages.append({"role": "assistant", "content": reply})
        if not reply.startswith("CALC "):
            break
        messages.append({"role": "tool", "content": calculator(reply[len("CALC "):])})
    return reward(reply, sample)


def demonstration(rng: random.Random, p_tool: float) -> list[dict[str, str]]:
    """A supervised warm-start dialogue: with probability ``p_tool`` the tool route, else a direct (guessed) answer."""
    problem = make_problem(rng)
    user = {"role": "user", "content": problem["question"]}
    if rng.random() < p_tool:
        return [
            user,
            {"role": "assistant", "content": f"CALC {problem['expression']}"},
            {"role": "tool", "content": str(problem["answer"])},
            {"role": "assistant", "content": f"ANSWER {problem['answer']}"},
        ]
    # A random guess: the tiny model learns the format, not the arithmetic.
    guess = rng.randint(-99, 99999)
    return [user, {"role": "assistant", "content": f"ANSWER {guess}"}]


def tool_call_score(reply: str, sample: dict[str, Any]) -> float:
    """The single-turn variant's score: 1.0 when the reply is the right tool call, ``CALC`` and the question's
    expression (the call ``calculator_agent`` would run, parsed as the calculator parses it: ``CALC 37*58`` or
    ``CALC 37 * 58``), else 0.0 (a direct answer, a wrong call, trailing text)."""
    want = _CALL.match(sample["expression"])
    got = _CALL.match(reply[len("CALC "):]) if reply.startswith("CALC ") else None
    return float(got is not None and want is not None and got.groups() == want.groups())


async def single_turn_agent(client, sample: dict[str, Any]) -> float:
    """The single-turn variant (protocol ``arithmetic-single-turn``): one reply of at most 16 tokens, no tool run,
    scored by ``tool_call_score``: the policy is rewarded for calling the tool right, the first step of the task."""
    reply = await client.chat([{"role": "user", "content": sample["question"]}], max_tokens=16)
    return tool_call_score(reply, sample)


async def two_question_agent(client, sample: dict[str, Any]):
    """A two-turn task where only the first turn decides the reward (protocol ``arithmetic-two-turn``): the policy
    answers the question (scored by ``tool_call_score``, as ``single_turn_agent``), then a second question that is
    not scored. The per-turn rewards say so (``[score, 0]``), for the turn-level estimators; a trajectory-level
    estimator credits both replies with the score."""
    from ..agents.client import AgentResult

    second = make_problem(random.Random(sample["expression"]))["question"]
    messages = [{"role": "user", "content": sample["question"]}]
    first = await client.chat(messages, max_tokens=16)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": second}]
    await client.chat(messages, max_tokens=16)
    score = tool_call_score(first, sample)
    return AgentResult(score, {"second_question": second}, turn_rewards=[score, 0.0])


def tool_call_reward(prompts, completions, expression, **kwargs) -> list[float]:
    """``tool_call_score`` as a TRL reward function: TRL passes the completions (conversational: a list holding the
    assistant message) and the dataset's ``expression`` column, one per completion."""
    texts = [c if isinstance(c, str) else c[-1].get("content") or "" for c in completions]
    return [tool_call_score(t, {"expression": e}) for t, e in zip(texts, expression, strict=True)]
