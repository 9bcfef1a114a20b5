"""Sampling clients on molt's engines: each sampler is frozen weights; engines are slots bound to one sampler at a time.

A sampler (``save_weights_for_sampler``, ``create_sampling_session``) is a ``training.Snapshot`` (the adapter's
tensors copied when it was made, with the policy version they had) or the base model. An engine (``TorchEngine``, or
``VLLMEngine`` with ``--engine vllm``: an engine core process per slot; launched on the model folder with the
sampler's adapter config) serves one sampler at a time: a request for a sampler
no engine holds waits for an idle engine of its kind (none in flight) and rebinds it with ``update_weights``, whose
fingerprints are read back from the engine (``engines.fingerprint``: ``frozen_ok`` fails otherwise). So a sampler
is frozen by construction: later ``optim_step``s change the training model, never a snapshot, and no request runs on
an engine while it is rebound. Every token the engine samples carries the snapshot's version (``Generation.versions``),
which the server writes to its run folder. At most ``per_kind`` engines per adapter config (LRU).

Tinker's sampling semantics on top of ``engines.base.Sampling``: ``stop`` None (the end-of-turn/EOS ids), a list of
token ids (those and no EOS), a list of strings (cut after the first completed string, by decoded text), ``[]``
(nothing stops it); ``prompt_logprobs`` by the engine's ``score`` with NaN for the first position. ``top_k`` other
than -1/0 is refused: molt samples untruncated or top-p (``docs/architecture.md``, processed logprobs).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace

from ..engines import TorchEngine
from ..engines.base import RolloutEngine, Sampling, derive_seed
from ..engines.fingerprint import samples
from .training import Snapshot
from .wire import Sequence, UserError

ENGINES = ("torch", "vllm")


@dataclass
class Sampler:
    sampler_id: str
    snapshot: Snapshot | None  # None: the base model
    model_id: str | None = None
    path: str | None = None  # tinker:// path, for one made from saved weights

    @property
    def version(self) -> int:
        return 0 if self.snapshot is None else self.snapshot.version

    @property
    def kind(self) -> str:
        if self.snapshot is None:
            return "base"
        if self.snapshot.adapter is None:
            return "full"
        config = self.snapshot.adapter.config  # what shapes the engine's adapter layers (in memory or read from disk)
        return json.dumps([config["r"], config["lora_alpha"], sorted(config["target_modules"])])


@dataclass
class Slot:
    engine: RolloutEngine
    kind: str
    bound: str | None = None
    in_flight: int = 0
    used: float = 0.0
    ready: asyncio.Future | None = None
    verified: list[bool] = field(default_factory=list)  # each rebind's fingerprint check


class Pool:
    def __init__(self, folder: str, tokenizer, per_kind: int = 2, device: str = "cpu", engine: str = "torch"):
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: use one of {ENGINES}")
        self.folder, self.tokenizer, self.per_kind, self.device, self.engine = folder, tokenizer, per_kind, device, \
            engine
        self.slots: list[Slot] = []
        self._changed = asyncio.Condition()

    async def _acquire(self, sampler: Sampler) -> Slot:
        async with self._changed:
            while True:
                slot = next((s for s in self.slots if s.bound == sampler.sampler_id), None)
                if slot is None:
                    mine = [s for s in self.slots if s.kind == sampler.kind]
                    idle = [s for s in mine if s.in_flight == 0]
                    if idle or len(mine) < self.per_kind:
                        slot = min(idle, key=lambda s: s.used) if idle else self._new(sampler)
                        slot.bound, slot.ready = sampler.sampler_id, asyncio.ensure_future(self._bind(slot, sampler))
                if slot is not None:
                    break
                await self._changed.wait()
            slot.in_flight += 1
            slot.used = time.monotonic()
        try:
            await asyncio.shield(slot.ready)
        except BaseException:
            await self._release(slot, failed=True)
            raise
        return slot

    def _new(self, sampler: Sampler) -> Slot:
        if self.engine == "vllm":  # a process of its own (an engine core) per slot
            from ..engines import VLLMEngine

            engine = VLLMEngine(dtype="float32" if self.device == "cpu" else None, seed=len(self.slots))
        else:
            engine = TorchEngine(device=self.device, seed=len(self.slots))
        slot = Slot(engine, sampler.kind)
        self.slots.append(slot)
        return slot

    async def _bind(self, slot: Slot, sampler: Sampler) -> None:
        engine = slot.engine
        if engine.loop is None:  # first use: load the model (and the adapter's empty layers) on the engine's thread
            adapter = None if sampler.snapshot is None else sampler.snapshot.adapter
            await asyncio.to_thread(engine.launch, self.folder, adapter)
        if sampler.snapshot is not None:
            state = sampler.snapshot.state
            ok = await _on(engine, _load(engine, state, sampler.version))
            slot.verified.append(ok)
            if not ok:
                raise RuntimeError(f"the engine does not serve sampler {sampler.sampler_id}'s weights (fingerprints "
                                   "differ after the load)")

    async def _release(self, slot: Slot, failed: bool = False) -> None:
        async with self._changed:
            slot.in_flight -= 1
            if failed and slot.in_flight == 0:
                slot.bound = None
            self._changed.notify_all()

    async def sample(self, sampler: Sampler, prompt: list[int], n: int, params: dict, prompt_logprobs: bool
                     ) -> tuple[list[Sequence], list[list[int]], list[float] | None]:
        """``n`` sequences (and each token's policy version), and the prompt's logprobs when asked."""
        sampling, stop_strings = self._sampling(params)
        slot = await self._acquire(sampler)
        try:
            engine = slot.engine
            base = params.get("seed")
            gens = await asyncio.gather(*(_on(engine, engine.generate(prompt, _seeded(sampling, base, i)))
                                          for i in range(n)))
            scored = None
            if prompt_logprobs:
                scored = [float("nan")] + (await _on(engine, engine.score(prompt, 1)) if len(prompt) > 1 else [])
        finally:
            await self._release(slot)
        out, versions = [], []
        for g in gens:
            tokens, lps, vers, stopped = g.token_ids, g.logprobs, g.versions, g.finish_reason == "stop"
            cut = _cut(self.tokenizer, tokens, stop_strings) if stop_strings else None
            if cut is not None:
                tokens, lps, vers, stopped = tokens[:cut], lps[:cut], vers[:cut], True
            out.append(Sequence(tokens, lps, stopped))
            versions.append(vers)
        return out, versions, scored

    def _sampling(self, params: dict) -> tuple[Sampling, list[str]]:
        top_k = params.get("top_k", -1)
        if top_k not in (-1, 0, None):
            raise UserError(f"top_k={top_k}: molt tinker samples from the full distribution or a top-p nucleus, whose "
                            "logprobs the trainer can recompute; use top_p, or top_k=-1")
        stop = params.get("stop")
        strings = [stop] if isinstance(stop, str) else [s for s in (stop or []) if isinstance(s, str)]
        ids = tuple(s for s in (stop or []) if isinstance(s, int)) if not isinstance(stop, str) else ()
        if strings and ids:
            raise UserError("stop mixes strings and token ids: give one kind")
        max_tokens = params.get("max_tokens")
        if not max_tokens or max_tokens < 1:
            raise UserError(f"sampling_params.max_tokens must be >= 1, got {max_tokens}")
        return Sampling(max_tokens=int(max_tokens), temperature=float(params.get("temperature", 1.0)),
                        top_p=float(params.get("top_p", 1.0)), stop_token_ids=ids,
                        ignore_eos=bool(ids) or stop == []), strings

    def close(self) -> None:
        for slot in self.slots:
            if slot.engine.loop is not None:
                slot.engine.release()


def _seeded(sampling: Sampling, seed: int | None, i: int) -> Sampling:
    return sampling if seed is None else replace(sampling, seed=derive_seed(int(seed), i))


async def _load(engine: RolloutEngine, state: dict, version: int) -> bool:
    """(On the engine's loop.) Serve ``state`` as ``version``; True when its fingerprints read back as sent."""
    await engine.stage_weights(state)
    return await engine.commit_weights(version, expected=samples(state))


async def _on(engine: RolloutEngine, coro):
    """Await a coroutine on the engine's own loop thread from the server's loop."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, engine.loop))


def _cut(tokenizer, tokens: list[int], stops: list[str]) -> int | None:
    """The number of tokens up to and including the one that completes the first stop string, or None."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n])
        if any(s in text for s in stops):
            return n
    return None
