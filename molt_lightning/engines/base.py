"""The rollout-engine protocol every engine implements, and the bookkeeping they share.

An engine turns prompt token ids into sampled token ids with, for each token, the logprob under the distribution it
was sampled from (after temperature) and the integer policy version of the weights that sampled it.

An engine lives on its own event-loop thread: its coroutines (``generate``, ``update_weights``) and the agents that
call them run there; the trainer thread reaches it through ``call``. ``launch``/``release`` count users, so several
trainers in one process (tests, benchmark seeds) can share one engine: it shuts down when the last one lets go.
``update_weights`` may land while requests are in flight (those requests continue on the new weights, and their
per-token versions show where). The trainer owns the version numbers: the engine takes whatever it is given.
Weights arrive in buckets: ``stage_weights`` takes one (HF-named full tensors; nothing changes yet) and
``commit_weights`` swaps all staged tensors in at once and tags what is sampled from then on with the version, so a
sharded trainer never needs the whole model twice in one process; ``update_weights`` is the one-bucket shorthand.

A LoRA policy (``model.lora``) is launched with its ``Adapter`` (peft's adapter config): the engine then serves the
base model plus that adapter, and a sync carries only the adapter's tensors, under peft's names (as
``get_peft_model_state_dict`` gives them), through the same ``stage_weights``/``commit_weights``; each commit is a new
adapter version. What a sync carries is decided in one place, ``lora.sync_buckets``.
Vision-language policies: ``generate(prompt_ids, sampling, images=...)`` takes the pixel values of the images whose
image tokens the prompt holds (``vision.ImageInputs``). An engine that can condition on them sets ``accepts_images``
and implements ``_generate(prompt_ids, sampling, images)``; the others keep ``_generate(prompt_ids, sampling)``, and
a request with images is refused with an error naming the engine that takes them (on the CPU only ``TorchEngine``:
vLLM's vision models import torchvision, built for CUDA only; see ``molt_lightning.vision``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..vision import ImageInputs


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution (temperature applied)
    versions: list[int]  # policy version that sampled each token
    finish_reason: str  # "stop" (end-of-turn token or a stop id), "length" (max_tokens) or "abort"
    # mixture-of-experts policies, engines that capture (``captures_routing``): the experts each position was routed
    # to when the engine first forwarded it, (len(prompt) + len(token_ids) - 1, layers, k) int16: the prompt's and
    # the generated tokens' positions but the last generated one (never forwarded). None for a dense policy.
    routing: torch.Tensor | None = None


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep sampling past end-of-sequence (benchmarks, tests)
    seed: int | None = None  # this request's own random stream (None: the engine's shared one)
    route_key: str | None = None  # its trajectory: a pool sends all of one trajectory's turns to one engine


@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter an engine serves on top of its base model: peft's adapter config, as ``adapter_config.json``
    holds it (``LoraConfig.to_dict()`` with the target modules resolved to names). Its tensors come in the syncs."""

    config: dict

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def peft_config(self):
        from peft import LoraConfig

        fields = {k: v for k, v in self.config.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"}
        return LoraConfig(**fields)


class RolloutEngine(ABC):
    """Subclasses implement ``start``, ``_generate``, ``_stage``, ``_commit``, ``shutdown``, ``pause``, ``resume``;
    ``start`` sets ``vocab_size`` (the size of the distribution the engine samples from). An engine that records
    the experts a mixture-of-experts policy routed each position to (``Generation.routing``, for routing replay)
    sets ``captures_routing``; one that conditions on images (``generate(..., images=...)``) sets
    ``accepts_images``."""

    captures_routing = False
    accepts_images = False

    def __init__(self) -> None:
        self.version = 0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle_since: float | None = time.perf_counter()
        self._idle_s = 0.0
        self._tokens = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.model_path: str | None = None
        self.vocab_size: int | None = None
        self.adapter: Adapter | None = None  # set at launch for a LoRA policy
        self._users = 0

    # ----- lifecycle, from the trainer thread -----
    def launch(self, model_path: str, adapter: Adapter | None = None) -> None:
        """Start the loop thread and the engine on first use; later users share it (same model and adapter
        required). With ``adapter`` the engine serves the base model plus that LoRA adapter (see the module)."""
        if self._users == 0:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="molt-engine", daemon=True)
            self._thread.start()
            self.adapter = adapter
            self.call(self.start(model_path))
            self.model_path = model_path
        elif model_path != self.model_path:
            raise ValueError(f"this engine serves {self.model_path}; it cannot also serve {model_path}")
        elif adapter != self.adapter:
            serves = "a LoRA adapter" if self.adapter else "full weights"
            raise ValueError(f"this engine serves {serves} of {model_path}; it cannot also serve "
                             f"{'a LoRA adapter' if adapter else 'full weights'}: give each policy kind its own engine")
        self._users += 1

    def release(self) -> None:
        """Drop one user; the last one shuts the engine and its loop down."""
        self._users -= 1
        if self._users > 0 or self.loop is None:
            return
        try:
            self.call(self.shutdown(), timeout=120)
        finally:
            loop, self.loop = self.loop, None
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the engine's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @abstractmethod
    async def start(self, model_path: str) -> None:
        """Load the policy from a Hugging Face folder; the engine then serves version 0. With ``self.adapter`` set,
        it prepares to serve that adapter; the first adapter commit is what it then serves."""

    @abstractmethod
    async def _generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation: ...

    @abstractmethod
    async def _stage(self, bucket: Mapping[str, torch.Tensor]) -> None:
        """Keep (or write out) one bucket for the next commit (HF-named full tensors, or with ``self.adapter`` the
        adapter's peft-named tensors); serving is unchanged."""

    @abstractmethod
    async def _commit(self, version: int) -> None:
        """Swap in every staged tensor, tagging every token sampled from now on with ``version``."""

    @abstractmethod
    async def shutdown(self) -> None: ...

    @abstractmethod
    async def pause(self) -> None:
        """Freeze generation: requests in flight keep their progress and continue after ``resume``."""

    @abstractmethod
    async def resume(self) -> None: ...

    def check(self) -> None:
        """Raise if the engine can no longer serve (remote engines: down too long); called while the trainer waits."""

    async def generate(self, prompt_ids: list[int], sampling: Sampling, images: ImageInputs | None = None
                       ) -> Generation:
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        if images is not None and not self.accepts_images:
            raise NotImplementedError(
                f"{type(self).__name__} cannot condition on images: serve a vision-language policy with "
                "molt_lightning.engines.TorchEngine (vLLM's vision models need torchvision, which PyPI builds for "
                "CUDA only; see molt_lightning.vision)")
        with self._busy():
            prompt = list(prompt_ids)
            out = await (self._generate(prompt, sampling) if images is None
                         else self._generate(prompt, sampling, images))
        with self._lock:
            self._tokens += len(out.token_ids)
        return out

    async def stage_weights(self, bucket: Mapping[str, torch.Tensor]) -> None:
        await self._stage(bucket)

    async def commit_weights(self, version: int) -> None:
        await self._commit(version)
        self.version = version

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """All weights in one bucket: stage, then commit."""
        await self.stage_weights(state)
        await self.commit_weights(version)

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
