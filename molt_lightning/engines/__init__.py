"""Rollout engines behind one protocol (``RolloutEngine``): vLLM in-process, a pure-torch reference, a remote vLLM
server (``RemoteVLLMEngine``) and a pool of them (``EnginePool``)."""

from .base import EngineUnavailable, Generation, RolloutEngine, Sampling
from .pool import EnginePool
from .remote import RemoteVLLMEngine
from .torch_engine import TorchEngine
from .vllm_engine import VLLMEngine

__all__ = ["EnginePool", "EngineUnavailable", "Generation", "RemoteVLLMEngine", "RolloutEngine", "Sampling",
           "TorchEngine", "VLLMEngine"]
