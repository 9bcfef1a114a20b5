"""The vLLM worker's direct weight load: staged tensors (``engines.shm`` slabs) go straight into the served layers.

vLLM's ``reload_weights`` (the general path, kept as the fallback) rebuilds each layer through its loader, copies
every tensor into a fresh parameter and then runs the layer's post-processing; on the CPU that post-processing packs
each linear weight into its GEMM kernel (oneDNN) and empties the parameter. For SmolLM2 (538 MB) that took 0.34 s in
the worker, on top of the trainer's safetensors write (0.16 s) and a new file per bucket. The direct path reads the
slab's tensors where the trainer wrote them and, per served layer:

- a linear layer whose weight lives only in its kernel (the parameter is empty): the trainer's rows of the layer
  (q/k/v or gate/up are back to back in the slab, so the fused block is one view, else they are concatenated) become
  the layer's weight and vLLM's own ``dispatch_cpu_unquantized_gemm`` packs its kernel from them, reading shared
  memory once; no copy into a parameter first. A kernel that keeps a reference to its weight (the plain fallback)
  gets a private copy, since the slab is written again next sync;
- any other parameter (embeddings, norms, biases): copied in place, rows of a fused parameter at their offset; a layer
  that computes with a kept weight through a packed kernel (the embedding's, and a tied output head) is packed again,
  once per weight: layers tied to one weight share the new kernel (vLLM packs the embedding and a tied head each, so
  113 MB of SmolLM2's embedding was packed twice per sync, 0.05 s of it, and held twice).

Packing ahead (``Ahead``, on by default): the worker packs each bucket's kernels as soon as it is staged, on copies
of the layers, while the trainer stages the next bucket, and the commit only swaps them in; SmolLM2's sync takes
0.275 s against 0.347 packing at the commit (``benchmarks/weight_sync.py``, 64 MB buckets, one run), for a second
set of kernels held during the sync.

The plan is made before anything changes: a tensor the plan cannot place (mixture-of-experts experts, tensor-parallel
shards, another platform than the CPU) sends the whole update through ``reload_weights`` instead, so a load is never
half direct. An update with only some blocks of a fused layer (k_proj without q_proj, v_proj) is refused, naming the
layer, and changes nothing: its kernel can only be packed whole, and ``reload_weights`` left the other blocks as
garbage (found by this path's test; a weight sync always sends every tensor, so no run did this). The fingerprint
check (``engines.fingerprint``) reads every layer back through its kernel after each load, which proves this path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


class Locator:
    """Where a Hugging Face tensor lives in vLLM's model: the module, the parameter and the first row (fused layers:
    ``q_proj`` is the first row block of ``qkv_proj``, by ``packed_modules_mapping`` / ``output_sizes``)."""

    def __init__(self, model):
        self.modules = dict(model.named_modules())
        self.packed = getattr(model, "packed_modules_mapping", None) or {}
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)

    def locate(self, name: str):
        """(module path, module, parameter name, first row of the tensor in it) of HF ``name``; None when the model
        has no such tensor, "dropped" when vLLM's loader drops it."""
        shard = None
        if self.mapper is not None:
            mapped = self.mapper._map_name_with_shard(name)
            if mapped is None:
                return "dropped"
            name, shard = mapped
        path, _, pname = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        for fused, parts in self.packed.items():  # no mapper (or an older vLLM): q_proj -> qkv_proj's first block
            if shard is None and leaf in parts and path not in self.modules:
                path, shard = f"{parent}.{fused}" if parent else fused, parts.index(leaf)
        if (m := self.modules.get(path)) is None:
            return None
        if shard is None:
            return path, m, pname, 0
        sizes = list(getattr(m, "output_sizes", None) or [])
        index = "qkv".index(shard) if shard in ("q", "k", "v") else shard
        if not isinstance(index, int) or index >= len(sizes):
            return None
        return path, m, pname, sum(sizes[:index])


class Unplaced(Exception):
    """The direct path cannot place this update (the reason); the caller loads it through ``reload_weights``."""


def plan(model, tensors: Mapping[str, torch.Tensor], partial: bool = False, where: Locator | None = None
         ) -> list[tuple[torch.nn.Module, str, list]]:
    """[(module, parameter name, [(first row, tensor)])] for every served parameter the update touches; raises
    ``Unplaced`` when any tensor has no direct place. ``partial`` (``Ahead``: the buckets staged so far): a fused layer
    with blocks still to come is left out instead of refused."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise Unplaced("the direct load is written for vLLM's CPU kernels")
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
    ``quant_method.process_weights_after_loading``, as vLLM's loader does. ``ready`` (``Ahead.ready``): kernels already
    packed from this update, by ``id`` of their layer, swapped in instead of packed here. Returns how many were."""
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


class Ahead:
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
        for m, pname, parts in plan(self.model, self.tensors, partial=True, where=self.where):
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
