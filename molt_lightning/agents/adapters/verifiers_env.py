"""``verifiers`` environments (prime-rl's library, ``verifiers.v1``) as agent programs, run by verifiers' own machinery.

A verifiers environment is a taskset: ``vf.Taskset.load()`` yields tasks, each a ``vf.TaskData`` row (prompt, answer,
...) in a ``vf.Task`` whose ``@vf.reward`` / ``@vf.metric`` methods score the finished trace; tools are MCP servers
(``vf.Toolset``) the task or taskset declares; a ``vf.Env`` may add multi-agent control flow.

- ``VerifiersTasks(environment, env_args)`` is the task stream: one sample per task, ``{"prompt": ..., "task": <its
  TaskData as JSON>}``. ``split="eval"`` is the first ``eval_size`` tasks (held out: ``"train"`` skips them), for
  ``callbacks.Evaluate``.
- ``VerifiersAgent(environment, env_args, env_config, max_tokens)`` is the agent. Per sample it rebuilds the task as
  verifiers' env server does (the ``TaskData`` validated into the taskset's ``Task`` class with its config) and plays
  one episode with ``Env.run_episode``: verifiers provisions the runtime, serves the interception endpoint that
  records the trace, wires the tools, applies the stop conditions and limits, then runs the task's scoring. Its
  model calls go to the run's endpoint (``client.base_url``, model ``policy``, this trajectory's key). The reward is
  the episode's (the sum of its trainable traces' weighted rewards); each reward function's score and each metric
  land in the result's ``info`` (``reward/<name>``, ``metric/<name>``). An episode verifiers marks failed (a hook,
  tool server or scorer raised, the harness died, a reward went unscored) raises: the run counts a failed sample and
  goes on. One it stopped on a limit is truncated (``trajectory.Truncation``): ``MAX_TURNS`` at its ``max_turns``,
  ``ENVIRONMENT`` at its other limits (token budgets, a failed compaction); a turn cut at its max_tokens was marked
  by the client first, and the first cause stays.

``environment`` is a taskset id as verifiers resolves one (an installed package exporting one ``Taskset`` through
``__all__``, e.g. ``reverse-text``), ``"pkg.module:TasksetClass"`` (for a module holding several), or a loaded
``vf.Env`` (taken as it is: the choices below are then the caller's). ``env_args`` is
the taskset's config (``--env.taskset.*``), ``env_config`` the rest of the ``[env]`` block: ``id`` of a bundled or
multi-agent env, role settings such as ``{agent: {max_turns: 3}}``.

For every agent role that leaves it unset the adapter chooses:
- runtime ``subprocess`` (verifiers' default is a remote sandbox);
- harness ``ChatProgramHarness`` (below): verifiers' own tool-calling chat program, the one its ``null`` harness
  runs (``verifiers.v1.harnesses.utils.launch.CHAT_PROGRAM_SOURCE``), executed in this process rather than as a
  ``uv`` script. A harness may run its loop in process (``Harness.launch``: every model call goes through the
  interception endpoint); the stock ``null``/``bash`` harnesses install their program's dependencies with ``uv``
  from the network on first use;
- the run's sampling: the endpoint takes only the run's ``temperature``/``top_p``, so a role's sampling keys other
  than ``max_tokens`` are dropped, with a warning, when the environment loads.

Every model call of an episode lands in this trajectory (one policy); a role that names its own ``client`` calls
another endpoint and is not trained on. Keep verifiers' retries off (their default): a retried attempt's tokens would
stay in the trajectory. One thing is set on the env beyond its public surface: the env-wide interception that
``Env.serving()`` starts is unset (``env._interception = None``), so each episode gets its own interception server
(as verifiers' ``Agent`` does with shared tools): the shared one would keep an HTTP client per trajectory key.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import re
import secrets
import sys
import types
import weakref
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from ...config import imported
from ...trajectory import Truncation
from ..client import AgentResult

log = logging.getLogger(__name__)
HARNESS_ID = "molt_chat_program"  # verifiers imports a harness by a dot-free module name: a shim holds ours
__all__ = ["VerifiersAgent", "VerifiersTasks", "load_env_config"]  # and ChatProgramHarness, made on use


def load_env_config(environment: str, env_args: dict | None = None, env_config: dict | None = None):
    """The validated ``vf.EnvConfig`` of ``environment``, the adapter's choices made for unset roles (module doc)."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig

    given = json.loads(json.dumps(env_config or {}))
    data = {**given, "taskset": {**given.get("taskset", {}), **(env_args or {}), "id": _taskset_id(environment)}}
    config = vf.resolve_env_config(data)
    roles = {}
    for role, spec in agent_config_fields(config).items():
        update: dict[str, Any] = {}
        if "runtime" not in (given.get(role) or {}):
            update["runtime"] = SubprocessConfig()
        if spec.harness is None:
            update["harness"] = vf.harness_config_type(_harness_id()).model_validate({"id": HARNESS_ID})
        if spec.sampling is not None:
            values = spec.sampling.model_dump(exclude_unset=True)
            dropped = sorted(k for k, v in values.items() if k != "max_tokens" and v is not None)
            if dropped:
                log.warning("verifiers env %s, role %r: dropped sampling %s (the run samples at its own settings)",
                            environment, role, {k: values[k] for k in dropped})
            tokens = values.get("max_tokens")
            update["sampling"] = None if tokens is None else vf.SamplingConfig(max_tokens=tokens)
        roles[role] = spec.model_copy(update=update)
    return config.model_copy(update=roles)


