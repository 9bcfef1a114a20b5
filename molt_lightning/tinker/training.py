"""A training client's model: molt's policy with a peft LoRA adapter, the Tinker losses, AdamW, durable state.

``Model`` is what one ``create_model`` (or create-from-state ``load_weights``) makes: the model folder loaded by
``trainer.policy.trainable_lm`` with a ``LoraSpec`` of the client's rank and targets (``lora_config``: attention,
MLP and the unembedding, each on or off; alpha 32, the Tinker convention the cookbook's learning rates assume), so
only the adapter trains (``policies.lora.apply`` asserts it); full-weight training only where the server allows it.

Losses (Tinker's definitions, per token and **summed** over every token of every datum, no normalization):
- ``cross_entropy``: ``-(logp * weights)``;
- ``importance_sampling``: ``-(exp(logp - q) * A)``, q the sampler's logprobs (``logprobs``), A ``advantages``;
- ``ppo``: molt's clipped surrogate (``algorithms.losses.clipped_surrogate``) on ``r = exp(logp - q)`` with the
  client's ratio bounds ``clip_low_threshold``/``clip_high_threshold`` (default 0.8/1.2);
- ``cispo``: ``algorithms.losses.cispo`` with the same bounds.
Any other name (dro, gspo, stable_reinforce, a custom loss id) is a ``UserError``: never a silent substitute.
Gradients accumulate over ``forward_backward`` calls until ``optim_step``, which applies the client's Adam
parameters (``torch.optim.AdamW``: decoupled weight decay, as Tinker's AdamParams) and counts the policy version.

``snapshot`` copies the trainable tensors as they are now (a sampler's frozen weights); ``save`` writes the adapter
as peft writes it, the optimizer state and ``molt.json`` into a new folder and renames it into place (a crash never
leaves a half-written checkpoint under its name); ``Model.load`` builds the model back from one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..algorithms import losses
from ..policies import lora as lora_
from ..trainer.policy import target_logprobs, trainable_lm
from .wire import Datum, ForwardBackward, UserError

LORA_ALPHA = 32.0
LOSS_INPUTS = {"cross_entropy": ({"target_tokens"}, {"weights"}),  # (required, optional)
               "importance_sampling": ({"target_tokens", "logprobs", "advantages"}, set()),
               "ppo": ({"target_tokens", "logprobs", "advantages"}, set()),
               "cispo": ({"target_tokens", "logprobs", "advantages"}, set())}
TOKENS_PER_MICRO_BATCH = 4096


@dataclass
class Snapshot:
    """Frozen weights a sampler serves: the adapter's tensors (peft names) or every weight (HF names)."""

    state: dict[str, torch.Tensor]
    adapter: lora_.Adapter | None
    version: int

    @classmethod
    def read(cls, checkpoint: str) -> Snapshot:
        """A saved checkpoint's weights (read from disk: a sampler made from them survives restarts)."""
        meta = read_meta(checkpoint)
        if meta["rank"] is None:
            from ..policies import load_lm

            return cls(dict(load_lm(checkpoint, torch.float32).named_parameters()), None, meta["version"])
        from safetensors.torch import load_file

        with open(os.path.join(checkpoint, "adapter_config.json")) as f:
            config = json.load(f)
        return cls(load_file(os.path.join(checkpoint, "adapter_model.safetensors")), lora_.Adapter(config),
                   meta["version"])


def lora_targets(lm: nn.Module, attn: bool, mlp: bool, unembed: bool) -> list[str]:
    """The linear layers' names the client's ``lora_config`` asks for: those under an attention module, those under
    an MLP (experts included), the output head."""
    head = lm.get_output_embeddings()
    names = set()
    for name, module in lm.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        path = name.lower()
        is_attn = "attn" in path or "attention" in path
        is_mlp = "mlp" in path or "expert" in path or "feed_forward" in path
        if (unembed and module is head) or (module is not head and ((attn and is_attn) or (mlp and is_mlp))):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


