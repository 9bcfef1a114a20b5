"""``Policy``: a Hugging Face causal LM plus what RL reads from it, computed without the full (N, T, V) logits.

RL needs, for each *sampled* token, its logprob under the current policy at the sampling temperature, in the top-p
nucleus the engines sample from (``top_p``, ``engines.base.nucleus``; the entropy of that distribution, and a value
for critic estimators). The plain route, ``lm(ids).logits``, builds a float
(N, T, V) tensor and its gradient: a float per token and vocabulary entry, gigabytes for a small batch of a
49k-vocabulary model. Here the decoder's hidden
states are taken for the policy tokens only (prompt and tool tokens are never trained on, so their logits are never
computed), and the output head runs over them in chunks of ``chunk_tokens`` rows, each under activation
checkpointing, so at most one (chunk, V) block of logits exists at a time, in the forward pass and in the backward.

Rows that share a prompt (a GRPO group's samples) run it through the decoder once per micro-batch (``prefix``: packed
sequences under a 4D mask, hidden states gathered back), unless ``share_prefix`` is off or the policy cannot be packed.

The wrapper is also the unit FSDP2 shards at the root (``parallel.shard``): the decoder, the output head (tied to the
embeddings in most small models) and a value head all run inside one ``forward``, so the root's parameters are
gathered for it. ``forward`` returns a plain tuple (FSDP2 hooks the backward pass through the outputs' pytree).

Written by hand because no library computes masked, chunked, temperature-scaled token logprobs and entropies with a
checkpointed head (Liger's fused linear cross-entropy is CUDA/Triton; TRL and verl materialize the logits).

The decoder is resolved in one place (``decoder_of``): a peft ``PeftModel`` (``model.lora``) wraps the HF model, and its
``base_model`` is peft's ``LoraModel``, not the decoder.
A mixture-of-experts policy runs its forward inside ``moe.routed``, the one routing hook: with ``routing="replay"``
the batch's engine record (``Batch.routing``) decides the experts (R3, see ``moe``), with ``"free"`` the trainer's
router does; both report router metrics and, with ``router_aux_coef``, add transformers' load-balancing loss. For a
dense policy the hook does nothing (and ``"replay"`` is refused when the policy is built).

A vision-language policy (LLaVA) takes its batch's images (``Batch.images``, pixel values in row order) in the same
single forward: the base model puts the vision tower's features at the image tokens, so the recomputed logprobs are
conditioned on the pixels the engine saw. ``load_lm`` loads either kind (causal LM, or image-text-to-text for a
config with a vision tower); text settings are read from ``config.get_text_config()`` (the config itself for a
text-only LM).

Before any of it, ``policy_folder`` resolves ``model.policy`` (a folder, or a function that returns one) and
``check_vocab`` checks the tokenizer against the embeddings (and the engine's vocabulary): each error names the fix.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import imported
from ..engines.base import nucleus
from ..policies import load_lm, lora as lora_, moe
from . import prefix
from ..policies.vision import BatchImages

ROUTING_MODES = ("free", "replay")
LOGPROB_FLOOR = -1e4  # a token outside the top-p nucleus: probability 0, kept finite (see _logprobs_entropy)


@dataclass
class PolicyOutputs:
    logprobs: torch.Tensor  # (N, T-1) next-token logprobs, with gradient; 0 off the loss mask
    entropy: torch.Tensor  # (N, T-1) entropies, with gradient only when asked; 0 off the loss mask
    values: torch.Tensor | None  # (N, T-1) value head predictions, or None without a critic
    aux_loss: torch.Tensor  # () router load-balancing loss times router_aux_coef, with gradient; 0 when off or dense
    router_metrics: dict[str, torch.Tensor]  # moe.router_metrics; empty for a dense policy


class Policy(nn.Module):
    def __init__(self, lm: nn.Module, value_head: bool = False, chunk_tokens: int = 512, routing: str = "free",
                 router_aux_coef: float = 0.0, share_prefix: bool = True, top_p: float = 1.0):
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"logit_chunk_tokens must be >= 1, got {chunk_tokens}")
        if routing not in ROUTING_MODES:
            raise ValueError(f"model.moe.routing must be one of {ROUTING_MODES}, got {routing!r}")
        if routing == "replay" and not moe.routers(lm):
            raise ValueError(f"model.moe.routing=replay replays the experts a mixture-of-experts policy's engine "
                             f"chose, but {type(lm).__name__} is dense (no router modules): use model.moe.routing: "
                             f"free, or an MoE policy (e.g. molt_lightning.models.tiny.moe_policy)")
        if moe.routers(lm) and getattr(lm, "is_gradient_checkpointing", False):
            raise NotImplementedError("a mixture-of-experts policy with activation_checkpointing: the backward pass's "
                                      "recompute would run the routers outside the routing hook (moe.routed wraps the "
                                      "forward only: replayed experts and router records would differ); set "
                                      "model.activation_checkpointing: false")
        self.replay, self.router_aux_coef, self.top_p = routing == "replay", router_aux_coef, top_p
        text = lm.config.get_text_config()
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(text, attr, None):
                raise NotImplementedError(f"the policy's config sets {attr}: the chunked head does not apply it yet")
        self.lm, self.chunk_tokens = lm, chunk_tokens
        self.pack_kernel = lm.config._attn_implementation if share_prefix and prefix.supported(lm) is None else None
        self.value_head = None
        if value_head:  # a linear head on the last hidden state: it shares the trunk, starts at 0
            self.value_head = nn.Linear(text.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                temperature: float, entropy_grad: bool = False, routing: torch.Tensor | None = None,
                images: BatchImages | None = None):
        """Returns ``(logprobs, entropy, values, aux_loss, router_metrics)`` for the tokens marked by ``loss_mask``
        (N, T), each per-token output (N, T-1); ``routing`` (N, T, layers, k) is the engine's expert record,
        ``images`` a VLM's pixel values for the rows' image tokens."""
        inputs = {} if images is None else {"pixel_values": images.pixel_values}  # LLaVA's forward: (M, 3, H, W)
        packed = prefix.pack(input_ids, attention_mask, loss_mask) if self.pack_kernel and not inputs else None
        decoder = decoder_of(self.lm)
        with moe.routed(self.lm, routing, self.replay) as rec:
            if packed is None:
                hidden = decoder(input_ids=input_ids, attention_mask=attention_mask.long(),
                                 **inputs).last_hidden_state  # (N, T, H)
            else:  # each shared prompt once (see prefix), gathered back to (N, T, H)
                mask = packed.mask(self.pack_kernel, self.lm.dtype)
                hidden = packed.unpack(decoder(input_ids=packed.input_ids, attention_mask=mask,
                                               position_ids=packed.position_ids).last_hidden_state)
        config = self.lm.config
        metrics = moe.router_metrics(rec, routing, attention_mask, getattr(config, "num_experts", 0))
        metrics["batch/decoder_tokens_frac"] = torch.tensor(1.0 if packed is None else
                                                            packed.tokens / packed.unpacked_tokens)
        aux = torch.zeros((), device=hidden.device)
        if self.router_aux_coef:
            aux = self.router_aux_coef * moe.aux_loss(rec, attention_mask, config.num_experts,
                                                      config.num_experts_per_tok)
            metrics["moe/aux_loss"] = aux.detach()
        hidden = hidden[:, :-1]  # (N, T-1, H): position t predicts token t+1
        sel = loss_mask[:, 1:]  # (N, T-1)
        where = sel.nonzero(as_tuple=True)
        h, targets = hidden[where], input_ids[:, 1:][where]  # (K, H), (K,)
        head, n = self.lm.get_output_embeddings(), self.chunk_tokens
        chunks = [checkpoint(_head_chunk, head, h[i:i + n], targets[i:i + n], temperature, entropy_grad, self.top_p,
                             use_reentrant=False) for i in range(0, targets.numel(), n)]  # (logprobs, entropy) each
        logprobs = _scatter(sel, [lp for lp, _ in chunks], hidden)  # (N, T-1)
        entropy = _scatter(sel, [ent for _, ent in chunks], hidden)  # (N, T-1)
        values = None if self.value_head is None else self.value_head(hidden.float()).squeeze(-1)  # (N, T-1)
        return logprobs, entropy, values, aux, metrics

    def outputs(self, *args, **kwargs) -> PolicyOutputs:
        return PolicyOutputs(*self(*args, **kwargs))


def decoder_of(lm: nn.Module) -> nn.Module:
    """The LM's decoder (the module that returns ``last_hidden_state``). ``lm.base_model`` is it for a plain HF model;
    for a peft ``PeftModel`` it is the ``LoraModel`` wrapper, so go through ``get_base_model()`` (the HF model, its
    linear layers carrying the adapter) first."""
    get_base = getattr(lm, "get_base_model", None)
    return (get_base() if get_base is not None else lm).base_model


def target_logprobs(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                    chunk_tokens: int = 512) -> torch.Tensor:
    """Logprobs (N, T) of given ``targets`` (N, T): position t scores ``targets[:, t]`` after ``input_ids[:, :t+1]``
    (a Tinker datum's alignment, where the targets need not be the next inputs), with gradient, through the same
    chunked, checkpointed head as ``Policy``; 0 where ``attention_mask`` is 0 (right padding)."""
    hidden = decoder_of(lm)(input_ids=input_ids, attention_mask=attention_mask.long()).last_hidden_state  # (N, T, H)
    sel = attention_mask.bool()
    h, t = hidden[sel], targets[sel]  # (K, H), (K,)
    head, n = lm.get_output_embeddings(), chunk_tokens
    parts = [checkpoint(_head_chunk, head, h[i:i + n], t[i:i + n], 1.0, False, use_reentrant=False)[0]
             for i in range(0, t.numel(), n)]
    return _scatter(sel, parts, hidden)


def _head_chunk(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool,
                top_p: float = 1.0):
    z = nucleus(head(h).float() / temperature, top_p)  # (C, V): the only logits alive at a time
    return _logprobs_entropy(z, targets, entropy_grad)


def _logprobs_entropy(z: torch.Tensor, targets: torch.Tensor, entropy_grad: bool):
    """The targets' logprobs (...,) under logits ``z`` (..., V) and the distribution's entropy (-inf logits: tokens
    outside the nucleus, which add nothing to it). A target outside the nucleus (sampled by an older policy whose
    nucleus held it) gets ``LOGPROB_FLOOR``, not -inf: its importance weight is then 0 and no ratio is NaN."""
    log_z = torch.logsumexp(z, dim=-1)  # (...,)
    logprobs = (z.gather(-1, targets[..., None]).squeeze(-1) - log_z).clamp(min=LOGPROB_FLOOR)  # (...,)
    zd, log_zd = (z, log_z) if entropy_grad else (z.detach(), log_z.detach())
    entropy = log_zd - (torch.softmax(zd, dim=-1) * zd.clamp(min=torch.finfo(zd.dtype).min)).sum(-1)  # (...,)
    return logprobs, entropy


def _scatter(sel: torch.Tensor, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Place the per-token values (K,) at the positions of ``sel`` (N, T-1); 0 elsewhere."""
    out = torch.zeros(sel.shape, dtype=torch.float32, device=like.device)  # (N, T-1)
    if not parts:
        return out + 0 * like.sum()  # keep the graph (and FSDP's hooks) when a micro-batch has no policy token
    return out.masked_scatter(sel, torch.cat(parts))


def logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, entropy_grad: bool,
                         top_p: float = 1.0):
    """The unchunked reference: next-token logprobs and entropies from full logits (N, T, V), both (N, T-1)."""
    return _logprobs_entropy(nucleus(logits[:, :-1].float() / temperature, top_p), input_ids[:, 1:], entropy_grad)


