"""Reading back what a vLLM worker serves, for the weight fingerprints (``engines.fingerprint``), on every platform:
``Reader`` reads a trainer tensor's sample through the layer that computes with it (a fused layer by block, a linear
layer through its own kernel), ``adapter_prints`` a LoRA adapter as vLLM holds it. The worker extension calls them."""

from __future__ import annotations


class Reader:
    """Reads the fingerprint sample of a trainer tensor (HF name and shape) from what the worker serves.

    vLLM fuses and repacks weights: ``q_proj``/``k_proj``/``v_proj`` are row blocks of ``qkv_proj``, ``gate_proj``/
    ``up_proj`` of ``gate_up_proj`` (the model's ``packed_modules_mapping``, the blocks' sizes in the layer's
    ``output_sizes``), and on the CPU a linear weight lives only inside its GEMM kernel (the parameter is emptied). So
    a linear layer's weight (a ``LinearBase``, the output head) is read through the layer's own kernel: one one-hot
    probe input per sampled column with the bias off (``quant_method.apply``) returns exactly that column's served
    weights. That proves what the layer computes with, a kernel packed from old weights included, which reading the
    parameter could not. Other parameters (embeddings, norms, biases) are read as they are, and one that a linear
    layer shares (a tied output head) is read through that layer's kernel too; a reading that differs is the one
    reported. Not read back (checksum None, the reason in ``via``): mixture-of-experts expert weights (repacked in
    place by the CPU kernel) and tensor-parallel shards (each worker holds a part)."""

    def __init__(self, model, dtype):
        import torch
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        from .names import Locator

        self.dtype, self.kernels = dtype, (LinearBase, ParallelLMHead)
        self.locate = Locator(model).locate
        self.modules = dict(model.named_modules())
        self.sharers: dict[int, list[str]] = {}  # id(weight) -> the linear layers that compute with it
        self.probed: dict[tuple, object] = {}  # (layer, columns) -> its kernel's output (q, k, v share qkv_proj's)
        for path, m in self.modules.items():
            if isinstance(m, self.kernels) and isinstance(getattr(m, "weight", None), torch.Tensor):
                self.sharers.setdefault(id(m.weight), []).append(path)

    def print(self, name: str, shape: tuple[int, ...]):
        import math

        import torch

        from ..fingerprint import Print, checksum, dtype_name, grid

        dtype = dtype_name(self.dtype)
        if ".experts." in name:  # HF's fused experts.gate_up_proj / down_proj, or per-expert tensors
            return Print(shape, dtype, None, "expert weights are not read back (repacked by the CPU MoE kernel)")
        where = self.locate(name)
        if where == "dropped":
            return Print(shape, dtype, None, "vLLM's loader drops this weight")
        param = getattr(where[1], where[2], None) if where else None
        if not isinstance(param, torch.Tensor):
            return None
        path, m, pname, first = where
        if getattr(m, "tp_size", 1) > 1:
            return Print(shape, dtype, None, "tensor-parallel shards are not read back")
        rows, cols = grid(shape)
        rows = [first + r for r in rows]
        via = f"{path}.{pname}" + (f" rows {first}:{first + shape[0]}" if first else "")
        if isinstance(m, self.kernels) and pname == "weight":  # the kernel is what serves
            got = self._probe(m, rows, cols, shape, first)
            return got if isinstance(got, Print) else Print(shape, dtype, checksum(got), f"{via} (its kernel)")
        view = param.detach().reshape(param.shape[0] if param.dim() else 1, -1)
        if view.shape[1] != math.prod(shape[1:]) or first + (shape[0] if shape else 1) > view.shape[0]:
            return Print(tuple(param.shape), dtype, None, f"{via} has another shape")
        values = view[rows][:, list(cols)].to("cpu", self.dtype).flatten()
        for other in self.sharers.get(id(param), []):  # a tied output head computes with it: read it there too
            if other != path:
                got = self._probe(self.modules[other], rows, cols, shape, first)
                if not isinstance(got, Print) and not torch.equal(got, values):
                    return Print(shape, dtype, checksum(got), f"{other}.weight (tied to {path}.{pname}; its kernel)")
        return Print(shape, dtype, checksum(values), via)

    def _probe(self, m, rows: list[int], cols: tuple[int, ...], shape: tuple[int, ...], first: int):
        """Linear layer ``m``'s served weights at ``rows`` x ``cols``, row by row, through its kernel (or a Print
        saying why not)."""
        import torch

        from ..fingerprint import Print, dtype_name

        k, n = (next((v for a in names if (v := getattr(m, a, None)) is not None), None) for names in (
            ("input_size_per_partition", "embedding_dim", "input_size"),  # column/row-parallel, head, replicated
            ("output_size_per_partition", "num_embeddings_per_partition", "output_size")))
        if len(shape) != 2 or shape[1] != k or first + shape[0] > n:
            return Print((n, k), dtype_name(self.dtype), None, f"the served layer is ({n}, {k}) from row {first}")
        out = self.probed.get((id(m), cols))
        if out is None:
            probe = torch.zeros(len(cols), k, dtype=self.dtype, device=m.weight.device)
            probe[torch.arange(len(cols)), torch.tensor(cols)] = 1
            # one input at a time: a one-row input is what decoding runs, so the kernel is ready for it (oneDNN on
            # the CPU builds a kernel per input row count: a 4-row probe cost 6 ms a layer, four 1-row ones 0.9 ms)
            out = self.probed[id(m), cols] = torch.cat([m.quant_method.apply(m, probe[j:j + 1], bias=None)
                                                        for j in range(len(cols))])  # (cols, n): column j's weights
        return out[:, rows].T.to("cpu", self.dtype).flatten()


def adapter_prints(runner, lora_id: int, shapes: dict[str, list[int]]) -> dict:
    """The fingerprints of the LoRA adapter vLLM holds under ``lora_id``, by peft name (``lora_A`` as loaded,
    ``lora_B`` with vLLM's scaling folded in: the engine sets ``Print.scale``); the projections of a fused layer
    (``qkv_proj``) are its entries in ``packed_modules_mapping``'s order. An adapter vLLM does not hold: all None."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from ..fingerprint import fingerprint

    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    lora = manager.get_adapter(lora_id) if manager is not None else None
    if lora is None:
        return dict.fromkeys(shapes)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    packed = getattr(manager, "packed_modules_mapping", None) or {}
    out = {}
    for name in shapes:
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        layer, index = lora.loras.get(module), None
        if layer is None:
            parent, _, leaf = module.rpartition(".")
            for fused, parts in packed.items():
                if leaf in parts and (layer := lora.loras.get(f"{parent}.{fused}")) is not None:
                    index = parts.index(leaf)
                    break
        t = None if layer is None else layer.lora_a if is_a else layer.lora_b
        t = t[index] if index is not None and t is not None else t
        out[name] = None if t is None else fingerprint(t, f"adapter {lora_id}, {module}")
    return out
