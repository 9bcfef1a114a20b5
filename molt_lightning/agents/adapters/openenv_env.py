"""OpenEnv (``openenv-core``) environments as agent programs: the environment's own reset/step, in a chat loop.

An OpenEnv environment is a Gym-style object: ``reset(seed, episode_id) -> Observation`` and ``step(Action) ->
Observation``, with typed pydantic ``Action``/``Observation`` classes and the step's ``reward``/``done`` on the
observation; an ``MCPEnvironment`` also serves tools (``ListToolsAction``/``CallToolAction``). ``create_app(env,
ActionCls, ObservationCls)`` serves it over HTTP/WebSocket, where its ``EnvClient`` plays it.

``OpenEnvAgent`` plays one episode per sample:
- the environment runs in process (``environment="pkg.module:MyEnvironment"``, made per episode with ``env_kwargs``;
  its ``reset_async``/``step_async`` when it has its own, else ``reset``/``step`` in a worker thread, as OpenEnv's
  server calls them), or behind its server on 127.0.0.1 (``base_url``, with ``client`` its ``EnvClient`` class,
  default ``GenericEnvClient``: one WebSocket session per episode);
- ``reset`` gets the sample's ``seed`` and ``reset`` kwargs (``{"seed": 3, "reset": {...}}``; ``seeds(seed)`` is
  such a task stream), and the observation, rendered as text, is the first user message;
- each turn the policy replies (``client.chat_turn``, at most ``max_tokens``). An in-process ``MCPEnvironment``'s
  tools are offered to the policy: each tool call steps a ``CallToolAction`` and its result comes back as a ``tool``
  message. A text reply becomes the environment's action (``action``: the ``Action`` class whose one text field gets
  the reply, or a callable text -> Action; by default the class the environment declares, ``Environment[Act, Obs,
  State]``), and the next observation comes back as a user message;
- until an observation is ``done``, or ``max_turns`` replies (then the trajectory is ``TRUNCATED``).

The reward is the sum of the steps' rewards (an unset one counts 0). The environment raising, returning something
that is not an observation, or a reward that is not a finite number raises: the run counts a failed sample and goes
on. ``close`` always runs. ``render`` (observation -> text) replaces the default rendering: the observation's one text
field, else its fields (all but ``done``/``reward``/``metadata``) as JSON.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable
from functools import cached_property
from typing import Any, get_args, get_origin
from urllib.parse import urlsplit

from ...config import imported
from ..client import AgentResult
from ..env import Step, play

__all__ = ["OpenEnvAgent", "render", "seeds"]


def seeds(seed: int = 0):
    """An endless task stream of reset seeds: ``{"seed": n}``."""
    rng = random.Random(seed)
    while True:
        yield {"seed": rng.randrange(2**31)}


def _resolve(spec: Any) -> Any:
    """An object given as itself or as ``pkg.module:Name`` / ``pkg.module.Name``."""
    return imported(spec, "OpenEnvAgent's") if isinstance(spec, str) else spec


def render(obs: Any) -> str:
    """An observation as a message: its one text field, else its fields as JSON."""
    data = obs.model_dump() if hasattr(obs, "model_dump") else dict(obs)  # a remote one may be a dict
    fields = {k: v for k, v in data.items() if k not in ("done", "reward", "metadata")}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(fields) == 1 and texts:
        return texts[0]
    return json.dumps(fields, sort_keys=True, default=str)


def tool_text(obs: Any) -> str:
    """An in-process ``CallToolObservation`` as a tool message (the remote session offers no tools)."""
    error, result = obs.error, obs.result
    if error:
        return f"error: {error.message}"
    content = result.get("content") if isinstance(result, dict) else getattr(result, "content", None)
    if isinstance(content, list):
        return "\n".join(str(c.get("text", c) if isinstance(c, dict) else getattr(c, "text", c)) for c in content)
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _declared_action(env_cls: type) -> type | None:
    """The ``Action`` class of ``Environment[Act, Obs, State]`` in ``env_cls``'s bases."""
    from openenv.core import Action, Environment

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin, args = get_origin(base), get_args(base)
            if isinstance(origin, type) and issubclass(origin, Environment) and args and \
                    isinstance(args[0], type) and issubclass(args[0], Action):
                return args[0]
    return None


def _text_action(action_cls: type) -> Callable[[str], Any]:
    fields = [n for n, f in action_cls.model_fields.items() if n != "metadata" and f.annotation is str]
    if len(fields) != 1:
        raise ValueError(f"{action_cls.__name__} has {len(fields)} text fields ({fields}), not one: give "
                         "OpenEnvAgent(action=...) a callable that makes an action from the reply text")
    return lambda text: action_cls(**{fields[0]: text})


def _unpack(obs: Any, reward: Any = None, done: Any = None, source: str = "") -> tuple[Any, float, bool]:
    """(observation, reward, done) of an observation (in process) or of its parts (a client's ``StepResult``)."""
    from openenv.core import Observation

    if reward is None and done is None:  # in process: reward and done are on the observation
        if not isinstance(obs, Observation):
            raise TypeError(f"{source} returned {type(obs).__name__}, not an openenv Observation")
        reward, done = obs.reward, obs.done
    reward = 0.0 if reward is None else reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(f"{source} gave the reward {reward!r}, not a finite number")
    return obs, float(reward), bool(done)


