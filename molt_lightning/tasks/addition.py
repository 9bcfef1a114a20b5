"""Single-digit addition with an exact-format reward: a task a real small instruct model can learn by RL on a CPU.

The question is ``"What is 7+5? Reply with only the number."``; the reply is graded by exact checks in plain Python:

- 1.0: the reply is exactly the number (``"12"``, a trailing period allowed);
- 0.75: the right number is the only number in the reply (``"The answer is 12."``);
- 0.5 (``RESTATED``): the right number is the last number of a longer reply (``"7 + 5 = 12"``);
- 0.0: anything else (wrong, missing, or followed by other numbers).

Why SmolLM2-135M-Instruct (``models.smollm2``) can learn it: when it answers in the form ``"7 + 5 = 12"`` it is
mostly right, but it often rambles instead (``"In mathematics, a classic puzzle..."``) and almost never obeys "only
the number", so most 8-sample groups hold different rewards (a signal for group-normalized advantages); the measured
base rates are in docs/scale.md. RL has to climb the rungs: stop rambling (0.5), then stop restating the question
(0.75, 1.0).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

MAX_TOKENS = 24
TEMPERATURE = 0.7  # the temperature the baseline above was measured at
_NUMBER = re.compile(r"\d+")
# The right number after restating the question ("7 + 5 = 12"). RL settles in this form (see the README); scoring it
# 0.25 instead did not help: 40 steps later the policy still restated, for a quarter of the reward.
RESTATED = 0.5


def make_problem(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"question": f"What is {a}+{b}? Reply with only the number.", "answer": a + b}


def tasks(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The endless, seeded stream of samples the rollout source draws prompts from."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng)


def reward(reply: str, answer: int) -> float:
    """1.0 exactly the number; 0.75 the only number; 0.5 the last number; else 0.0 (see the module docstring)."""
    if reply.strip().removesuffix(".").strip() == str(answer):
        return 1.0
    numbers = [int(n) for n in _NUMBER.findall(reply)]
    if numbers == [answer]:
        return 0.75
    return RESTATED if numbers and numbers[-1] == answer else 0.0


async def agent(client, sample: dict[str, Any]) -> float:
    """One chat turn, graded by ``reward``."""
    reply = await client.chat([{"role": "user", "content": sample["question"]}], max_tokens=MAX_TOKENS)
    return reward(reply, sample["answer"])


def addition_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """``reward`` as a TRL reward function: TRL passes the completions (conversational: a list holding the assistant
    message) and the dataset's ``answer`` column, one per completion."""
    texts = [c if isinstance(c, str) else c[-1].get("content") or "" for c in completions]
    return [reward(t, a) for t, a in zip(texts, answer, strict=True)]
