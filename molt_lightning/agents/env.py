"""Gym-style environments as agent programs: ``reset`` gives the first observation, ``step(action)`` answers a reply.

An ``Environment`` holds one episode's state. ``EnvAgent(MyEnv)`` turns it into an ordinary agent program (an
``async __call__(client, sample) -> AgentResult``) that the rollout source runs like any other: per agent run it
makes one environment (``MyEnv(**env_kwargs)``), chats the first observation to the policy, hands each reply to
``step`` and appends the step's observation to the conversation (context, never trained on) until a step is ``done``
or ``max_turns`` replies were made. In a recipe: ``model.agent: {class_path: molt_lightning.agents.env.EnvAgent,
init_args: {environment: pkg.MyEnv, env_kwargs: {}, max_turns: 8, max_tokens: 64}}``. ``close`` always runs, also
when ``reset`` or ``step`` raised (the run then fails, is counted and is not trained on, as for any agent that
raises).

- The reward of an episode is the **sum** of its steps' rewards (a reward given only at the end is the usual case).
- An episode cut at ``max_turns`` is *truncated*: ``info["env_truncated"]`` is True and the trajectory's status is
  ``TRUNCATED`` with cause ``Truncation.MAX_TURNS`` (trained on like an ok one, and counted, as for a turn that hits
  ``max_tokens``; a turn cut earlier in the episode keeps its own cause).
- The result's ``info`` holds the steps' ``info`` dicts merged (later steps win), ``turns`` (replies made) and
  ``env_truncated``; its ``turn_rewards`` are the steps' rewards and its ``turn_keys`` the observation each reply
  answered (its messages as JSON), for the turn-level estimators (``turn_grpo``, ``gigpo``).
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..trajectory import Truncation
from .client import AgentResult

Observation = str | list[dict[str, Any]] | None


@dataclass
class Step:
    """What ``Environment.step`` returns. A non-final step's observation becomes the next message(s) of the chat."""

    observation: Observation = None  # a text (a message of ``observation_role``), chat messages, or None when done
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode of a task. ``reset`` and ``step`` are async, so they may await tools, sandboxes or services."""

    observation_role = "user"  # the role of a text observation from ``step`` ("tool" for tool results)

    @abstractmethod
    async def reset(self, sample: dict[str, Any]) -> str | list[dict[str, Any]]:
        """Start the episode for ``sample``; return the first observation: a user text or the opening messages."""

    @abstractmethod
    async def step(self, action: str) -> Step:
        """Answer the policy's reply text ``action``."""

    async def close(self) -> None:
        """Release what the episode holds; called once per episode, whatever happened."""


def check_environment(env_cls: Any, env_kwargs: dict | None = None,
                      key: str = "model.agent.init_args.environment") -> None:
    """Raise ``ValueError`` naming the fix unless ``env_cls`` is a concrete ``Environment`` taking ``env_kwargs``."""
    name = f"{getattr(env_cls, '__module__', '?')}.{getattr(env_cls, '__qualname__', env_cls)}"
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ValueError(f"{key} {name} is not an Environment: give the dotted path of a class that subclasses "
                         "molt_lightning.agents.env.Environment (e.g. "
                         "molt_lightning.tasks.arithmetic_env.CalculatorEnv)")
    if inspect.isabstract(env_cls):
        missing = ", ".join(sorted(env_cls.__abstractmethods__))
        raise ValueError(f"{key} {name} is abstract: implement {missing} (async methods)")
    try:
        inspect.signature(env_cls).bind(**(env_kwargs or {}))
    except TypeError as e:
        raise ValueError(f"{key} {name} cannot be made with env_kwargs {env_kwargs or {}}: {e}; give env_kwargs "
                         "the arguments its __init__ takes") from None


class EnvAgent:
    """The agent program that plays one episode of ``environment(**env_kwargs)`` per run, ``max_tokens`` per reply."""

    def __init__(self, environment: type, env_kwargs: dict | None = None, max_turns: int = 8,
                 max_tokens: int = 64):
        check_environment(environment, env_kwargs)
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"EnvAgent max_turns and max_tokens must be >= 1, got {max_turns} and {max_tokens}")
        self.environment, self.env_kwargs = environment, dict(env_kwargs or {})
        self.max_turns, self.max_tokens = max_turns, max_tokens

    def __repr__(self) -> str:
        return f"EnvAgent({self.environment.__name__})"

    async def __call__(self, client, sample) -> AgentResult:
        name = self.environment.__name__
        env = self.environment(**self.env_kwargs)
        try:
            opening = _messages(await env.reset(sample), "user", f"{name}.reset")
            rewards, keys, info, done = await play(client, opening, lambda reply: env.step(reply["content"]), name,
                                                   env.observation_role, self.max_turns, self.max_tokens)
        finally:
            await env.close()
        return AgentResult(sum(rewards), {**info, "turns": len(keys), "env_truncated": not done},
                           turn_rewards=rewards, turn_keys=keys)


async def play(client, messages: list[dict[str, Any]], answer: Callable[[dict], Awaitable[Step]], name: str,
               role: str, max_turns: int, max_tokens: int, tools: list | None = None
               ) -> tuple[list[float], list[str], dict[str, Any], bool]:
    """The chat loop of an episode (``EnvAgent``'s, ``adapters.OpenEnvAgent``'s) from the opening ``messages``: the
    policy replies (``client.chat_turn``, offered ``tools``), ``answer(reply message)`` steps the environment, and a
    step not done adds its observation to the conversation (a text as a message of ``role``), until a step is done or
    ``max_turns`` replies were made; an episode not done then truncates the trajectory. Returns the steps' rewards,
    the observation each reply answered (its messages as JSON), the steps' info merged and whether the episode is
    done. ``name`` names the environment in errors."""
    info, done, observation = {}, False, messages
    rewards, keys = [], []  # per turn: the step's reward, the state the reply acted on
    while not done and len(keys) < max_turns:
        reply, _ = await client.chat_turn(messages, max_tokens=max_tokens, tools=tools)
        keys.append(json.dumps(observation, sort_keys=True, default=str))
        step = await answer(reply)
        if not isinstance(step, Step):
            raise TypeError(f"{name}.step returned {type(step).__name__}, not a Step")
        rewards.append(float(step.reward))
        done = step.done
        info.update(step.info)
        messages.append({k: v for k, v in reply.items() if k != "unparsed"})
        if not done:
            observation = _messages(step.observation, role, f"{name}.step (or end the episode with done=True)")
            messages += observation
    if not done:
        client.trajectory.truncate(Truncation.MAX_TURNS, f"the environment was not done after max_turns={max_turns}")
    return rewards, keys, info, done


def _messages(observation: Observation, role: str, source: str) -> list[dict[str, Any]]:
    """An observation as chat messages: a text is one message of ``role``; a list is taken as it is."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, list) and observation and all(isinstance(m, dict) for m in observation):
        return list(observation)
    raise ValueError(f"the observation must be a text or a non-empty list of chat messages, got {observation!r}: "
                     f"return one from {source}")
