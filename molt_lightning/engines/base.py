"""The rollout-engine protocol every engine implements, the bookkeeping they share, and the one weight-update sequence.

An engine turns prompt token ids into sampled token ids with, for each token, the logprob under the distribution it
was sampled from (after temperature) and the integer policy version of the weights that sampled it.

An engine lives on its own event-loop thread: its coroutines (``generate``, the weight phases) and the agents that
call them run there; the trainer thread reaches it through ``call``. ``launch``/``release`` count users, so several
trainers in one process (tests, benchmark seeds) can share one engine: the first ``launch`` opens it (``open``, load
the policy), the last ``release`` closes it. The trainer owns the version numbers: the engine takes whatever it is
given.

Weights arrive in phases, the same for every engine, so that a pool can run them across all its engines at once:
``stage`` keeps one bucket (HF-named full tensors; nothing changes yet), ``pause`` freezes generation (requests in
flight keep their progress), ``load`` swaps every staged tensor in, ``tag`` makes every token sampled from then on
carry the new version (vLLM also drops every KV block the old weights computed), ``resume``. ``update`` is that
sequence, written once; ``commit_weights`` runs it over the engine's ``members`` (itself, or a pool's engines), so a
sharded trainer stages bucket by bucket and never needs the whole model twice in one process. Given what was sent
(``fingerprint.Sample`` by name), the update also checks, after the tag and before the resume, that every engine
serves it (``fingerprints``: read from the weights the engine computes with) and raises ``WeightMismatch`` if not.
Requests in flight during an update continue on the new weights, and their per-token versions show where.
``healthy``, ``mark_down`` and ``check`` are the health phase: an engine that is down (a remote server) keeps an
update for when it is back (``defer``).

A LoRA policy (``model.lora``) is launched with its ``Adapter`` (peft's adapter config): the engine then serves the
base model plus that adapter, and a sync carries only the adapter's tensors, under peft's names (as
``get_peft_model_state_dict`` gives them), through the same phases; each update is a new adapter version. What a sync
carries is decided in one place, ``molt_lightning.trainer.weights``.
Vision-language policies: ``generate(prompt_ids, sampling, images=...)`` takes the pixel values of the images whose
image tokens the prompt holds (``vision.ImageInputs``). An engine that can condition on them sets ``accepts_images``
and implements ``_generate(prompt_ids, sampling, images)``; the others keep ``_generate(prompt_ids, sampling)``, and
a request with images is refused with an error naming the engine that takes them (on the CPU only ``TorchEngine``:
vLLM's vision models import torchvision, built for CUDA only; see ``molt_lightning.policies.vision``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..policies.lora import Adapter
from ..policies.vision import ImageInputs
from .fingerprint import Print, Sample, verify

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """A request could not be served by a remote engine (down, timed out, refused): nothing of it is kept."""


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
    top_p: float = 1.0  # nucleus sampling: only the most likely tokens holding this much of the mass (``nucleus``)
    seed: int | None = None  # this request's own random stream (None, or an engine that takes none: the engine's)
    route_key: str | None = None  # its trajectory: a pool sends all of one trajectory's turns to one engine


def nucleus(z: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Logits ``z`` (..., V) with every token outside the top-p nucleus at -inf, by vLLM's rule (its sampler's and so
    its processed logprobs'): in ascending order, a token goes while the probability up to and including it is at
    most ``1 - top_p``; the most likely token always stays. ``top_p``: a float, or one per row (..., 1). Engines
    sample from it, the trainer recomputes logprobs under it (``trainer.policy``)."""
    if not isinstance(top_p, torch.Tensor) and top_p >= 1:
        return z
    ascending, order = z.sort(dim=-1)  # (..., V)
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # (..., V)
    drop[..., -1] = False
    return z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def derive_seed(*parts, bits: int = 62) -> int:
    """A seed of ``bits`` bits derived from ``parts`` (the run's seed and a place: an engine's index, a request's
    sample, member and turn), the same on every machine and Python."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


class RolloutEngine(ABC):
    """Subclasses implement ``open``, ``close``, ``_generate``, ``pause``, ``resume`` and the weight phases ``stage``,
    ``load``, ``tag``; ``open`` sets ``vocab_size`` (the size of the distribution the engine samples from). An engine
    that records the experts a mixture-of-experts policy routed each position to (``Generation.routing``, for routing
    replay) sets ``captures_routing``; one that conditions on images (``generate(..., images=...)``) sets
    ``accepts_images``; one that scores given tokens (``score``: a teacher's logprobs) implements ``_score``."""

    captures_routing = False
    accepts_images = False

    def __init__(self, down_timeout_s: float = 60.0) -> None:
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
        self.weights_lock: asyncio.Lock | None = None  # one update at a time (a commit, or a returning server's reload)
        self.down_timeout_s, self.where = down_timeout_s, type(self).__name__  # where: for messages
        self._down_since: float | None = None
        self._down_reason = ""
        self.expected: Mapping[str, Sample] | None = None  # what the last update sent (checked again on a rejoin)
        self.verified = False  # the last update's fingerprints matched, every tensor read back
        self._warned_unverified = False
        self.seed: int | None = None  # the engine's own random stream; None: derived at launch (``seed_from``)

    def seed_from(self, run_seed: int, index: int = 0) -> None:
        """Unless given one, take the seed of engine ``index`` of a run seeded ``run_seed``: every engine of a run
        (a pool's servers) samples from a stream of its own, and a rerun from the same ones."""
        if self.seed is None:
            self.seed = derive_seed(run_seed, "engine", index, bits=31)

    # ----- lifecycle, from the trainer thread -----
    def launch(self, model_path: str, adapter: Adapter | None = None) -> None:
        """Start the loop thread and open the engine on first use; later users share it (same model and adapter
        required). With ``adapter`` the engine serves the base model plus that LoRA adapter (see the module)."""
        if self._users == 0:
            self.seed_from(0)  # a run has given its seed by now (the module); anyone else gets run seed 0's
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="molt-engine", daemon=True)
            self._thread.start()
            self.adapter, self.weights_lock = adapter, None  # made on the new loop by the first update
            self.call(self.open(model_path))
            self.model_path = model_path
        elif model_path != self.model_path:
            raise ValueError(f"this engine serves {self.model_path}; it cannot also serve {model_path}")
        elif adapter != self.adapter:
            serves = "a LoRA adapter" if self.adapter else "full weights"
            raise ValueError(f"this engine serves {serves} of {model_path}; it cannot also serve "
                             f"{'a LoRA adapter' if adapter else 'full weights'}: give each policy kind its own engine")
        self._users += 1

    def release(self) -> None:
        """Drop one user; the last one closes the engine and stops its loop."""
        self._users -= 1
        if self._users > 0 or self.loop is None:
            return
        try:
            self.call(self.close(), timeout=120)
        finally:
            loop, self.loop = self.loop, None
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the engine's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @abstractmethod
    async def open(self, model_path: str) -> None:
        """Load the policy from a Hugging Face folder; the engine then serves version 0. With ``self.adapter`` set,
        it prepares to serve that adapter; the first adapter update is what it then serves."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def _generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation: ...

    @abstractmethod
    async def pause(self) -> None:
        """Freeze generation: requests in flight keep their progress and continue after ``resume``."""

    @abstractmethod
    async def resume(self) -> None: ...

    # ----- the weight phases (``update`` runs them; a pool's members are its engines) -----
    async def stage(self, bucket: Mapping[str, torch.Tensor]) -> None:
        """Keep (a copy of) one bucket for the next load (HF-named full tensors, or with ``self.adapter`` the adapter's
        peft-named tensors); serving is unchanged."""
        raise NotImplementedError

    async def load(self) -> None:
        """(Paused.) Swap in every staged tensor."""
        raise NotImplementedError

    async def tag(self, version: int) -> None:
        """(Paused, loaded.) Every token sampled from now on carries ``version``; nothing computed by the old weights
        (a KV cache) is used again."""
        raise NotImplementedError

    async def fingerprints(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Print | None]:
        """(Loaded, tagged.) The fingerprint of what the engine serves under each of the trainer's names (HF names,
        or the adapter's peft names), read from the weights it computes with, not from what it was sent; None for a
        name it serves no tensor under. An engine that cannot read its weights back raises ``NotImplementedError``:
        its syncs are then not verified (a warning, ``sync/verified`` 0)."""
        raise NotImplementedError

    def defer(self, version: int) -> None:
        """(Down.) Keep the staged update as ``version`` for when the engine is back (an in-process engine is never
        down; ``RemoteVLLMEngine`` keeps it)."""

    @property
    def members(self) -> list[RolloutEngine]:
        """The engines a weight update reaches: this one (a pool: its engines)."""
        return [self]

    async def stage_weights(self, bucket: Mapping[str, torch.Tensor]) -> None:
        for engine in self.members:  # every engine, up or down: one that comes back loads the latest update
            await engine.stage(bucket)

    async def commit_weights(self, version: int, expected: Mapping[str, Sample] | None = None) -> bool:
        """Load everything staged as ``version`` (``update``); with ``expected`` (what was sent), check that every
        engine serves it. True when every member took the update and its fingerprints matched in full."""
        await update(self.members, version, expected=expected)
        self.version = version
        return expected is not None and all(e.verified for e in self.members)

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """All weights in one bucket: stage, then commit."""
        await self.stage_weights(state)
        await self.commit_weights(version)

    # ----- health -----
    @property
    def healthy(self) -> bool:
        return self._down_since is None

    def mark_down(self, reason: str) -> None:
        if self._down_since is None:
            log.warning("the engine %s is down: %s", self.where, reason)
            self._down_since = time.monotonic()
        self._down_reason = reason

    def check(self) -> None:
        """Raise once the engine has been down longer than ``down_timeout_s`` (called while the trainer waits)."""
        if self._down_since is not None and time.monotonic() - self._down_since > self.down_timeout_s:
            raise EngineUnavailable(f"the engine {self.where} has been down for more than {self.down_timeout_s:.0f} "
                                    f"s ({self._down_reason}); restart its server (`molt serve`) or raise "
                                    "down_timeout_s")

    # ----- generation -----
    async def generate(self, prompt_ids: list[int], sampling: Sampling, images: ImageInputs | None = None
                       ) -> Generation:
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        if images is not None and not self.accepts_images:
            raise NotImplementedError(
                f"{type(self).__name__} cannot condition on images: serve a vision-language policy with "
                "molt_lightning.engines.TorchEngine (vLLM's vision models need torchvision, which PyPI builds for "
                "CUDA only; see molt_lightning.policies.vision)")
        with self._busy():
            prompt = list(prompt_ids)
            out = await (self._generate(prompt, sampling) if images is None
                         else self._generate(prompt, sampling, images))
        with self._lock:
            self._tokens += len(out.token_ids)
        return out

    # ----- scoring (a teacher on an engine) -----
    async def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for every i in [start, len(token_ids)), under softmax(logits /
        temperature) (no top-p, no top-k): what the trainer's frozen teacher computes
        (``trainer.policy.Policy.outputs(...).logprobs``), so a teacher served by an engine can score the tokens
        another model sampled (on-policy distillation). The engine's current weights; counted like a request."""
        if not 1 <= start < len(token_ids):
            raise ValueError(f"score needs 1 <= start < len(token_ids) (every scored token has a context): got start "
                             f"{start} for {len(token_ids)} tokens")
        if not temperature > 0:
            raise ValueError(f"score needs a temperature > 0, got {temperature}")
        with self._busy():
            return await self._score(list(token_ids), start, temperature)

    def check_score(self, temperature: float) -> None:
        """Raise, naming the fix, if this engine cannot ``score`` at ``temperature`` (asked before a run starts)."""
        if type(self)._score is RolloutEngine._score:
            raise NotImplementedError(f"{type(self).__name__} cannot score tokens (a teacher's logprobs): use "
                                      "TorchEngine, VLLMEngine, RemoteVLLMEngine or EnginePool")

    async def _score(self, token_ids: list[int], start: int, temperature: float) -> list[float]:
        self.check_score(temperature)
        raise NotImplementedError

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