def _shim(module: str, name: str, make: Callable[[], Any], doc: str) -> str:
    """``module``, importable by verifiers: a module exporting only ``name`` (made by ``make`` on first use)."""
    if module not in sys.modules:
        shim = types.ModuleType(module, doc)
        shim.__all__ = [name]
        setattr(shim, name, make())
        sys.modules[module] = shim
    return module


def _harness_id() -> str:
    """``HARNESS_ID``, importable: a module exporting only ``ChatProgramHarness``."""
    return _shim(HARNESS_ID, "ChatProgramHarness", lambda: sys.modules[__name__].ChatProgramHarness,
                 "molt_lightning.agents.adapters.verifiers_env.ChatProgramHarness")


def _taskset_id(environment: str) -> str:
    """A taskset id verifiers can import: the id itself, or for ``pkg.module:Class`` an alias module exporting it."""
    if ":" not in environment:
        return environment
    return _shim("_molt_vf_" + re.sub(r"\W", "_", environment).lower(), environment.partition(":")[2],
                 lambda: imported(environment, "the verifiers taskset"), f"the taskset {environment}")


def _sample(task) -> dict[str, Any]:
    return {"prompt": task.data.prompt_text, "task": task.data.model_dump(mode="json", exclude_defaults=True)}


class VerifiersTasks:
    """``tasks(seed)`` over a verifiers taskset: ``split`` ``train`` (all but the first ``eval_size`` tasks, shuffled
    per epoch, endless), ``eval`` (the first ``eval_size``, once, in order) or ``all``. An endless taskset
    (``INFINITE``) streams in its own order."""

    def __init__(self, environment: str, env_args: dict | None = None, split: str = "train", eval_size: int = 0,
                 shuffle: bool = True):
        import verifiers.v1 as vf

        if split not in ("train", "eval", "all") or eval_size < 0 or (split == "eval" and eval_size < 1):
            raise ValueError(f"VerifiersTasks: split is train, eval or all and eval needs eval_size >= 1, got "
                             f"split={split!r}, eval_size={eval_size}")
        self.split, self.eval_size, self.shuffle = split, eval_size, shuffle
        self.taskset = environment.taskset if hasattr(environment, "taskset") else vf.load_taskset(
            load_env_config(environment, env_args).taskset)
        self.rows = None
        if self.taskset.bounded:
            rows = [_sample(task) for task in self.taskset]
            self.rows = {"train": rows[eval_size:], "eval": rows[:eval_size], "all": rows}[split]
            if not self.rows:
                raise ValueError(f"VerifiersTasks: the taskset {environment} has {len(rows)} tasks: none left for "
                                 f"split {split!r} with eval_size={eval_size}")

    def __len__(self) -> int:
        if self.rows is None and self.split != "eval":
            raise TypeError("an endless taskset has no length")
        return self.eval_size if self.rows is None else len(self.rows)

    def __call__(self, seed: int = 0):
        if self.rows is None:  # endless: the taskset's own order
            view = self.taskset.take(self.eval_size) if self.split == "eval" else self.taskset.skip(
                self.eval_size if self.split == "train" else 0)
            yield from (_sample(task) for task in view)
        elif self.split == "eval":
            yield from self.rows
        else:
            rng, order = random.Random(seed), list(range(len(self.rows)))
            while True:
                if self.shuffle:
                    rng.shuffle(order)
                yield from (self.rows[i] for i in order)


