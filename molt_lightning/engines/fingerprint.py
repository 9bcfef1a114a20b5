"""Weight fingerprints: a cheap proof that an engine serves the weights the trainer sent it.

A sync can fail silently: a bucket staged but never loaded, a load that did nothing, an adapter never registered, a
version tagged without a load. Every token then carries the right version number and the wrong weights, and the run
looks like it suffers from staleness. So the trainer takes a fingerprint of every tensor it sends, each engine
reports the fingerprint of what it serves after the load, and a difference stops the run (``WeightMismatch``, raised
where the load's own errors are: ``weights.WeightFlow.settle``).

A fingerprint is a tensor's shape, its dtype and a checksum over a fixed sample of its elements, the same for every
tensor of that shape: the tensor seen as rows x columns (its first dimension x the rest), ``COLS`` columns and
``SAMPLES / COLS`` rows (all of them when there are fewer; a tensor with few rows gets more columns), the first and
the last of each included, the others one in each equal stretch at a hashed offset, so no row length aliases the
sample onto one column: ``min(numel, SAMPLES)`` elements. The checksum is ``sum((i + 1) * x_i)`` over the samples in
their order, exact in float64 (``math.fsum``; a float32 value times a weight below 2**9 is exact), so it is the same
on every machine and device, and one changed sample or two swapped ones change it. Few columns, many rows: an engine
whose linear layers are repacked for its kernels (vLLM on the CPU) reads the samples back through the kernel itself,
one probe input per column (``engines/vllm/readback.py``).

Dtypes: an engine may serve another dtype than the trainer's (float32 trained, bfloat16 served), so the trainer keeps
its sampled values (``Sample``) and checks them cast to the dtype the engine reports, exactly as the engine's own load
cast them.

Written by hand (a few dozen lines) because both sides must compute the same numbers from the same code, and the
vLLM worker process imports only this package's ``engines``: nothing here needs more than torch. A hash of the bytes
(hashlib) would need every byte of every tensor on both sides, and could follow neither a cast nor a read through a
kernel; a sampled, exactly summed checksum does both for a few hundred elements a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

SAMPLES = 256  # elements per tensor at most
COLS = 4  # columns sampled (more for a tensor with few rows); an engine probing its kernels runs one input per column


@dataclass(frozen=True)
class Print:
    """What an engine serves under one name: shape, dtype and checksum (None: it cannot read that tensor back;
    ``via`` then says why, else where it was read). ``scale``: the engine serves the sent values times it (vLLM
    folds a LoRA adapter's alpha / r into B)."""

    shape: tuple[int, ...]
    dtype: str
    checksum: float | None
    via: str = ""
    scale: float = 1.0

    def to_wire(self) -> list:
        return [list(self.shape), self.dtype, self.checksum, self.via, self.scale]

    @classmethod
    def from_wire(cls, w: list | None) -> Print | None:
        return None if w is None else cls(tuple(w[0]), w[1], None if w[2] is None else float(w[2]), *w[3:])


@dataclass(frozen=True)
class Sample:
    """What the trainer sent under one name: its shape and dtype and its sampled values (a copy)."""

    shape: tuple[int, ...]
    dtype: str
    values: torch.Tensor  # (min(numel, SAMPLES),) in the sent dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> Sample:
        return cls(tuple(t.shape), dtype_name(t.dtype), sample(t))

    def print(self, dtype: str | None = None, scale: float = 1.0) -> Print:
        """The fingerprint of what was sent, as an engine serving ``dtype`` (default: the sent one) holds it (times
        ``scale``, cast as the engine's own load casts it)."""
        dtype = dtype or self.dtype
        values = self.values.to(getattr(torch, dtype))
        return Print(self.shape, dtype, checksum(values * scale if scale != 1 else values), scale=scale)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _spread(n: int, k: int) -> list[int]:
    """``k`` distinct indices in ``range(n)``: the first, the last, and one in each equal stretch between them."""
    if k >= n:
        return list(range(n))
    inner = [i * n // k + (i * 2654435761) % ((i + 1) * n // k - i * n // k) for i in range(1, k - 1)]
    return [0, *inner, n - 1][:k]


@lru_cache(maxsize=4096)
def grid(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sampled rows and columns of a tensor of ``shape`` seen as (shape[0], the rest); samples are taken row by
    row."""
    rows, cols = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    c = _spread(cols, COLS)
    r = _spread(rows, SAMPLES // max(len(c), 1))
    if 0 < len(r) < SAMPLES // max(len(c), 1):  # few rows: more columns
        c = _spread(cols, SAMPLES // len(r))
    return tuple(r), tuple(c)


@lru_cache(maxsize=4096)
def positions(shape: tuple[int, ...]) -> torch.Tensor:
    """The flat indices of the sample, (min(numel, SAMPLES),) int64 (cached: do not modify)."""
    rows, cols = grid(tuple(shape))
    width = math.prod(shape[1:]) if shape else 1
    return (torch.tensor(rows, dtype=torch.int64)[:, None] * width + torch.tensor(cols, dtype=torch.int64)).flatten()


def sample(t: torch.Tensor) -> torch.Tensor:
    """The sampled elements of ``t`` (a copy, on the CPU)."""
    if t.numel() == 0:
        return torch.zeros(0, dtype=t.dtype)
    return t.detach().reshape(-1)[positions(tuple(t.shape)).to(t.device)].cpu()


def checksum(values: torch.Tensor) -> float:
    """``sum((i + 1) * x_i)``, exactly rounded (non-finite values mapped to large finite ones)."""
    x = torch.nan_to_num(values.detach().to("cpu", torch.float64), nan=1e300, posinf=1e301, neginf=-1e301)
    return math.fsum((x * torch.arange(1, x.numel() + 1, dtype=torch.float64)).tolist())


def fingerprint(t: torch.Tensor, via: str = "") -> Print:
    """The fingerprint of ``t`` as it is (shape, dtype, checksum of its sample)."""
    return Print(tuple(t.shape), dtype_name(t.dtype), checksum(sample(t)), via)


def samples(tensors: Mapping[str, torch.Tensor]) -> dict[str, Sample]:
    return {name: Sample.of(t) for name, t in tensors.items()}


class WeightMismatch(RuntimeError):
    """An engine does not serve what the trainer sent for a version: the run stops (see the module docstring)."""

    def __init__(self, engine: str, version: int, problems: list[tuple[str, str]], total: int):
        self.engine, self.version, self.problems = engine, version, problems
        self.tensor = problems[0][0]  # the first tensor that differs or is missing
        name, what = problems[0]
        more = f" ({len(problems) - 1} more of the {total} tensors sent: {', '.join(n for n, _ in problems[1:4])}" \
               f"{', ...' if len(problems) > 4 else ''})" if len(problems) > 1 else f" (1 of the {total} sent)"
        super().__init__(
            f"molt: the engine {engine} does not serve the weights of version {version}: {name} {what}{more}. "
            f"A weight sync that did not land (a bucket staged but never loaded, a load that did nothing, an "
            f"adapter never registered, a version tagged without a load): its tokens would be tagged {version} and "
            f"sampled from other weights. Fix: follow {name} through the engine's stage -> load -> tag (an engine "
            "must load every staged tensor before it tags; one that renames or fuses weights must read each back "
            "under the trainer's name, see docs/engines.md, 'Weight fingerprints'); AsyncRLModule(verify_weights="
            "False) turns the check off.")


def verify(sent: Mapping[str, Sample], served: Mapping[str, Print | None], engine: str, version: int) -> list[str]:
    """Compare what was sent with what ``engine`` serves: raise ``WeightMismatch`` naming every tensor that differs
    or is missing; return the names the engine cannot read back (not verified)."""
    problems, unread = [], []
    for name, s in sent.items():
        p = served.get(name)
        if p is None:
            problems.append((name, f"is not served (the engine has no tensor of that name; sent {s.dtype} "
                                   f"{tuple(s.shape)})"))
        elif p.checksum is None:
            unread.append(name)
        elif (want := s.print(p.dtype, p.scale)) != Print(p.shape, p.dtype, p.checksum, scale=p.scale):
            problems.append((name, f"differs: sent {s.dtype} {tuple(s.shape)} with checksum {want.checksum!r} (as "
                                   f"{p.dtype}{f' x {p.scale}' if p.scale != 1 else ''}), served {p.dtype} "
                                   f"{tuple(p.shape)} with checksum {p.checksum!r}, read at {p.via or name}"))
    if problems:
        raise WeightMismatch(engine, version, problems, len(sent))
    return unread