async def update(engines: list[RolloutEngine], version: int, rejoin: bool = False,
                 expected: Mapping[str, Sample] | None = None) -> list[RolloutEngine]:
    """The weight-update sequence, stage -> pause -> load -> tag -> check -> resume, for one engine or every engine of
    a pool at once: each engine that serves is paused, loads its staged buckets and is tagged with ``version``; only
    then do they all resume, so no engine samples a token of ``version`` while another still loads it, and each
    engine's per-token versions stay its own exact ones. With ``expected`` (what was sent), each engine's
    fingerprints are checked before the resume (``WeightMismatch``). An engine that is down, or goes down on the way
    (``EngineUnavailable``), is marked down and keeps the update for when it is back (``defer``). ``rejoin``: the
    engines were down and answer again; they load what they hold before they serve. Returns the engines that took the
    update."""

    async def each(engines: list[RolloutEngine], phase: Callable[[RolloutEngine], Awaitable]) -> list[RolloutEngine]:
        """``phase`` on every engine at once; those that fail with ``EngineUnavailable`` drop out, marked down."""
        results = await asyncio.gather(*(phase(e) for e in engines), return_exceptions=True)
        for engine, result in zip(engines, results):
            if isinstance(result, EngineUnavailable):
                engine.mark_down(f"the update to version {version} failed: {result}")
            elif isinstance(result, BaseException):
                raise result
        return [e for e, r in zip(engines, results) if not isinstance(r, BaseException)]

    async def check(engine: RolloutEngine) -> None:
        try:
            served = await engine.fingerprints({name: s.shape for name, s in expected.items()})
        except NotImplementedError:
            served, unread = None, list(expected)
        else:
            where = engine.where if len(engines) == 1 else f"{engine.where} (engine {engines.index(engine) + 1} of " \
                                                           f"{len(engines)})"
            unread = verify(expected, served, where, version)
        if unread and not engine._warned_unverified:  # once per engine: the same tensors every sync
            engine._warned_unverified = True
            why = served[unread[0]].via if served else "it reports no fingerprints"
            log.warning("the engine %s does not read back %d of the %d tensors a sync sends (%s: %s): those are not "
                        "verified, sync/verified stays 0", engine.where, len(unread), len(expected), unread[0], why)
        engine.verified = not unread

    async with AsyncExitStack() as locks:  # no engine's own reload (after a restart) runs during the update
        for engine in engines:
            engine.weights_lock = engine.weights_lock or asyncio.Lock()
            await locks.enter_async_context(engine.weights_lock)
            engine.verified, engine.expected = False, expected
        live = await each([e for e in engines if rejoin or e.healthy], lambda e: e.pause())
        try:
            live = await each(await each(live, lambda e: e.load()), lambda e: e.tag(version))
            if expected is not None:
                live = await each(live, check)
        finally:
            live = await each(live, lambda e: e.resume())
        for engine in engines:
            if engine in live:
                engine.version = version
            else:
                engine.defer(version)
    return live
