"""Rollout engines behind one protocol (``base.RolloutEngine``): the pure-torch engine (``torch_engine``), a pool of
engines (``pool``), a frozen model beside the policy on an engine of its own (``auxiliary``: a judge, a teacher), and
vLLM's room (``vllm/``: in process, a remote server, its worker extension, and the one module that knows vLLM's CPU
platform). Names are imported on first use, so a vLLM worker that imports its extension does not import every
engine."""

from __future__ import annotations

import importlib

_HOME = {"Auxiliary": ".auxiliary", "AuxiliaryFailed": ".auxiliary", "EngineUnavailable": ".base",
         "Generation": ".base", "RolloutEngine": ".base", "Sampling": ".base", "EnginePool": ".pool",
         "TorchEngine": ".torch_engine", "VLLMEngine": ".vllm.engine", "RemoteVLLMEngine": ".vllm.remote"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)
