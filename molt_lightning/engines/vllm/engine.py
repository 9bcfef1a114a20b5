"""vLLM in-process rollout engine (``AsyncLLM``): continuous batching, exact token ids, processed logprobs.

Prompts go in as token ids (never text). ``logprobs_mode="processed_logprobs"`` makes each returned logprob the
sampled token's logprob after temperature, i.e. under the distribution it was actually drawn from; the trainer applies
the same temperature when it recomputes. Per-token policy versions come from vLLM's own weight-version spans
(``update_weight_version``), so a request that spans an in-flight update is tagged exactly. A weight update (the
phases, written once for both vLLM engines in ``phases``) pauses the scheduler with ``mode="keep"`` (requests in
flight freeze), loads the weights through ``MoltWorkerExtension``, and tags the version after resetting the prefix
cache with ``reset_running_requests=True``: requests in flight are preempted and their KV is recomputed under the new
weights.
So every token tagged version v was sampled from policy v given its whole context; neither stale prefix-cache entries
nor an in-flight request's old KV leak the previous weights into it.

A LoRA policy (``self.adapter``, set at launch): the engine starts with ``enable_lora=True`` and serves the base model
plus the newest adapter, one ``LoRARequest`` per version (``lora.AdapterSlots``): the update's ``tag`` phase adds
the staged adapter under the new version (no pause, no cache reset, no base-weight reload), and every token of a
request is tagged with the version of the adapter that request carries.

Seeds: the engine's own (``seed``; None takes the run's, ``RolloutEngine.seed_from``), and each request's
(``Sampling.seed``) where the platform takes it: not on the CPU, where a seeded request kills the engine once a
prefill is split across scheduler steps (``phases``: said once; requests then sample from the engine's stream).

Images are not taken (``accepts_images`` is False: a request with images is refused, naming ``TorchEngine``).
vLLM's vision models (LLaVA, Qwen2-VL) import torchvision, and PyPI builds torchvision for CUDA only, so on this CPU
path a vision-language policy is served by the torch engine. On GPUs a user would install CUDA torch + torchvision +
vLLM; passing ``multi_modal_data`` with the token prompt here is the missing piece (LLaVA's tower keys also need
vLLM's names: ``vision_tower.*`` -> ``vision_tower.vision_model.*``, see the project's ENVIRONMENT notes).

Platform: ``dtype`` and ``enforce_eager`` default to what vLLM's platform needs (float32 and eager mode on the CPU,
``cpu.defaults``; vLLM's own choice elsewhere); ``cpu_threads``, ``kv_cache_gib`` and ``direct_load`` only mean
anything on the CPU platform (``cpu``). vLLM is imported only in ``open``: importing this module is cheap.

Client-side cost per request (measured by ``benchmarks/overhead_profile.py``): vLLM's statistics loggers are off
(``disable_log_stats``; the step metrics count tokens themselves), prompts go in as rendered token inputs (vLLM skips
its tokenizer pass and the thread-pool hop it makes for raw prompts), a request's output is built once when it finishes
(``FINAL_ONLY``, not a cumulative copy after every token), request ids are a counter, not ``uuid4``, and with
``cpu_threads`` the engine's processes start bound to those cores, so that its scheduler process, which busy-waits on
its workers between steps, keeps off the trainer's core.

vLLM starts its engine core in a new process with multiprocessing's *spawn*, which imports the main script again
(as ``__mp_main__``): a script that runs its training at the top level, outside ``if __name__ == "__main__":``,
would start it again inside that process, and vLLM only says "Engine core initialization failed". ``launch``
therefore checks the main script first (``main_guard``) and names the line and the fix; a failure that
still says so is re-raised with its common causes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ...policies.lora import Adapter
from ..base import Generation, Sampling
from ..batched import Batched
from ..fingerprint import Print
from . import cpu
from .lora import AdapterSlots, vllm_rank
from .main_guard import require_main_guard
from .phases import VLLMPhases
from .reaper import Reaper
from .refusals import check_policy


class VLLMEngine(VLLMPhases):
    def __init__(
        self,
        dtype: str | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        seed: int | None = None,
        kv_cache_gib: int = 1,
        cpu_threads: str | None = None,
        weight_dir: str = "/dev/shm",
        engine_kwargs: dict | None = None,
        capture_routing: bool = False,
        load_ahead: bool = True,
        direct_load: bool = True,
    ):
        """``dtype``/``enforce_eager``: None takes the platform's (``cpu.defaults``); ``cpu_threads`` binds the CPU
        engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"0-1"``); ``engine_kwargs`` go to
        ``AsyncEngineArgs`` as they are (e.g. ``gpu_memory_utilization``); ``capture_routing`` records a
        mixture-of-experts policy's routing (``Generation.routing``, for routing replay) through the worker extension:
        eager mode only, and prefix caching is turned off. On the CPU platform, ``direct_load`` loads each sync
        straight into vLLM's kernels (``cpu``; False: vLLM's own ``reload_weights``, the path of every other platform),
        and ``load_ahead`` packs each staged bucket's kernels while the trainer stages the next, the commit swapping
        them in (the engine holds a second set of kernels during a sync: False saves that memory)."""
        super().__init__(weight_dir, copies=1)
        if capture_routing and enforce_eager is False:
            raise ValueError("VLLMEngine(capture_routing=True) hooks the routers in eager mode: set enforce_eager=True")
        self.captures_routing = capture_routing
        self.dtype, self.max_model_len, self.enforce_eager, self.seed = dtype, max_model_len, enforce_eager, seed
        self.kv_cache_gib, self.cpu_threads = kv_cache_gib, cpu_threads
        self.engine_kwargs = engine_kwargs or {}
        self.load_ahead, self.direct_load = load_ahead, direct_load
        self.llm = None
        self.reaper = Reaper()  # vLLM's engine processes die with this one, even on SIGKILL
        self._staged_adapter: dict[str, torch.Tensor] = {}  # a LoRA policy's staged adapter tensors (peft names)
        self.adapters: AdapterSlots | None = None  # the LoRA adapters served, when self.adapter is set
        # (request id, positions) of finished requests whose routing is to be taken: requests finishing together share
        # one call to the worker (one call per request made the tiny MoE's step several times slower)
        self._routing = Batched(self._take_routing)

    check_policy = staticmethod(check_policy)  # what vLLM here will refuse in the policy, before launch (refusals)

    def launch(self, model_path: str, adapter: Adapter | None = None) -> None:
        if self._users == 0:  # on the caller's thread, before vLLM's engine process is spawned
            require_main_guard()
        super().launch(model_path, adapter)

    async def open(self, model_path: str) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.seed_from(0)  # opened without launch (a script): run seed 0's
        on_cpu = cpu.defaults()  # {} off the CPU platform
        if on_cpu:
            cpu.set_environment(os.environ, self.kv_cache_gib, self.cpu_threads)
        dtype = self.dtype or on_cpu.get("dtype", "auto")
        eager = self.enforce_eager if self.enforce_eager is not None else \
            on_cpu.get("enforce_eager", False) or self.captures_routing
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        lora = {} if self.adapter is None else \
            {"enable_lora": True, "max_lora_rank": vllm_rank(self.adapter.rank), "max_loras": 2}
        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, max_model_len=self.max_model_len, enforce_eager=eager,
            seed=self.seed, logprobs_mode="processed_logprobs", disable_log_stats=True,
            worker_extension_cls="molt_lightning.engines.vllm.worker.MoltWorkerExtension",
            **({"enable_prefix_caching": False} if self.captures_routing else {}), **{**lora, **self.engine_kwargs},
        )
        before = self.reaper.children()
        try:
            # the engine's processes inherit the binding; this one gets its own back
            with cpu.bound_to(self.cpu_threads if on_cpu else None):
                config = args.create_engine_config()
                self.llm = AsyncLLM.from_vllm_config(cpu.one_process(config) if on_cpu else config,
                                                     disable_log_stats=args.disable_log_stats)
            self.reaper.watch(self.reaper.children() - before)
        except RuntimeError as e:
            if "Engine core initialization failed" not in str(e):
                raise
            raise RuntimeError(_ENGINE_FAILED.format(error=e, kv=os.environ.get("VLLM_CPU_KVCACHE_SPACE"))) from e
        self.vocab_size = self.llm.model_config.get_vocab_size()
        await self._warm_up()
        await self.llm.update_weight_version(str(self.version))
        await self._open_weights(self.direct_load, self.load_ahead)
        await self._open_sampler()
        if self.adapter is not None:
            self.adapters = AdapterSlots(self.llm, self.adapter, self.weight_dir)
        if self.captures_routing and not (await self.llm.collective_rpc("molt_capture_routing"))[0]:
            raise ValueError(f"VLLMEngine(capture_routing=True): {model_path} has no mixture-of-experts layers")

    async def _warm_up(self) -> None:
        """A two-token request with logprobs (as the run's) before the engine serves: the first such request vLLM's
        CPU engine runs pays ~2 s of one-off set-up (the tiny policy: 2.2 s, then 0.025 s; a one-token request
        without logprobs does not set it up), which would otherwise land in the run's first step (vLLM's own
        start-up warm-up is off in eager mode). The prefix cache is reset after it."""
        await self._request([0], {"max_tokens": 2, "temperature": 1.0, "logprobs": 0, "detokenize": False},
                            "molt-warm-up")
        await self.llm.reset_prefix_cache()

    async def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
            self.adapters = None
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self.staging.close()
        self.reaper.close()

    async def _generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        request_id = f"molt-{next(self._ids)}"
        final, served = await self._request(prompt_ids, self._sample_params(sampling), request_id)
        out = final.outputs[0]
        ids = list(out.token_ids)
        logprobs = [float(pos[t].logprob) for pos, t in zip(out.logprobs, ids)]
        if served is not None:  # one adapter for the whole request: its version on every token
            versions = [served.version] * len(ids)
        else:  # full weights: vLLM's weight-version spans say where an in-flight update landed
            versions = [-1] * len(ids)
            for span in out.weight_versions or []:
                versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
        if -1 in versions:
            raise RuntimeError("vLLM returned tokens without a weight version: was update_weight_version called?")
        reason = {"stop": "stop", "length": "length"}.get(out.finish_reason, "abort")
        routing = None
        if self.captures_routing:  # the prompt's positions and the tokens' but the last (never forwarded)
            routing = await self._routing((request_id, len(prompt_ids) + len(ids) - 1))
        return Generation(ids, logprobs, versions, reason, routing)

    async def _score(self, token_ids: list[int], start: int, temperature: float) -> list[float]:
        """The prompt logprobs of one request (``phases``: temperature 1.0 only). A LoRA policy's engine scores with
        the adapter new requests get, as ``_generate``. A scoring request reads no prefix cache (vLLM skips it for
        prompt logprobs): the whole sequence is computed."""
        params = self._score_params(temperature)
        final, _ = await self._request(token_ids, params, f"molt-score-{next(self._ids)}")
        return self._scores(final.prompt_logprobs, token_ids, start)

    async def _request(self, token_ids: list[int], params: dict, request_id: str) -> tuple:
        """Run one request to its end: vLLM's final output (``FINAL_ONLY``: built once when it finishes, not a
        cumulative copy per token) and the adapter it was served with (a LoRA policy: the one new requests get, held
        for the request's whole life; else None)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params)
        prompt = {"type": "token", "prompt_token_ids": token_ids}  # rendered input: no tokenizer pass, no thread hop
        final, served = None, self.adapters.acquire() if self.adapters is not None else None
        try:
            async for final in self.llm.generate(prompt, params, request_id=request_id,
                                                 lora_request=served.request if served else None):
                pass
        finally:
            if served is not None:
                await self.adapters.release(served)
        return final, served

    async def _take_routing(self, wanted: list[tuple[str, int]]) -> list:
        """Each request's first ``n`` positions' routing, (n, layers, k), or the error saying it is incomplete."""
        from ...policies import moe

        tables = (await self.llm.collective_rpc("molt_take_routing", args=(
            [r for r, _ in wanted], [n for _, n in wanted])))[0]
        out = []
        for (request_id, n), rows in zip(wanted, tables):
            routing = torch.tensor(rows, dtype=moe.ROUTING_DTYPE)  # (n, layers, k)
            complete = len(rows) == n and not (routing[:, 0, 0] == moe.NO_RECORD).any()
            out.append(routing if complete else RuntimeError(f"vLLM's routing capture missed positions of request "
                                                             f"{request_id} (prefix caching on? see "
                                                             "engines/vllm/worker.py)"))
        return out

    # ----- the transport of the weight phases (``phases``), and a LoRA policy's adapters -----
    async def _rpc(self, method: str, *args, timeout: float | None = None) -> list:
        return await self.llm.collective_rpc(method, args=args)

    async def _pause(self) -> None:
        # the engine core's pause itself: AsyncLLM.pause_generation adds a 20 ms sleep after it "for a more
        # intuitive ordering of events" (not for correctness), 20 ms of every sync on the tiny policy's 27
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def _reset_cache(self) -> None:
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    async def _set_version(self, version: int) -> None:
        await self.llm.update_weight_version(str(version))

    async def stage(self, bucket: Mapping[str, torch.Tensor]) -> None:
        if self.adapters is not None:  # adapter tensors are small: written as one peft folder when tagged
            self._staged_adapter.update(bucket)
        else:
            await super().stage(bucket)

    async def pause(self) -> None:
        if self.adapters is None:  # a new adapter version needs no pause: each request keeps its own adapter
            await super().pause()

    async def resume(self) -> None:
        if self.adapters is None:
            await self.llm.resume_generation()

    async def load(self) -> None:
        if self.adapters is None:  # an adapter is loaded under its version, by tag
            await super().load()
            self.staging.forget()  # the worker has them mapped: no name left in /dev/shm, even after a SIGKILL

    async def tag(self, version: int) -> None:
        if self.adapters is None:
            await super().tag(version)
            return
        tensors, self._staged_adapter = self._staged_adapter, {}
        await self.adapters.commit(tensors, version)

    async def fingerprints(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Print | None]:
        """As ``phases``; a LoRA policy: the adapter new requests get (``adapters.current``), as vLLM holds it."""
        if self.adapters is None:
            return await super().fingerprints(shapes)
        if self.adapters.current is None:
            return dict.fromkeys(shapes)
        prints = await super().fingerprints(shapes, self.adapters.current.request.lora_int_id)
        return self.adapters.with_scale(prints)


# ----- errors (see the module docstring) -----

_ENGINE_FAILED = """vLLM's engine core process failed to start ({error}).
Its own traceback, printed above, names the cause. The common ones, and their fixes:
  - the main script runs the training at its top level, without `if __name__ == "__main__":` (vLLM's engine
    process re-imports the script; above: "bootstrapping phase"): put the run under that guard;
  - not enough free memory for the model plus the KV cache (on the CPU VLLM_CPU_KVCACHE_SPACE={kv} GiB: that
    variable, else VLLMEngine(kv_cache_gib=...); on a GPU engine_kwargs={{"gpu_memory_utilization": ...}}): lower it;
  - a model folder vLLM cannot load (architecture, dtype, a max_model_len above the model's): see the cause above;
  - cpu_threads names cores this machine does not have (VLLM_CPU_OMP_THREADS_BIND): pick cores that `nproc` counts."""
