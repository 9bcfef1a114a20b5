"""An OpenEnv environment written the way ``openenv-core`` users write one, for the python-tool policy.

``ArithmeticEnv`` is an ``MCPEnvironment``: ``reset(seed)`` draws a question of ``tasks.arithmetic`` ("What is
73*41?") from the seed; its MCP tool ``python`` runs code in ``python_tool.sandbox()`` and returns what it prints; an
``AnswerAction`` (the reply text) ends the episode with reward 1.0 when it is exactly the result
(``python_tool.reward``), else 0.0. Typed ``Action``/``Observation``/``State`` as OpenEnv asks; ``app()`` serves it
(``create_app``: ``uvicorn --factory molt_lightning.tasks.openenv_envs:app --host 127.0.0.1``).

Played by ``molt_lightning.agents.adapters.OpenEnvAgent(environment="molt_lightning.tasks.openenv_envs:ArithmeticEnv",
action="molt_lightning.tasks.openenv_envs:AnswerAction")`` on the reset seeds ``adapters.seeds``
(``recipes/openenv.yaml``). This module imports ``openenv`` and ``fastmcp``: it is an OpenEnv environment.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core import Action, MCPEnvironment, Observation, State

from . import python_tool
from .arithmetic import make_problem

__all__ = ["AnswerAction", "ArithmeticEnv", "ArithmeticObservation", "app"]


class AnswerAction(Action):
    message: str  # the policy's final reply


class ArithmeticObservation(Observation):
    question: str


class ArithmeticEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance holds its own episode

    def __init__(self):
        mcp = FastMCP("arithmetic")

        async def python(code: str) -> str:
            """Run Python code in a sandbox; returns what it prints."""
            return python_tool.tool_text(await python_tool.sandbox().run(code))

        mcp.tool(python)
        super().__init__(mcp)
        self.problem: dict[str, Any] | None = None
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ArithmeticObservation:
        self.problem = make_problem(random.Random(seed))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return ArithmeticObservation(question=self.problem["question"])

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> ArithmeticObservation:
        if not isinstance(action, AnswerAction):
            raise ValueError(f"ArithmeticEnv takes an AnswerAction or an MCP action, got {type(action).__name__}")
        if self.problem is None:
            raise RuntimeError("step before reset")
        self._state.step_count += 1
        return ArithmeticObservation(question=self.problem["question"], done=True,
                                     reward=python_tool.reward(action.message, self.problem))

    @property
    def state(self) -> State:
        return self._state


def app(max_concurrent_envs: int = 64):
    """The environment's HTTP/WebSocket server app (OpenEnv's ``create_app``)."""
    from openenv.core import create_app

    return create_app(ArithmeticEnv, AnswerAction, ArithmeticObservation, env_name="arithmetic",
                      max_concurrent_envs=max_concurrent_envs)