def check_vocab(config, tokenizer, engine=None) -> None:
    """The tokenizer's ids must fit the policy's embeddings, and the engine must sample from the same vocabulary."""
    config = getattr(config, "get_text_config", lambda: config)()  # a VLM's language model holds the vocabulary
    if len(tokenizer) > config.vocab_size:
        where = f" in {config._name_or_path}" if getattr(config, "_name_or_path", "") else ""
        raise ValueError(f"the tokenizer{where} has {len(tokenizer)} tokens but the policy's embeddings hold "
                         f"{config.vocab_size} (config.vocab_size): they belong to different models, or tokens were "
                         f"added without resizing. Save the model's own tokenizer beside it, or resize the embeddings "
                         f"(model.resize_token_embeddings(len(tokenizer))) and save both again")
    engine_vocab = getattr(engine, "vocab_size", None)
    if engine_vocab is not None and engine_vocab != config.vocab_size:
        raise ValueError(f"the engine serves a vocabulary of {engine_vocab} tokens, the policy has "
                         f"{config.vocab_size}: start the engine from the policy's own folder")


def policy_folder(policy: str) -> str:
    """The model folder of ``policy`` (a folder, or what the function at that dotted path returns: a builder such as
    ``models.tiny.arithmetic_policy`` makes or finds its cached folder), checked to hold a model whose tokenizer fits
    its embeddings; raises ``ValueError`` naming the problem and the fix. ``molt fit`` calls it before anything
    starts (``cli.check_recipe``)."""
    from transformers import AutoConfig, AutoTokenizer

    what = ("give model.policy a local Hugging Face model folder (config.json, weights, tokenizer) or the dotted path "
            "of a function returning one (e.g. molt_lightning.models.tiny.arithmetic_policy)")
    folder = policy
    if not os.path.isdir(policy):
        if "/" in policy or policy.startswith(("~", ".")) or "." not in policy:
            raise ValueError(f"model.policy {policy!r}: no such folder (a hub id is not fetched: download it to a "
                             f"folder first): {what}")
        fn = imported(policy, "model.policy", what)
        if not callable(fn):
            raise ValueError(f"model.policy {policy!r} is a {type(fn).__name__}, not a function: {what}")
        folder = fn()
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            raise ValueError(f"model.policy {policy!r} returned {folder!r}, not a model folder: {what}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"model.policy folder {folder} has no config.json, so it is no Hugging Face model folder: "
                         "save one there with model.save_pretrained(folder) and tokenizer.save_pretrained(folder)")
    check_vocab(AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    return str(folder)


def teacher_folder(teacher: str, tokenizer) -> str:
    """The teacher's model folder; it must share the policy's tokenizer (the advantage compares logprobs of one
    token), else ``ValueError`` naming the fix."""
    from transformers import AutoTokenizer

    folder = policy_folder(teacher)
    if AutoTokenizer.from_pretrained(folder).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"model.teacher {teacher!r} has another tokenizer than the policy: distillation compares "
                         "the two models' logprobs of the same tokens, so use a teacher of the policy's family")
    return folder


def trainable_lm(folder: str, dtype: torch.dtype, checkpointing: bool = False, lora=None):
    """The LM to train from the policy ``folder``, and its tokenizer: loaded, checked against the tokenizer, with
    activation checkpointing (``checkpointing``) and a LoRA adapter (``lora``: only the adapter requires grad) if asked,
    in train mode. ``AsyncRLModule`` and ``molt sft`` build their policy with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    lm = load_lm(folder, dtype)
    check_vocab(lm.config, tokenizer)
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        lm = lora_.apply(lm, lora)
    return lm.train(), tokenizer


def rng_state() -> dict:
    """The process's random states (torch, Python, NumPy) as plain types, for ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}


def set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    name, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def frozen_policy(folder: str, dtype: torch.dtype, batching) -> Policy:
    """A frozen model beside the trained one (the KL reference, a distillation teacher), chunked like it."""
    lm = load_lm(folder, dtype).eval().requires_grad_(False)
    return Policy(lm, chunk_tokens=batching.logit_chunk_tokens, share_prefix=batching.share_prefix)
