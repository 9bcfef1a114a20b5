"""The embedded calculator task (``tasks.arithmetic``) as a gym-style ``Environment``.

``reset`` asks the question; a ``CALC a op b`` reply gets the calculator's result back as a ``tool`` message; an
``ANSWER n`` reply ends the episode with reward 1 (right) or 0; any other reply ends it with 0. Played by
``env_agent(CalculatorEnv, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS)`` it makes token for token the conversations
of ``arithmetic.calculator_agent`` (same roles, replies of at most 16 tokens, at most 3 turns), so the tiny default
policy, warm-started on those dialogues, learns it the same way (``recipes/calculator_env.yaml``).
"""

from __future__ import annotations

from typing import Any

from ..agents.env import Environment, Step
from .arithmetic import MAX_TURNS, calculator, reward

MAX_TOKENS = 16  # per reply, as calculator_agent asks
__all__ = ["MAX_TOKENS", "MAX_TURNS", "CalculatorEnv"]


class CalculatorEnv(Environment):
    observation_role = "tool"

    async def reset(self, sample: dict[str, Any]) -> str:
        self.sample = sample
        return sample["question"]

    async def step(self, action: str) -> Step:
        if action.startswith("CALC "):
            return Step(calculator(action[len("CALC "):]))
        return Step(reward=reward(action, self.sample), done=True)
