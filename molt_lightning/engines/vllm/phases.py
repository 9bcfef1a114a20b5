"""The weight phases of a vLLM engine, written once over its transport: ``VLLMEngine`` (in process: ``AsyncLLM``) and
``RemoteVLLMEngine`` (a ``molt serve`` server over HTTP) each implement only the four calls that differ, ``_rpc``
(``MoltWorkerExtension.<method>(*args)`` on every worker: their answers), ``_pause``, ``_reset_cache`` (every KV block
dropped, the running requests' too) and ``_set_version``.

The sequence (``engines.base.update`` runs it, for one engine or every engine of a pool):
- ``stage``: a bucket is copied into a shared-memory slab (``shm``; the remote engine's ``http`` and ``nccl``
  channels make other payloads), nothing served changes;
- ``pause``: generation freezes, requests in flight keep their progress;
- ``load``: the worker loads every staged bucket (``molt_load_slabs``; the worker picks vLLM's own ``reload_weights``
  or, on the CPU platform, the direct load of ``cpu``);
- ``tag``: the prefix cache is reset with the running requests (their KV is recomputed under the new weights) and the
  version is set, so every token sampled from now on carries it;
- ``fingerprints`` (the check, before the resume): what the workers serve, read back (``readback``);
- ``resume``.

The CPU platform's one addition is asked once at open (``_open_weights``: the worker's ``molt_open``): where vLLM runs
on its CPU kernels, each staged bucket's kernels are packed ahead (``cpu.PackAhead``) and ``pause`` first waits for
them; anywhere else the engine sends no such call.

Scoring (``score``, a teacher on the engine): a request for the prompt's own logprobs and one token
(``_score_params``, ``_scores``); vLLM ignores the temperature there, so only 1.0 is taken.

Sampling, asked at open too (``_open_sampler``: the worker's ``molt_sampler``): the engine's seed (a pool's engines
each have their own: ``RolloutEngine.seed_from``) and whether a request may carry a seed of its own. Where it may (GPU
platforms), ``Sampling.seed`` goes with each request and a rerun samples the same tokens; on the CPU platform it may
not (``cpu.takes_request_seeds``), the engine says so once, and requests sample from its own stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Mapping

import torch

from ..base import RolloutEngine
from ..fingerprint import Print
from .shm import Staging

log = logging.getLogger(__name__)
Payload = tuple[str, object]  # (channel, data): ("shm", Slab), ("http", base64 safetensors), ("nccl", {name: tensor})


class VLLMPhases(RolloutEngine):
    def __init__(self, weight_dir: str, copies: int, down_timeout_s: float = 60.0):
        """``weight_dir``: where the slabs live (``/dev/shm``); ``copies``: slabs per bucket, used in turn."""
        super().__init__(down_timeout_s)
        self.weight_dir = weight_dir if os.path.isdir(weight_dir) else None
        self.staging = Staging(self.weight_dir, copies)
        self.direct = False  # the worker loads straight into vLLM's CPU kernels (answered at open)
        self.ahead = None  # cpu.PackAhead, where the direct load is on and packing ahead was asked for
        self.loaded: list = []  # the workers' answers to the last load of slabs (tensors, packed_ahead, via)
        self._staged: list[Payload] = []
        self.request_seeds = False  # a request may carry its own seed here (answered at open)
        self._said_unseeded = False
        self._ids = itertools.count()  # request ids: molt-<n>, molt-score-<n>

    # ----- the transport: each engine writes _rpc, _pause, _reset_cache and _set_version (see the module) -----
    def _payload(self, bucket: Mapping[str, torch.Tensor]) -> Payload:
        return "shm", self.staging.write(bucket)

    # ----- the phases -----
    async def _open_weights(self, direct: bool, load_ahead: bool, timeout: float | None = None) -> None:
        """Ask the workers once whether the CPU platform's direct load applies (``direct``: wanted; False is the path
        every other platform takes, which the tests run on the CPU too)."""
        self.direct = all((await self._rpc("molt_open", direct, timeout=timeout)))
        self.ahead = None
        if self.direct and load_ahead:
            from .cpu import PackAhead

            self.ahead = PackAhead()

    async def _open_sampler(self, timeout: float | None = None) -> None:
        """Ask the workers for the engine's seed (it becomes ``seed``: a running server's is its own) and whether a
        request may carry a seed of its own."""
        answer = (await self._rpc("molt_sampler", timeout=timeout))[0]  # a seed of None: vLLM's random one
        self.seed, self.request_seeds = answer["seed"], bool(answer["request_seeds"])

    def _request_seed(self, sampling) -> int | None:
        """``sampling.seed`` where the platform takes it; else None, said once."""
        if sampling.seed is not None and not self.request_seeds and not self._said_unseeded:
            self._said_unseeded = True
            log.info("%s: vLLM's CPU platform takes no per-request seeds (a seeded request kills its engine once a "
                     "prefill is split), so requests sample from this engine's own stream (seed %s): a pool's "
                     "engines still differ, but a rerun does not repeat each token (TorchEngine does)", self.where,
                     self.seed)
        return sampling.seed if self.request_seeds else None

    def _sample_params(self, sampling) -> dict:
        """The sampling parameters of a generate request, the same in process and over HTTP: token ids in and out
        (no detokenizing), the sampled token's logprob only, the request's seed where the platform takes it."""
        return {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "logprobs": 0, "stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": sampling.ignore_eos,
                "detokenize": False, "skip_special_tokens": False, "seed": self._request_seed(sampling)}

    # ----- scoring: vLLM's prompt logprobs, read the same way in process and over HTTP -----
    def _score_params(self, temperature: float) -> dict:
        """The sampling parameters of a scoring request: the prompt's own logprobs (``prompt_logprobs=0``: each
        position's actual token, no top-k), one greedy token that nobody reads. vLLM computes prompt logprobs from
        the raw logits (its model runner: "prompt tokens skip sampling processors"), so the request's temperature is
        not applied to them: scored with ``temperature=0.7`` they equal the temperature-1 logprobs
        (tests/test_scoring.py). Rescaling would need every token's logprob at every position (``prompt_logprobs=-1``:
        refused above ``max_logprobs``, 20 by default, and a Python object per vocabulary entry and position), so any
        temperature but 1 is refused with the fix."""
        self.check_score(temperature)
        return {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}

    def check_score(self, temperature: float) -> None:
        if temperature != 1.0:
            raise ValueError(f"the engine {self.where} (vLLM) scores at temperature 1.0 only: vLLM's prompt logprobs "
                             f"ignore the temperature, so {temperature} would silently score at 1.0. Serve the teacher "
                             "with TorchEngine, or train at temperature 1.0")

    def _scores(self, rows: list | None, token_ids: list[int], start: int) -> list[float]:
        """The logprobs of ``token_ids[start:]`` from vLLM's ``prompt_logprobs`` (one entry per prompt position, None
        at 0; in process a dict token id -> ``Logprob``, over HTTP its JSON: string keys, dicts)."""
        if rows is None or len(rows) != len(token_ids):
            raise RuntimeError(f"the engine {self.where} returned prompt logprobs for "
                               f"{'no' if rows is None else len(rows)} of the {len(token_ids)} positions scored")
        out = []
        for i in range(start, len(token_ids)):
            row, t = rows[i], token_ids[i]
            entry = row[t] if t in row else row[str(t)]
            out.append(float(entry.logprob if hasattr(entry, "logprob") else entry["logprob"]))
        return out

    async def stage(self, bucket: Mapping[str, torch.Tensor]) -> None:
        if self.ahead is not None:
            await self.ahead.begin(tuple(bucket), [data for kind, data in self._staged if kind == "shm"])
        kind, data = await asyncio.to_thread(self._payload, bucket)
        self._staged.append((kind, data))
        if self.ahead is not None and kind == "shm" and self.ahead.wants(bucket) and self.healthy:
            self.ahead.send(self._rpc("molt_prepare_slab", data.to_wire(), self.ahead.token))

    async def pause(self) -> None:
        if self.ahead is not None:
            await self.ahead.settle()  # the kernels packed ahead, while the engine still serves
        await self._pause()

    async def load(self) -> None:
        payloads, self._staged = self._staged, []
        await self._deliver(payloads, self.ahead.token if self.ahead is not None else None)

    async def _deliver(self, payloads: list[Payload], token: str | None) -> None:
        """Put the staged buckets into the (paused) workers (shm: with the kernels packed ahead under ``token``)."""
        if self.ahead is not None:
            await self.ahead.settle()
        if slabs := [data.to_wire() for kind, data in payloads if kind == "shm"]:
            self.loaded = await self._rpc("molt_load_slabs", slabs, self.staging.paths, token)
            if self.ahead is not None:
                self.ahead.loaded(self.loaded)

    async def tag(self, version: int) -> None:
        await self._reset_cache()
        await self._set_version(version)

    async def fingerprints(self, shapes: Mapping[str, tuple[int, ...]], lora_id: int | None = None
                           ) -> dict[str, Print | None]:
        """Read in the worker, from the weights it computes with (``readback``); with ``lora_id``, that adapter."""
        wire = (await self._rpc("molt_fingerprints", {k: list(v) for k, v in shapes.items()}, lora_id))[0]
        if not isinstance(wire, dict):  # a server whose worker extension predates fingerprints: unverified
            raise NotImplementedError(f"the engine {self.where} answered molt_fingerprints with {wire!r}")
        return {name: Print.from_wire(w) for name, w in wire.items()}

    async def weight_checksums(self) -> dict[str, float]:
        """Sum of every parameter inside the engine, by vLLM's parameter names (for tests)."""
        return (await self._rpc("molt_weight_checksums"))[0]