class Model:
    def __init__(self, model_id: str, folder: str, rank: int | None, targets: dict[str, bool] | None = None,
                 seed: int | None = None, device: str = "cpu"):
        self.model_id, self.folder, self.rank = model_id, folder, rank
        self.targets = targets or {"attn": True, "mlp": True, "unembed": True}
        self.lm, self.tokenizer = trainable_lm(folder, torch.float32)  # loaded once; the adapter goes on it below
        if rank is not None:
            names = lora_targets(self.lm, self.targets["attn"], self.targets["mlp"], self.targets["unembed"])
            if not names:
                raise UserError(f"lora_config trains nothing: no linear layer matches {self.targets}")
            if seed is not None:  # the adapter's initialisation (peft draws A at random)
                torch.manual_seed(seed)
            self.lm = lora_.apply(self.lm, lora_.LoraSpec(r=rank, alpha=LORA_ALPHA, target_modules=names)).train()
        self.device = device
        self.lm.to(device)
        self.params = [p for p in self.lm.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.version = 0
        self.vocab = self.lm.get_output_embeddings().out_features

    # ----- training -----
    def forward_backward(self, fb: ForwardBackward) -> tuple[list[np.ndarray], dict[str, float]]:
        if fb.loss_fn not in LOSS_INPUTS:
            raise UserError(f"loss_fn {fb.loss_fn!r} is not served by molt tinker: use one of {sorted(LOSS_INPUTS)} "
                            "(dro, gspo, stable_reinforce and server-side custom losses are not implemented; a custom "
                            "loss can run client-side through forward_backward_custom)")
        unknown = set(fb.config) - {"clip_low_threshold", "clip_high_threshold"}
        if unknown or (fb.config and fb.loss_fn not in ("ppo", "cispo")):
            raise UserError(f"loss_fn_config {sorted(fb.config)} is not understood for {fb.loss_fn!r} (ppo and cispo "
                            "take clip_low_threshold and clip_high_threshold, the ratio bounds)")
        required, optional = LOSS_INPUTS[fb.loss_fn]
        for i, d in enumerate(fb.data):
            missing, extra = required - set(d.inputs), set(d.inputs) - required - optional
            if missing or extra:
                raise UserError(f"datum {i}: loss_fn {fb.loss_fn!r} takes loss_fn_inputs {sorted(required)} (optional "
                                f"{sorted(optional)}); missing {sorted(missing)}, not understood {sorted(extra)}")
            targets = d.inputs["target_tokens"]
            if targets.ndim != 1 or targets.min(initial=0) < 0 or targets.max(initial=0) >= self.vocab:
                raise UserError(f"datum {i}: target_tokens must be one token id per position in [0, {self.vocab}) "
                                f"(got shape {list(targets.shape)}, range {targets.min()}..{targets.max()})")
            if d.tokens.min() < 0 or d.tokens.max() >= self.vocab:
                raise UserError(f"datum {i}: model_input token ids must be in [0, {self.vocab})")
        self.lm.train(not fb.forward_only)
        out: list[np.ndarray] = [np.zeros(0)] * len(fb.data)
        total = 0.0
        for rows in _micro_batches(fb.data):
            with torch.set_grad_enabled(not fb.forward_only):
                lp, loss = self._loss([fb.data[i] for i in rows], fb.loss_fn, fb.config)
                if not fb.forward_only:
                    loss.backward()
            total += float(loss.detach())
            for j, i in enumerate(rows):
                out[i] = lp[j, :fb.data[i].tokens.size].detach().cpu().numpy()
        return out, {"loss:sum": total}

    def _loss(self, data: list[Datum], loss_fn: str, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(d.tokens.size for d in data)

        def padded(key: str | None, dtype) -> torch.Tensor:  # (B, T)
            rows = [d.tokens if key is None else d.inputs[key] for d in data]
            padded = [torch.as_tensor(np.pad(r, (0, width - r.size))).to(dtype) for r in rows]
            return torch.stack(padded).to(self.device)

        ids, targets = padded(None, torch.long), padded("target_tokens", torch.long)
        mask = torch.stack([torch.arange(width) < d.tokens.size for d in data]).to(self.device)  # (B, T)
        lp = target_logprobs(self.lm, ids, mask, targets)  # (B, T), 0 on padding
        if loss_fn == "cross_entropy":
            weights = padded("weights", torch.float32) if "weights" in data[0].inputs else mask.float()
            per_token = -lp * weights
        else:
            q, adv = padded("logprobs", torch.float32), padded("advantages", torch.float32)
            if loss_fn == "importance_sampling":
                ratio = torch.exp((lp - q).clamp(-losses.LOG_RATIO_LIMIT, losses.LOG_RATIO_LIMIT))
                per_token = -ratio * adv
            else:
                low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
                cfg = SimpleNamespace(clip_low=1 - low, clip_high=high - 1, dual_clip=0.0)  # 0: no dual clip
                inp = losses.LossInputs(logprobs=lp, old_logprobs=q, advantages=adv, mask=mask)
                per_token, _ = (losses.ppo_clip if loss_fn == "ppo" else losses.cispo)(inp, cfg)
        return lp, torch.where(mask, per_token, 0.0).sum()

    def optim_step(self, adam: dict) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group.update(lr=adam.get("learning_rate", 1e-4), betas=(adam.get("beta1", 0.9), adam.get("beta2", 0.95)),
                         eps=adam.get("eps", 1e-12), weight_decay=adam.get("weight_decay", 0.0))
        clip = adam.get("grad_clip_norm") or 0.0
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm:mean": float(norm), "policy_version:max": float(self.version)}

    # ----- weights -----
    def snapshot(self) -> Snapshot:
        if lora_.is_lora(self.lm):
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.lm, save_embedding_layers=False)  # the adapter only
        else:  # every parameter once (a tied head is the embedding), as an engine serves them
            state = dict(self.lm.named_parameters())
        return Snapshot({k: v.detach().to("cpu", copy=True) for k, v in state.items()}, lora_.adapter_of(self.lm),
                        self.version)

    def meta(self) -> dict:
        return {"base_model": self.folder, "rank": self.rank, "targets": self.targets, "version": self.version,
                "model_id": self.model_id}

    def save(self, folder: str, optimizer: bool, overwrite: bool = True) -> None:
        """The adapter (or every weight) in peft's/transformers' files, ``molt.json``, and with ``optimizer`` the
        optimizer's state: into ``folder.tmp``, then renamed to ``folder``."""
        if os.path.exists(folder) and not overwrite:
            raise UserError(f"a checkpoint named {os.path.basename(folder)!r} exists: choose another name or pass "
                            "overwrite")
        tmp = folder + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if lora_.is_lora(self.lm):  # the adapter only (peft would add a tied, frozen embedding: not trained here)
            self.lm.save_pretrained(tmp, save_embedding_layers=False)
        else:
            self.lm.save_pretrained(tmp)
        if optimizer:
            torch.save({"optimizer": self.optimizer.state_dict()}, os.path.join(tmp, "optimizer.pt"))
        with open(os.path.join(tmp, "molt.json"), "w") as f:
            json.dump({**self.meta(), "optimizer": optimizer}, f)
        old = folder + ".old"
        if os.path.exists(folder):
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)

    @classmethod
    def load(cls, model_id: str, folder: str, checkpoint: str, optimizer: bool, device: str = "cpu") -> Model:
        meta = read_meta(checkpoint)
        model = cls(model_id, folder, meta["rank"], meta["targets"], device=device)
        if lora_.is_lora(model.lm):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model.lm, load_file(os.path.join(checkpoint, "adapter_model.safetensors")))
        else:
            from ..policies import load_lm

            model.lm.load_state_dict(load_lm(checkpoint, torch.float32).state_dict())
        if optimizer:
            if not meta.get("optimizer"):
                raise UserError(f"{checkpoint} holds no optimizer state (a sampler's weights): load it without the "
                                "optimizer, or load a save_state checkpoint")
            state = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True, map_location=device)
            model.optimizer.load_state_dict(state["optimizer"])
        model.version = meta["version"]
        return model


def read_meta(checkpoint: str) -> dict:
    try:
        with open(os.path.join(checkpoint, "molt.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"no checkpoint at {checkpoint}") from None


def _micro_batches(data: list[Datum]) -> list[list[int]]:
    """Datum indices, longest first, in groups whose padded size stays within ``TOKENS_PER_MICRO_BATCH``."""
    order = sorted(range(len(data)), key=lambda i: -data[i].tokens.size)
    batches: list[list[int]] = []
    for i in order:
        if batches and data[batches[-1][0]].tokens.size * (len(batches[-1]) + 1) <= TOKENS_PER_MICRO_BATCH:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
