"""The LoRA adapters a ``VLLMEngine`` serves: one vLLM ``LoRARequest`` per policy version, retired when unused.

A commit writes the staged adapter tensors as a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``)
under the engine's weight dir (``/dev/shm``), loads it with ``AsyncLLM.add_lora`` under a new integer id and the name
``molt-v{version}-{id}`` (vLLM tells adapters apart by name, so a version pushed twice gets a distinct one), and from
then on new requests carry that ``LoRARequest``. vLLM applies one adapter per request for its whole life, so a
request's tokens are all tagged with the version of the adapter it started with: exact, without pausing the engine
or resetting caches (vLLM's prefix-cache keys include the adapter's name and path).

Retirement is by use, not only by vLLM's LRU: each adapter counts the requests using it; when it is no longer the
newest and its count reaches zero it is removed (``remove_lora``) and its folder deleted. vLLM's own ``max_loras``
(adapters per batch, default 2 here) and ``max_cpu_loras`` bound what it holds at once; a request whose adapter was
evicted from its cache while the request waited is reloaded from its folder, which still exists because it is in use.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...policies.lora import Adapter

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (0.32)


@dataclass
class Served:
    request: object  # vllm.lora.request.LoRARequest
    version: int
    folder: str
    users: int = 0  # requests in flight with this adapter


class AdapterSlots:
    def __init__(self, llm, adapter: Adapter, weight_dir: str | None):
        self.llm, self.adapter, self.weight_dir = llm, adapter, weight_dir
        self.current: Served | None = None
        self.retired = 0  # adapters removed so far (for tests)
        self._ids = itertools.count(1)  # vLLM's adapter ids must be > 0

    async def commit(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``tensors`` as the adapter of ``version``; new requests use it from now on."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)
        folder = tempfile.mkdtemp(prefix=f"molt-lora-v{version}-", dir=self.weight_dir)
        await asyncio.to_thread(write_adapter, folder, self.adapter, dict(tensors))
        request = LoRARequest(f"molt-v{version}-{lora_id}", lora_id, folder)
        try:
            if not await self.llm.add_lora(request):
                raise RuntimeError(f"vLLM refused LoRA adapter {request.lora_name} ({folder})")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        old, self.current = self.current, Served(request, version, folder)
        if old is not None and old.users == 0:
            await self._retire(old)

    def acquire(self) -> Served:
        if self.current is None:
            raise RuntimeError("this vLLM engine serves a LoRA policy but holds no adapter yet: commit one "
                               "(stage_weights + commit_weights, as WeightSync does at train start) before generating")
        self.current.users += 1
        return self.current

    async def release(self, served: Served) -> None:
        served.users -= 1
        if served.users == 0 and served is not self.current:
            await self._retire(served)

    async def _retire(self, served: Served) -> None:
        await self.llm.remove_lora(served.request.lora_int_id)
        shutil.rmtree(served.folder, ignore_errors=True)
        self.retired += 1

    def with_scale(self, prints: dict) -> dict:
        """The worker's fingerprints of this adapter, each ``lora_B`` marked with the scale vLLM folded into it when
        it loaded the adapter (peft's alpha / r, or alpha / sqrt(r) with rsLoRA; the check multiplies what was sent
        by it as vLLM did). Per-module patterns (``rank_pattern``, ``alpha_pattern``): B is not checked."""
        import math
        from dataclasses import replace

        c = self.adapter.config
        patterned = bool(c.get("rank_pattern") or c.get("alpha_pattern"))
        scale = c["lora_alpha"] / (math.sqrt(c["r"]) if c.get("use_rslora") else c["r"])
        out = {}
        for name, p in prints.items():
            if p is not None and ".lora_B." in name:
                p = replace(p, checksum=None, via="per-module LoRA patterns: B is not read back") if patterned \
                    else replace(p, scale=scale)
            out[name] = p
        return out

    def close(self) -> None:
        if self.current is not None and os.path.isdir(self.current.folder):
            shutil.rmtree(self.current.folder, ignore_errors=True)


def write_adapter(folder: str, adapter: Adapter, tensors: dict[str, torch.Tensor]) -> str:
    """Save ``tensors`` as a peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(adapter.config, f)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              os.path.join(folder, "adapter_model.safetensors"))
    return folder


def vllm_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    return next(k for k in VLLM_RANKS if k >= r)
