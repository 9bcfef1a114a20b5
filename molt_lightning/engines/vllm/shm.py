"""Weight buckets in shared memory, reused from sync to sync: how the trainer hands tensors to a vLLM worker on the
same machine without serializing them.

``Staging.write(bucket)`` copies a bucket's tensors into a file under ``/dev/shm`` (memory, not disk), each at its
own 64-byte-aligned offset, and returns a ``Slab`` (the path and an index: name, dtype, shape, offset). The file of a
bucket with the same names, shapes and dtypes is written again in place on the next sync: no new file, no page
faults, no safetensors header (a new safetensors file per bucket cost 0.16 s of SmolLM2's 0.8 s sync). Tensors lie in
the bucket's order, so the row blocks of a layer that vLLM serves fused (q/k/v, gate/up: adjacent in a Hugging Face
model's parameter order) lie back to back, and the worker hands the fused block to its kernel as one view
(``cpu``). ``read(slab)`` is the worker's side: zero-copy tensors over a mapping of the file, kept open.

Safety: a slab is written again only for the next sync, and the weight flow starts staging a sync only once the
previous load has finished (``WeightFlow.push`` settles first), so a worker never reads a slab while it is written.
``forget()`` (the in-process engine, once its worker has mapped the files) unlinks the names, so a trainer that is
SIGKILLed leaves nothing in ``/dev/shm``; the mappings live on until both processes drop them. Written by hand: the
tensors must sit where a worker in another process can view them without a copy, which ``safetensors`` (it copies
into new tensors) and ``torch.multiprocessing`` (its own handle protocol, not a path a server could open) do not do.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch

ALIGN = 64


@dataclass(frozen=True)
class Slab:
    """One staged bucket: ``path`` and ``index`` [(name, dtype name, shape, byte offset)], picklable and JSON-able."""

    path: str
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]

    def to_wire(self) -> list:
        return [self.path, [[n, d, list(s), o] for n, d, s, o in self.index]]

    @staticmethod
    def from_wire(wire) -> Slab:
        if isinstance(wire, Slab):
            return wire
        path, index = wire
        return Slab(path, tuple((n, d, tuple(s), int(o)) for n, d, s, o in index))


class Staging:
    """The trainer's slabs, one per bucket layout (``copies`` per layout, used in turn), written again in place.

    ``copies=2`` (the remote engine): the slab of the update a server serves stays intact while the next update is
    staged, so a server that restarts meanwhile reloads exactly the version it is tagged with."""

    def __init__(self, folder: str | None, copies: int = 1):
        self.folder, self.copies = folder, copies
        self._slabs: dict[tuple, tuple[Slab, torch.Tensor]] = {}  # (layout, copy) -> (slab, its bytes as uint8)
        self._turn: dict[tuple, int] = {}

    def write(self, bucket: Mapping[str, torch.Tensor]) -> Slab:
        tensors = {k: v.detach() for k, v in bucket.items()}
        layout = tuple((k, str(v.dtype), tuple(v.shape)) for k, v in tensors.items())
        turn = self._turn[layout] = (self._turn.get(layout, -1) + 1) % self.copies
        key = (layout, turn)
        if key not in self._slabs:
            self._slabs[key] = self._create(tensors)
        slab, base = self._slabs[key]
        for (name, _, _, offset), t in zip(slab.index, tensors.values()):
            _view(base, t.dtype, t.shape, offset).copy_(t)
        return slab

    def _create(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Slab, torch.Tensor]:
        index, size = [], 0
        for name, t in tensors.items():
            index.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), size))
            size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        fd, path = tempfile.mkstemp(suffix=".slab", prefix="molt-weights-", dir=self.folder)
        try:
            os.ftruncate(fd, max(size, 1))
            buf = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        return Slab(path, tuple(index)), _bytes(buf)

    def forget(self) -> None:
        """Unlink every slab's name (the mappings stay): call once the reader has opened them."""
        for slab, _ in self._slabs.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slab.path)

    def close(self) -> None:
        self.forget()
        self._slabs.clear()  # the mappings close with their last view

    @property
    def paths(self) -> list[str]:
        return [slab.path for slab, _ in self._slabs.values()]


_mapped: dict[str, torch.Tensor] = {}  # the reader's mappings by path, as uint8 tensors, kept for the next sync


def read(slabs: list, live: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The slabs' tensors, as views of their files (no copy; the tensors of one slab share one storage, so row
    blocks that lie back to back can be viewed as one). Mappings are kept for the next sync's read, except those of
    slabs the trainer no longer has (not in ``live``, the trainer's ``Staging.paths``): a server outlives trainers,
    and an old trainer's slabs must not pile up."""
    slabs = [Slab.from_wire(s) for s in slabs]
    out = {}
    for slab in slabs:
        base = _mapped.get(slab.path)
        if base is None:
            try:
                with open(slab.path, "r+b") as f:
                    base = _mapped[slab.path] = _bytes(mmap.mmap(f.fileno(), 0))
            except FileNotFoundError:
                raise FileNotFoundError(f"weight slab {slab.path} is gone: the engine reads weights from files the "
                                        "trainer writes on this machine (/dev/shm); a server on another machine "
                                        "needs channel='http' or 'nccl'") from None
        out.update({name: _view(base, getattr(torch, dtype), shape, offset)
                    for name, dtype, shape, offset in slab.index})
    if live is not None:
        for path in set(_mapped) - set(live) - {slab.path for slab in slabs}:
            del _mapped[path]
    return out


def _bytes(buf: mmap.mmap) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # "The given buffer is not writable": it is (a shared, writable mapping)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def _view(base: torch.Tensor, dtype: torch.dtype, shape, offset: int) -> torch.Tensor:
    return base[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
