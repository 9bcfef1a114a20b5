"""A pure PyTorch/transformers rollout engine: KV-cached batched sampling with exact logprobs.

For tests, machines without vLLM, and as the reference the vLLM engine is checked against. Requests that arrive
while a batch runs wait for the next batch (static batching with left padding; vLLM's continuous batching is what
makes it faster). Weight updates land between decode steps; the batch in flight then recomputes its KV cache under
the new weights (as ``VLLMEngine`` does by preempting), so every token tagged version v was sampled from policy v
given its whole context.

A LoRA policy (``self.adapter``, set at launch): the model is wrapped with peft from the adapter's config at start
(B = 0: the base model's outputs) and each commit copies the adapter's tensors into the adapter's parameters, found
once by their peft names (``get_peft_model_state_dict``). The adapter stays unmerged, so the engine computes exactly
what the trainer's ``PeftModel`` computes, and the same in-flight semantics hold (the batch in flight recomputes its
KV under the new adapter: unlike vLLM, where a request keeps its adapter; both tag every token exactly).
For a mixture-of-experts policy the engine also records, through hooks on the routers (``moe.RoutingCapture``), the
experts every forwarded position went to: the prefill's rows for the prompt, one row per decode step, kept from the
first time a position is forwarded (a recompute after a weight update does not overwrite them); left padding is cut
off. That record is what routing replay (``moe``) trains through.

For a vision-language policy (LLaVA: ``load_lm`` picks the image-text-to-text class) a request may carry the
pixel values of its prompt's images (``accepts_images``): the batch's images, in row order, go with every
full-context forward (the prefill, and the recompute after a weight update), where the model puts the vision
tower's features at the image tokens; decode steps read the KV cache only. On the CPU this is the engine that serves
a VLM: vLLM's vision path needs torchvision, built for CUDA only (on GPUs: CUDA torch + torchvision + vLLM; see
``molt_lightning.policies.vision``).

Scoring (``score``, a teacher on this engine): the sequences that arrive together, right-padded, in one forward
between decode steps (under the same weights lock, so a mixture-of-experts policy's routing record is never mixed
with it): the trainer's teacher logprobs at any temperature, within float32 rounding (tests/test_scoring.py).

The decode loop is written by hand because ``generate`` offers no point between steps to swap weights and tag
versions; the model forward, KV cache and position handling are transformers'.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import torch
from torch.nn.utils.rnn import pad_sequence

from ..policies import moe
from ..policies.vision import ImageInputs
from .base import Generation, RolloutEngine, Sampling, nucleus
from .batched import Batched
from .fingerprint import Print, fingerprint


class TorchEngine(RolloutEngine):
    captures_routing = True  # for mixture-of-experts policies (dense ones return routing=None)
    accepts_images = True  # for vision-language policies

    def __init__(self, device: str = "cpu", dtype: str = "float32", max_batch: int = 256, seed: int | None = None):
        super().__init__()
        self.device, self.dtype, self.max_batch, self.seed = device, getattr(torch, dtype), max_batch, seed
        self.model = None
        self._weights = threading.Lock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._pending: asyncio.Queue | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._scheduler: asyncio.Task | None = None
        # (token ids, start, temperature) of the requests that arrive together: one scoring forward between decode steps
        self._scoring = Batched(lambda requests: asyncio.to_thread(self._score_now, requests))

    async def open(self, model_path: str) -> None:
        from ..policies import load_lm

        self.model = load_lm(model_path, self.dtype).to(self.device).eval()
        self._names = set(dict(self.model.named_parameters()))  # what a sync must carry
        if self.adapter is not None:
            from peft import get_peft_model, get_peft_model_state_dict

            self.model = get_peft_model(self.model, self.adapter.peft_config()).eval()
            # peft's names -> the adapter's parameters themselves (state-dict tensors share their storage): a commit
            # copies into them (set_peft_model_state_dict walks the whole model: 50 ms a push for SmolLM2-135M)
            self._adapter_params = get_peft_model_state_dict(self.model, save_embedding_layers=False)
            owned = {p.data_ptr() for p in self.model.parameters()}
            assert all(t.data_ptr() in owned for t in self._adapter_params.values())
            self._names = set(self._adapter_params)
        text = self.model.config.get_text_config()  # the config itself for a text-only LM
        self.vocab_size = text.vocab_size
        self.eos_ids = _eos_ids(self.model.generation_config, text)
        self.pad_id = text.pad_token_id if text.pad_token_id is not None else 0
        self.seed_from(0)  # opened without launch (a script): run seed 0's
        self.gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self.capture = moe.RoutingCapture(self.model)  # MoE routers' choices (none for a dense policy)
        self._pending = asyncio.Queue()
        self._scheduler = asyncio.create_task(self._schedule())

    async def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
            self._scheduler = None

    async def pause(self) -> None:
        self._unpaused.clear()
        await asyncio.to_thread(self._weights.acquire)  # the decode step in progress finishes; no other starts
        self._weights.release()

    async def resume(self) -> None:
        self._unpaused.set()

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, images: ImageInputs | None = None
                        ) -> Generation:
        done = asyncio.get_running_loop().create_future()
        await self._pending.put((prompt_ids, sampling, images, done))
        return await done

    async def stage(self, bucket: Mapping[str, torch.Tensor]) -> None:
        # copies: commit_weights returns while the engine loads, and the trainer's next optimizer step may change the
        # tensors it staged in place before the load runs (tests/test_engines.py::test_torch_engine_stage_copies)
        self._staged.update({k: v.detach().clone() for k, v in bucket.items()})

    async def load(self) -> None:
        state, self._staged = self._staged, {}
        missing = self._names - set(state)
        unknown = set(state) - self._names if self.adapter is not None else set()  # full: extras are ignored
        if missing or unknown:
            what = "adapter tensors (peft names)" if self.adapter is not None else "parameters (HF names)"
            raise KeyError(f"a weight update must carry this engine's {what}: missing {sorted(missing)[:5]}, unknown "
                           f"{sorted(unknown)[:5]}. A LoRA policy's engine must be launched with its adapter")
        await asyncio.to_thread(self._swap, state)

    def _swap(self, state: Mapping[str, torch.Tensor]) -> None:
        with self._weights:
            if self.adapter is None:
                self.model.load_state_dict(state, strict=False)
            else:
                for name, t in state.items():
                    self._adapter_params[name].copy_(t)

    async def tag(self, version: int) -> None:
        self.version = version  # paused: the next decode step recomputes the context's KV under it

    async def fingerprints(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Print | None]:
        """Read from the parameters the model computes with (a LoRA policy: the adapter's own parameters)."""
        def read() -> dict[str, Print | None]:
            served = self._adapter_params if self.adapter is not None else dict(self.model.named_parameters())
            with self._weights:
                return {name: fingerprint(served[name], name) if name in served else None for name in shapes}

        return await asyncio.to_thread(read)

    async def _score(self, token_ids: list[int], start: int, temperature: float) -> list[float]:
        """Requests that arrive together (a group's trajectories) are scored in one batched forward."""
        return await self._scoring((token_ids, start, temperature))

    @torch.no_grad()
    def _score_now(self, requests: list[tuple[list[int], int, float]]) -> list[list[float]]:
        """Forwards of the sequences, right-padded, a few rows at a time (at most ~2**26 logits per forward), off the
        loop, between decode steps (the weights lock) and never while paused (a weight update in progress): the
        logprobs the trainer's teacher computes, without top-p. Text only (a VLM's image tokens need their pixels)."""
        width = max(len(ids) for ids, _, _ in requests)
        per = max(1, 2**26 // (width * self.model.config.get_text_config().vocab_size))
        out = []
        for at in range(0, len(requests), per):
            chunk = requests[at:at + per]
            ids = torch.tensor([seq + [0] * (width - len(seq)) for seq, _, _ in chunk], device=self.device)  # (B, T)
            mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq, _, _ in chunk], device=self.device)
            while True:
                self._unpaused.wait()
                with self._weights:
                    if self._unpaused.is_set():
                        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()  # (B, T, V)
                        break
            for row, (seq, start, temperature) in enumerate(chunk):
                logp = torch.log_softmax(logits[row, start - 1:len(seq) - 1] / temperature, dim=-1)  # (n, V)
                out.append(logp.gather(-1, ids[row, start:len(seq), None]).squeeze(-1).tolist())
        return out

    async def _schedule(self) -> None:
        while True:
            batch = [await self._pending.get()]
            await asyncio.sleep(0.002)  # let concurrent agents enqueue their requests
            while not self._pending.empty() and len(batch) < self.max_batch:
                batch.append(self._pending.get_nowait())
            try:
                outs = await asyncio.to_thread(self._run, [(p, s, im) for p, s, im, _ in batch])
                for (*_, fut), out in zip(batch, outs):
                    if not fut.done():
                        fut.set_result(out)
            except Exception as e:  # surface the error in every waiting request, keep serving
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)

    @torch.no_grad()
    def _run(self, requests: list[tuple[list[int], Sampling, ImageInputs | None]]) -> list[Generation]:
        B, L = len(requests), max(len(p) for p, *_ in requests)
        dev = self.device
        prompts = [torch.tensor(p, dtype=torch.long, device=dev) for p, *_ in requests]
        ids = pad_sequence(prompts, batch_first=True, padding_value=self.pad_id, padding_side="left")  # (B, L)
        mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left")  # (B, L)
        samplings = [s for _, s, _ in requests]
        temps = torch.tensor([s.temperature for s in samplings], device=dev)  # (B,)
        top_ps = [s.top_p for s in samplings]
        top_ps = torch.tensor(top_ps, device=dev)[:, None] if min(top_ps) < 1 else 1.0  # (B, 1), or none
        max_new = [s.max_tokens for s in samplings]
        stops = [set(() if s.ignore_eos else self.eos_ids) | set(s.stop_token_ids) for s in samplings]
        images = ImageInputs.cat([im for *_, im in requests])  # the rows' images in row order, or None
        # a VLM's full-context forwards take them (the model fills the image tokens row-major); decode steps do not
        vision = {} if images is None else {"pixel_values": images.pixel_values.to(dev, self.dtype)}
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        out_ids = [[] for _ in range(B)]
        out_lps = [[] for _ in range(B)]
        out_vers = [[] for _ in range(B)]
        reasons = ["length"] * B
        alive = [m > 0 for m in max_new]
        gens = [None if s.seed is None else torch.Generator(device=dev).manual_seed(s.seed) for s in samplings]
        cache, seen = None, None
        self.capture.start(B, L + max(max_new))
        while any(alive):
            self._unpaused.wait()
            with self._weights:
                if not self._unpaused.is_set():  # paused while this step waited for the lock: wait again
                    continue
                version = self.version
                extra = {}
                if version != seen:  # first step, or new weights: (re)compute the whole context's KV
                    cache, step_ids, step_pos, extra = None, ids, pos, vision
                out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                 past_key_values=cache, use_cache=True, **extra)
                # the forward ran the last S of ids' columns; under the lock: a score's forward would overwrite them
                self.capture.step(B, step_ids.shape[1], ids.shape[1])
            seen, cache = version, out.past_key_values
            logits = out.logits[:, -1].float()  # (B, V)
            tok, lp = _sample(logits, temps, self.gen, gens, top_ps)  # (B,), (B,)
            toks, lps = tok.tolist(), lp.tolist()
            for i in range(B):
                if not alive[i]:
                    continue
                t = toks[i]
                out_ids[i].append(t)
                out_lps[i].append(lps[i])
                out_vers[i].append(version)
                if t in stops[i]:
                    alive[i], reasons[i] = False, "stop"
                elif len(out_ids[i]) >= max_new[i]:
                    alive[i] = False
            step_ids, step_pos = tok[:, None], pos[:, -1:] + 1  # (B, 1), (B, 1)
            ids = torch.cat([ids, step_ids], dim=1)  # (B, L + t)
            pos = torch.cat([pos, step_pos], dim=1)  # (B, L + t)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)  # (B, L + t)
        # a request's routing: its prompt (left padding cut off) and its tokens but the last (never forwarded)
        return [Generation(out_ids[i], out_lps[i], out_vers[i], reasons[i],
                           self.capture.rows(i, L - len(requests[i][0]), L + len(out_ids[i]) - 1)) for i in range(B)]


