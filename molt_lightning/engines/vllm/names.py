"""How a Hugging Face tensor name maps onto vLLM's model, on every platform: where it lives (``Locator``: the module,
the parameter and the first row, fused layers by ``packed_modules_mapping``/``output_sizes``) and the names vLLM's
loaders expect for it (``checkpoint_names``: a MoE layer's fused experts split per expert). The fingerprint read-back
(``readback``) and the CPU platform's direct load (``cpu``) both place tensors with it."""

from __future__ import annotations


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


def checkpoint_names(name: str, t):
    """A trainer tensor under the names vLLM's loaders expect. transformers 5 holds a MoE layer's experts fused, as
    ``experts.gate_up_proj`` (E, 2I, H: gate rows, then up rows) and ``experts.down_proj`` (E, H, I), but saves (and
    vLLM loads) checkpoints per expert, ``experts.{e}.{gate,up,down}_proj.weight``: loading the fused names left
    vLLM's experts at their old values (found by the MoE loop check: layer-1 routing agreed on half the positions)."""
    prefix, _, last = name.rpartition(".")
    if prefix.endswith("mlp.experts") and last == "gate_up_proj":
        gate, up = t.chunk(2, dim=1)  # (E, I, H) each
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", gate[e]
            yield f"{prefix}.{e}.up_proj.weight", up[e]
    elif prefix.endswith("mlp.experts") and last == "down_proj":
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", t[e]  # (H, I)
    else:
        yield name, t