class _InProcess:
    def __init__(self, env):
        self.env = env

    async def _call(self, name: str, *args, **kwargs):
        from openenv.core import Environment

        if getattr(type(self.env), f"{name}_async") is not getattr(Environment, f"{name}_async"):
            return await getattr(self.env, f"{name}_async")(*args, **kwargs)
        return await asyncio.to_thread(getattr(self.env, name), *args, **kwargs)

    async def reset(self, **kwargs):
        return _unpack(await self._call("reset", **kwargs), source=f"{type(self.env).__name__}.reset")

    async def step(self, action):
        return _unpack(await self._call("step", action), source=f"{type(self.env).__name__}.step")

    async def tools(self) -> list[dict] | None:
        from openenv.core import ListToolsAction, MCPEnvironment

        if MCPEnvironment is None or not isinstance(self.env, MCPEnvironment):
            return None
        listed = await self.env.step_async(ListToolsAction())
        if listed.metadata.get("error"):
            raise RuntimeError(f"{type(self.env).__name__} could not list its tools: {listed.metadata['error']}")
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}} for t in listed.tools] or None

    async def close(self):
        await asyncio.to_thread(self.env.close)


class _Remote:
    def __init__(self, client):
        self.client = client

    async def reset(self, **kwargs):
        await self.client.connect()
        r = await self.client.reset(**kwargs)
        return _unpack(r.observation, r.reward, r.done, "the server's reset")

    async def step(self, action):
        r = await self.client.step(action)
        return _unpack(r.observation, r.reward, r.done, "the server's step")

    async def tools(self):
        return None

    async def close(self):
        await self.client.close()


class OpenEnvAgent:
    """Plays one episode of an OpenEnv environment per sample, in a chat loop with the policy (module docstring)."""

    def __init__(self, environment: Any = None, env_kwargs: dict | None = None, base_url: str | None = None,
                 client: Any = None, action: Any = None, render: Any = None, max_turns: int = 8,
                 max_tokens: int = 64):
        if (environment is None) == (base_url is None):
            raise ValueError("OpenEnvAgent: give environment (in process) or base_url (its server), not both")
        if base_url is not None and urlsplit(base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"OpenEnvAgent: base_url must be a server on this machine (127.0.0.1), got {base_url}")
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"OpenEnvAgent max_turns and max_tokens must be >= 1, got {max_turns}, {max_tokens}")
        self.environment, self.env_kwargs, self.base_url = environment, dict(env_kwargs or {}), base_url
        self.client, self.action, self.render = client, action, render
        self.max_turns, self.max_tokens = max_turns, max_tokens

    def __repr__(self) -> str:
        return f"OpenEnvAgent({self.environment or self.base_url})"

    @cached_property
    def _parts(self) -> tuple:
        """(session factory, reply text -> action, observation -> text), resolved on first use."""
        action = _resolve(self.action)
        if self.environment is not None:
            env_cls = _resolve(self.environment)
            action = action or _declared_action(env_cls)
            session = lambda: _InProcess(env_cls(**self.env_kwargs))  # noqa: E731
        else:
            from openenv.core import GenericEnvClient

            client_cls = _resolve(self.client) or GenericEnvClient
            session = lambda: _Remote(client_cls(base_url=self.base_url))  # noqa: E731
        if action is None:
            raise ValueError(f"{self!r}: the environment declares no Action class: give action=")
        if isinstance(action, type):
            action = _text_action(action)
        return session, action, _resolve(self.render) or render

    async def __call__(self, client, sample: dict[str, Any]) -> AgentResult:
        from openenv.core import CallToolAction

        make_session, make_action, show = self._parts
        session = make_session()
        rewards: list[float] = []  # every step's, the reset's first: the episode's reward is their sum

        async def answer(reply: dict) -> Step:
            """The reply's tool calls, each a ``CallToolAction`` answered by a tool message, or its text the action."""
            if "unparsed" in reply:
                client.count("openenv/unparsed_tool_calls")
            start, observation, done = len(rewards), [], False
            for call in reply.get("tool_calls") or []:
                action = CallToolAction(tool_name=call["function"]["name"], arguments=call["function"]["arguments"])
                obs, r, done = await session.step(action)
                rewards.append(r)
                observation.append({"role": "tool", "content": tool_text(obs)})
                if done:
                    break
            if not observation:
                obs, r, done = await session.step(make_action(reply.get("content") or ""))
                rewards.append(r)
                observation = None if done else [{"role": "user", "content": show(obs)}]
            return Step(observation, sum(rewards[start:]), done)

        try:
            obs, r, done = await session.reset(seed=sample.get("seed"), **sample.get("reset", {}))
            if done:
                raise RuntimeError("the environment was done at reset: nothing for the policy to do")
            rewards.append(r)
            tools = await session.tools()
            _, keys, _, done = await play(client, [{"role": "user", "content": show(obs)}], answer, repr(self), "user",
                                          self.max_turns, self.max_tokens, tools)
        finally:
            await session.close()
        return AgentResult(sum(rewards), {"turns": len(keys), "env_steps": len(rewards) - 1, "env_truncated": not done})