def _sample(logits: torch.Tensor, temps: torch.Tensor, gen: torch.Generator,
            gens: list[torch.Generator | None] | None = None, top_p: float | torch.Tensor = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample per row at its temperature (0 = greedy) from its top-p nucleus (``base.nucleus``); return tokens and
    their logprobs under that distribution.
    A row with its own generator in ``gens`` (a seeded request) draws its uniform from it, the others from ``gen``;
    the token is the inverse CDF at that uniform (one batched search, not a ``multinomial`` call per seeded row)."""
    greedy = temps <= 0
    scaled = nucleus(logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None], top_p)  # (B, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    # in float64: a rare token's interval then has its own width, not float32's rounding step near 1 (~6e-8)
    cdf = logp.double().exp().cumsum(-1)  # (B, V)
    cdf = cdf / cdf[:, -1:]  # ends at exactly 1: a uniform in [0, 1) always lands on a token of nonzero probability
    u = torch.rand(logits.shape[0], generator=gen, device=logits.device, dtype=torch.float64)  # (B,)
    own = [i for i, g in enumerate(gens or []) if g is not None]
    if own:
        u[own] = torch.cat([torch.rand(1, generator=gens[i], device=logits.device, dtype=torch.float64)
                            for i in own])
    sampled = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)  # (B,): first index with cdf > u
    tok = torch.where(greedy, logits.argmax(-1), sampled)  # (B,)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _eos_ids(gen_config, config) -> list[int]:
    eos = gen_config.eos_token_id if gen_config.eos_token_id is not None else config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
