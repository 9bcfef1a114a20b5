"""Rollout engines behind one protocol (``RolloutEngine``): vLLM in-process and a pure-torch reference."""

from .base import Generation, RolloutEngine, Sampling
from .torch_engine import TorchEngine
from .vllm_engine import VLLMEngine

__all__ = ["Generation", "RolloutEngine", "Sampling", "TorchEngine", "VLLMEngine"]
