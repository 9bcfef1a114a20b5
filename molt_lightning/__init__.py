"""molt-lightning: one asynchronous RL loop for LLM agents, on Lightning.

``AsyncRLModule`` (the loop) and its records ``Rollout``, ``Optim``, ``Batching``, ``MoE`` (``config``),
``AgentClient``/``AgentResult`` (what an agent sees and returns), ``Environment``/``Step``/``EnvAgent`` (gym-style
environments, an alternative to agent programs). Imports are lazy so that ``import molt_lightning.bench`` does not
pull in torch or Lightning.
"""

from __future__ import annotations

import importlib

__all__ = ["AgentClient", "AgentResult", "AsyncRLModule", "Batching", "EnvAgent", "Environment", "MoE", "Optim",
           "Rollout", "Step"]


_HOME = {"AsyncRLModule": "module", "AgentClient": "client", "AgentResult": "client", "Batching": "config",
         "MoE": "config", "Optim": "config", "Rollout": "config", "EnvAgent": "envs", "Environment": "envs",
         "Step": "envs"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'molt_lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