class VerifiersAgent:
    """Plays one verifiers episode per sample against the run's endpoint; the episode's reward is the reward."""

    def __init__(self, environment: str, env_args: dict | None = None, env_config: dict | None = None,
                 max_tokens: int | None = None):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"VerifiersAgent max_tokens must be >= 1, got {max_tokens}")
        self.environment, self.env_args, self.env_config = environment, env_args, env_config
        self.max_tokens = max_tokens
        self._env = None if isinstance(environment, str) else environment  # a vf.Env, taken as it is
        self._serving: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> (ready future, holder)

    def __repr__(self) -> str:
        return f"VerifiersAgent({self.environment})"

    def env(self):
        """The verifiers ``Env`` (loaded on first use)."""
        if self._env is None:
            import verifiers.v1 as vf

            self._env = vf.load_environment(load_env_config(self.environment, self.env_args, self.env_config))
        return self._env

    def task(self, sample: dict[str, Any]):
        """The sample's task, rebuilt from its ``TaskData`` as verifiers' env server does."""
        env = self.env()
        task_cls = type(env.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(sample["task"]), env.config.taskset.task)

    async def __call__(self, client, sample: dict[str, Any]) -> AgentResult:
        import verifiers.v1 as vf
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        env = self.env()
        await self._serve(env)
        task = self.task(sample)
        # verifiers reads the key from an environment variable; "API_KEY" in the name keeps it from its subprocesses
        var = f"MOLT_API_KEY_{secrets.token_hex(8).upper()}"
        os.environ[var] = client.api_key
        try:
            ctx = ModelContext(model="policy", client=EvalClientConfig(base_url=client.base_url, api_key_var=var),
                               sampling=vf.SamplingConfig(max_tokens=self.max_tokens))
            episode = await env.run_episode(task, ctx)
        finally:
            os.environ.pop(var, None)
        return self.result(episode, client)

    def result(self, episode, client=None) -> AgentResult:
        """The reward and info of a finished episode; raises when verifiers marked it failed."""
        failed = [f"{e.type}: {e.message}" for e in episode.errors]
        failed += [f"{t.agent.name}: {e.type}: {e.message}" for t in episode.traces for e in t.errors]
        if not episode.ok:
            raise RuntimeError(f"the verifiers episode failed: {'; '.join(failed)[-1500:] or 'no trace completed'}")
        traces = [t for t in episode.traces if t.agent.trainable]
        unscored = [f"{t.agent.name}.{name}" for t in traces for name, r in t.rewards.items() if r is None]
        if unscored:
            raise RuntimeError(f"the verifiers episode left rewards unscored: {unscored}")
        info: dict[str, Any] = {"turns": sum(t.num_turns for t in episode.traces),
                                "stop_condition": ",".join(str(t.stop_condition) for t in episode.traces)}
        for t in episode.traces:
            prefix = "" if len(episode.traces) == 1 else f"{t.agent.name}/"
            info.update({f"reward/{prefix}{k}": r.score for k, r in t.rewards.items() if r is not None})
            info.update({f"metric/{prefix}{k}": v for k, v in t.metrics.items() if v is not None})
        truncated = [t for t in traces if t.is_truncated]
        if client is not None and truncated:  # a turn cut at its max_tokens was marked by the client already
            stop = str(truncated[0].stop_condition)
            client.trajectory.truncate(Truncation.MAX_TURNS if stop == "max_turns" else Truncation.ENVIRONMENT,
                                       f"verifiers stopped the episode: {stop}")
        return AgentResult(float(sum(t.reward for t in traces)), info)

    async def _serve(self, env) -> None:
        """Hold ``env.serving()`` (its shared tool servers, its ``start``/``stop``) open on this loop from first use."""
        loop = asyncio.get_running_loop()
        if loop not in self._serving:
            ready = loop.create_future()
            holder = loop.create_task(self._hold(env, ready))
            holder._log_destroy_pending = False  # it stays pending until the engine's loop goes away
            self._serving[loop] = (ready, holder)
        await asyncio.shield(self._serving[loop][0])

    @staticmethod
    async def _hold(env, ready: asyncio.Future) -> None:
        serving = env.serving()
        try:
            await serving.__aenter__()
        except BaseException as e:
            ready.set_exception(RuntimeError(f"the verifiers env could not start serving: {e!r}"))
            raise
        env._interception = None  # per-episode interception servers (module docstring)
        ready.set_result(None)
        try:
            await asyncio.Event().wait()  # until cancelled, or the loop goes away
        except asyncio.CancelledError:
            await serving.__aexit__(None, None, None)
            raise
        # a loop stopped with this task pending closes it (GeneratorExit): nothing can be awaited then; the shared
        # tool servers die with the engine's loop thread (verifiers starts them with PR_SET_PDEATHSIG)


