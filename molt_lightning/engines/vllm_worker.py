"""vLLM worker extension: the one place that touches vLLM's worker internals.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls its methods through
``collective_rpc``. Weights travel as a safetensors file path (tensors sent through ``collective_rpc`` to a
multi-process engine arrive as lists), and load through the worker's own ``reload_weights``: the plain
``model.load_weights`` fails on the CPU backend, which repacks linear weights (see ENVIRONMENT.md).
"""

from __future__ import annotations


class MoltWorkerExtension:
    """Methods run inside each vLLM worker process."""

    def molt_load_weights(self, path: str) -> int:
        """Load HF-named tensors from a safetensors file into the running model; returns how many were loaded."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def molt_weight_checksum(self, name: str) -> float:
        """Sum of one parameter (as vLLM holds it): lets tests see that an update really landed."""
        for pname, param in self.model_runner.get_model().named_parameters():
            if pname == name:
                return float(param.detach().float().sum())
        raise KeyError(f"no parameter named {name!r} in the vLLM model")
