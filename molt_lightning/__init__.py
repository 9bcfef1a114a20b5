"""molt-lightning: one asynchronous RL loop for LLM agents, on Lightning.

``AsyncRLModule`` (the loop), ``AgentClient``/``AgentResult`` (what an agent sees and returns), ``Environment``/``Step``
(gym-style environments, an alternative to agent programs). Imports are lazy so that ``import molt_lightning.bench``
does not pull in torch or Lightning.
"""

from __future__ import annotations

__all__ = ["AgentClient", "AgentResult", "AsyncRLModule", "Environment", "Step"]


def __getattr__(name: str):
    if name == "AsyncRLModule":
        from .module import AsyncRLModule

        return AsyncRLModule
    if name in ("AgentClient", "AgentResult"):
        from . import client

        return getattr(client, name)
    if name in ("Environment", "Step"):
        from . import envs

        return getattr(envs, name)
    raise AttributeError(f"module 'molt_lightning' has no attribute {name!r}")
