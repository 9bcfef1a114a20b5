"""The rollout-engine protocol every engine implements, and the bookkeeping they share.

An engine turns prompt token ids into sampled token ids with, for each token, the logprob under the distribution it
was sampled from (after temperature) and the integer policy version of the weights that sampled it. Its methods are
coroutines run on the rollout source's event loop; ``update_weights`` may land while requests are in flight (those
requests continue with the new weights, and their per-token versions show where).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution (temperature applied)
    versions: list[int]  # policy version that sampled each token
    finish_reason: str  # "stop" (end-of-turn token or a stop id), "length" (max_tokens) or "abort"


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


class RolloutEngine(ABC):
    """Base class: subclasses implement ``start``, ``_generate``, ``_load_weights``, ``shutdown``."""

    def __init__(self) -> None:
        self.version = 0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle_since: float | None = time.perf_counter()
        self._idle_s = 0.0
        self._tokens = 0

    @abstractmethod
    async def start(self, model_path: str) -> None:
        """Load the policy from a Hugging Face folder; the engine then serves version 0 (see ``set_version``)."""

    @abstractmethod
    async def _generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation: ...

    @abstractmethod
    async def _load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in HF-named weights, tagging every token sampled from now on with ``version``."""

    @abstractmethod
    async def shutdown(self) -> None: ...

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        with self._busy():
            out = await self._generate(list(prompt_ids), sampling)
        with self._lock:
            self._tokens += len(out.token_ids)
        return out

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        if version < self.version:
            raise ValueError(f"weight version must not go back: engine has {self.version}, got {version}")
        await self._load_weights(state, version)
        self.version = version

    def take_stats(self) -> dict[str, float]:
        """Idle seconds (no request in flight) and generated tokens since the previous call."""
        with self._lock:
            now = time.perf_counter()
            if self._idle_since is not None:
                self._idle_s += now - self._idle_since
                self._idle_since = now
            stats = {"engine_idle_s": self._idle_s, "generated_tokens": float(self._tokens)}
            self._idle_s, self._tokens = 0.0, 0
        return stats

    @contextmanager
    def _busy(self):
        with self._lock:
            if self._in_flight == 0 and self._idle_since is not None:
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle_since = time.perf_counter()
