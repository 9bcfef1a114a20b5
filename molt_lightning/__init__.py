"""molt-lightning: one asynchronous RL loop for LLM agents, on Lightning.

``AsyncRLModule`` (the loop, ``module``) and its records ``Rollout``, ``Optim``, ``Batching``, ``MoE`` (``config``),
``AgentClient``/``AgentResult`` (what an agent sees and returns), ``Environment``/``Step``/``EnvAgent`` (gym-style
environments, an alternative to agent programs). The rooms: ``agents/``, ``rollout/``, ``trainer/``, ``engines/``
(with ``engines/vllm/``), ``policies/``, ``algorithms/``, ``data/``, ``callbacks/``, ``commands/``; ``models/`` and
``tasks/`` are what recipes name, ``bench/`` is molt-bench (docs/architecture.md). Imports are lazy so that
``import molt_lightning.bench`` does not pull in torch or Lightning.

A module that moved in the renovation of issue 41 fails to import with an error naming its new place (``MOVED``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

__all__ = ["AgentClient", "AgentResult", "AsyncRLModule", "Batching", "EnvAgent", "Environment", "MoE", "Optim",
           "Rollout", "Step"]

_HOME = {"AsyncRLModule": "module", "AgentClient": "agents.client", "AgentResult": "agents.client",
         "Batching": "config", "MoE": "config", "Optim": "config", "Rollout": "config", "EnvAgent": "agents.env",
         "Environment": "agents.env", "Step": "agents.env"}
MOVED = {f"{__name__}.{old}": f"{__name__}.{new}" for old, new in {
    "client": "agents.client (AgentSessions is agents.sessions.AgentSessions)", "chat": "agents.chat",
    "endpoint": "agents.wire.endpoint", "openai_chat": "agents.wire.openai_chat",
    "anthropic_messages": "agents.wire.anthropic_messages", "wire": "agents.wire.checks", "envs": "agents.env",
    "harness": "agents.harness", "data.agent": "agents.answer", "adapters": "agents.adapters",
    "tools": "agents.tools", "admission": "rollout.admission", "evaluation": "rollout.heldout",
    "batching": "trainer.plan", "policy": "trainer.policy", "prefix": "trainer.prefix", "parallel": "trainer.parallel",
    "weights": "trainer.weights", "lightning_compat": "trainer.lightning_compat", "moe": "policies.moe",
    "expert_parallel": "policies.expert_parallel", "vision": "policies.vision", "lora": "policies.lora",
    "engines.vllm_engine": "engines.vllm.engine", "engines.remote": "engines.vllm.remote",
    "engines.vllm_worker": "engines.vllm.worker", "engines.vllm_load": "engines.vllm.cpu",
    "engines.vllm_lora": "engines.vllm.lora", "engines.shm": "engines.vllm.shm", "engines.nccl_channel":
    "engines.vllm.nccl", "engines.server": "engines.vllm.server", "engines.main_guard": "engines.vllm.main_guard",
    "engines.reaper": "engines.vllm.reaper", "algorithms.sampling": "algorithms.shaping",
    "data.verifiers": "data.graders", "cli": "commands.cli", "sft": "commands.sft", "export": "commands.export",
    "serve": "commands.serve"}.items()}


class _Moved(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: a module no finder found that moved gets an error naming where it went."""

    def find_spec(self, name, path=None, target=None):
        old = next((m for m in MOVED if name == m or name.startswith(m + ".")), None)
        if old is not None:
            raise ModuleNotFoundError(f"{name} moved to {MOVED[old]}{name[len(old):]}: import it from there (and "
                                      "name it so in recipes)", name=name)
        return None


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())


def __getattr__(name: str):
    if f"{__name__}.{name}" in MOVED:  # ``molt_lightning.envs.EnvAgent`` resolved attribute by attribute
        raise AttributeError(f"{__name__}.{name} moved to {MOVED[f'{__name__}.{name}']}: name it so")
    if name not in _HOME:
        raise AttributeError(f"module 'molt_lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
