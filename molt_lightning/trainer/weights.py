"""The weight flow, trainer -> engine, in one room: what a sync carries, gathered under any strategy, in buckets, and
pushed to the engine as a policy version, with one load in flight.

- **What** (``buckets``): every parameter under its Hugging Face name (full fine-tuning), or a LoRA policy's adapter
  tensors only, under peft's names (``get_peft_model_state_dict``: ``base_model.model.<module>.lora_A.weight`` ...),
  as one snapshot bucket (adapters are small; the engine serves them on top of the base it was launched with).
- **Gathering**: one process and DDP send the parameters as they are. Under FSDP2 (``fsdp2``, ``fsdp2_ep``) each
  parameter is a DTensor (FSDP2's shards; the experts' ``Shard(0)`` blocks under expert parallelism) and
  ``full_tensor()`` all-gathers it, so every rank iterates the buckets and takes part in each all-gather; rank 0
  keeps them. Tied parameters (embeddings = output head) appear once (``named_parameters`` deduplicates them).
- **Bucketing**: about ``bucket_bytes`` per bucket; rank 0 stages each into the engine as it is gathered, so it holds
  one gathered bucket at a time rather than a second copy of the model.
- **Pushing** (``WeightFlow.push``): stage every bucket, then have the engine load and tag the version without waiting
  for it (``RolloutEngine.commit_weights``: pause, load, tag, resume); the trainer runs its next step meanwhile, and
  tokens stay tagged exactly (the engine switches versions between tokens). One load is in flight at most: the next
  push, and whoever needs the version (``settle``: a batch that needs it, the start and the end of a run), waits for
  it and gets its error, if any. ``on_loaded`` is called when a load ends (the rollout source's admission looks at
  the engine's version).
- **Verifying** (``verify``, on by default): as each bucket is staged, the trainer keeps a fingerprint sample of each
  tensor (``engines.fingerprint``: 256 elements at most, no extra gather); the load in flight ends with every engine
  reporting the fingerprints of what it then serves, and a tensor that differs or is missing fails the load
  (``WeightMismatch``, naming the tensor, the version and the engine), so ``settle`` raises it like any load error.
  ``verified``: the last finished sync matched on every engine, every tensor read back (``sync/verified``).

The engine is reached directly (``engine.call`` on its loop); the rollout side is not involved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from ..engines.base import RolloutEngine
from ..engines.fingerprint import Sample, samples
from ..policies.lora import is_lora
from .parallel import is_sharded


def buckets(lm: torch.nn.Module, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """What a weight sync carries, bucket by bucket (see the module docstring); under FSDP2 every rank must iterate."""
    if is_lora(lm):
        from peft import get_peft_model_state_dict

        # a snapshot: the engine may still be loading it when the next optimizer step changes the adapter
        yield {k: v.detach().clone() for k, v in get_peft_model_state_dict(lm, save_embedding_layers=False).items()}
        return
    from torch.distributed.tensor import DTensor

    bucket, size = {}, 0
    for name, p in lm.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


class WeightFlow:
    """Pushes the policy's weights to ``engine`` (rank 0's; the other ranks only help gather them)."""

    def __init__(self, engine: RolloutEngine, verify: bool = True):
        self.engine, self.verify = engine, verify
        self.on_loaded: Callable[[], None] = lambda: None
        self.verified = False  # the last finished load's fingerprints matched on every engine
        self._loading: Future | None = None  # the engine's load in flight, if any

    def push(self, lm: torch.nn.Module, version: int, trainer, bucket_bytes: int) -> tuple[float, int]:
        """Send ``lm``'s weights as ``version``; returns the seconds it took (not the engine's load, which overlaps
        the next step) and the bytes sent."""
        t0, sent = time.perf_counter(), 0
        rank0 = trainer.global_rank == 0
        expected: dict[str, Sample] | None = {} if self.verify else None
        if rank0 or is_sharded(trainer.strategy):
            for bucket in buckets(lm, bucket_bytes):
                sent += sum(t.numel() * t.element_size() for t in bucket.values())
                if rank0:
                    self.settle()  # the previous load is done (its files read, its version serving) first
                    if expected is not None:
                        expected.update(samples(bucket))
                    self.engine.call(self.engine.stage_weights(bucket))
            if rank0:
                self._loading = asyncio.run_coroutine_threadsafe(self.engine.commit_weights(version, expected),
                                                                 self.engine.loop)
                self._loading.add_done_callback(self._loaded)
        return time.perf_counter() - t0, sent

    def _loaded(self, loading: Future) -> None:
        self.verified = not loading.cancelled() and loading.exception() is None and bool(loading.result())
        self.on_loaded()

    def metrics(self) -> dict[str, float]:
        """``sync/verified`` (with ``verify``): 1 when the last finished sync's fingerprints matched on every engine."""
        return {"sync/verified": float(self.verified)} if self.verify else {}

    @property
    def pending(self) -> Future | None:
        """The engine's load in flight (a future that ends when it serves the pushed version), or None."""
        return self._loading

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the load in flight, if any (its error is raised here)."""
        loading, self._loading = self._loading, None
        if loading is not None:
            loading.result(timeout)