@functools.cache
def _chat_program() -> dict:
    """verifiers' bundled chat program (what the ``null`` harness runs as a script), loaded once as a namespace."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    namespace = {"__name__": "verifiers_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
    return namespace


def _harness_class():
    import httpx
    import openai
    import verifiers.v1 as vf
    from verifiers.v1.configs.harness import HarnessConfig
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.runtimes import ProgramResult

    class ChatProgramHarnessConfig(HarnessConfig):
        id: str = HARNESS_ID

    class ChatProgramHarness(vf.Harness[ChatProgramHarnessConfig]):
        """The ``null`` harness's chat program run in process: the task's prompt, its tool servers' tools, model turns
        through the interception endpoint until a reply calls no tool. No bash, no host tools."""

        APPENDS_SYSTEM_PROMPT = SUPPORTS_MCP = SUPPORTS_RESUME = SUPPORTS_TOOL_INTERCEPTION = True
        EXECUTES_CODE = NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
            program = _chat_program()
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                         else [message_to_wire(m) for m in prompt or []])
            args = argparse.Namespace(tool_interception_url=tool_interception_url or "", api_key=secret, bash=False,
                                      edit=False, search=False, serper_key="")
            timeout = httpx.Timeout(None, connect=5.0)
            try:
                async with AsyncExitStack() as stack:  # the HTTP clients (loopback: no TLS), the tool servers' sessions
                    http = await stack.enter_async_context(httpx.AsyncClient(verify=False, timeout=timeout))
                    tool_client = (await stack.enter_async_context(httpx.AsyncClient(timeout=timeout))
                                   if tool_interception_url else None)
                    llm = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http)
                    tools, dispatch, servers = [], {}, {}
                    if mcp_urls:
                        config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                                 for name, url in mcp_urls.items()}}
                        tools, dispatch, servers = await program["connect_mcp"](config, stack, set())
                    compactor = program["Compactor"](llm, ctx.model, tools, False, None)
                    compactor.note_good(messages)
                    await program["run_chat_loop"](args, compactor, messages, dispatch, servers, tool_client)
            except SystemExit as e:  # the program's exit on a lost model connection (exit code 97)
                return ProgramResult(exit_code=e.code if isinstance(e.code, int) else 1, stdout="",
                                     stderr=f"the chat program exited: {e.__context__!r}")
            return ProgramResult(exit_code=0, stdout="", stderr="")

    return ChatProgramHarness


def __getattr__(name: str):
    if name == "ChatProgramHarness":  # built on first use, so this module imports without verifiers
        globals()[name] = cls = _harness_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
