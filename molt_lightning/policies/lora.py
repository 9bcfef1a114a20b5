"""LoRA through peft: the recipe's ``model.lora`` spec, the wrapped policy, and what a weight sync carries.

``model.lora: {r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear}`` (None: full fine-tuning). In
``configure_model`` the LM is wrapped with peft's ``get_peft_model`` (``apply``): only the adapter's A and B matrices
require grad, so the optimizer (``trainable_parameters``) sees only them, and the base weights never change. peft
initializes B = 0, so version 0 equals the base model; it is still served as an adapter, so the path is exercised
from the first token.

A weight sync sends the adapter's tensors only (``weights.buckets``, the one place that decides what a sync carries);
the engine was launched with the adapter's config (``adapter_of``: peft's ``adapter_config.json`` content, target
modules resolved), so each update is a complete peft adapter, tagged with the new policy version.

Deliberate limits: FSDP2 with LoRA is refused (``parallel.shard``; DDP and one process work). ``dropout > 0`` makes
the trainer's recomputed logprobs noisy while the engine samples without dropout, so the importance ratio is no
longer 1 at ``max_lag=0``: the default is 0. A KL reference (``kl_coef > 0``) is still a second full copy of the
base model (peft's ``disable_adapter`` would spare it; not done yet).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from ..extras import require


@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter an engine serves on top of its base model: peft's adapter config, as ``adapter_config.json``
    holds it (``LoraConfig.to_dict()`` with the target modules resolved to names). Its tensors come in the syncs."""

    config: dict

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def peft_config(self):
        from peft import LoraConfig

        fields = {k: v for k, v in self.config.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"}
        return LoraConfig(**fields)


MAX_RANK = 512  # vLLM's largest max_lora_rank (0.32)


@dataclass
class LoraSpec:
    """The recipe's ``model.lora``: peft ``LoraConfig``'s four knobs that matter here."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"  # peft's meaning: module name suffixes, a regex, or all-linear

    def __post_init__(self):
        if not 1 <= self.r <= MAX_RANK:
            raise ValueError(f"model.lora.r must be between 1 and {MAX_RANK}, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha must be > 0, got {self.alpha} (peft scales B A by alpha / r)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: name the linear layers to adapt (e.g. [q_proj, "
                             "v_proj]) or all-linear")


def apply(lm: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """``lm`` wrapped with a fresh LoRA adapter (peft ``PeftModel``); only the adapter's parameters require grad."""
    require("lora", "model.lora (or drop it for full fine-tuning)")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=spec.target_modules, bias="none", task_type="CAUSAL_LM")
    try:
        model = get_peft_model(lm, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"model.lora.target_modules={spec.target_modules!r} matches no layer of "
                         f"{type(lm).__name__} ({e}). Its linear layers are {linear}: name some of those "
                         "(e.g. [q_proj, v_proj]) or use all-linear") from None
    stray = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if stray:
        raise RuntimeError(f"peft left base parameters trainable: {stray[:3]}")
    return model


def is_lora(lm: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # no peft imported: no PeftModel exists (full fine-tuning never imports it)
    return peft is not None and isinstance(lm, peft.PeftModel)


def adapter_of(lm: torch.nn.Module) -> Adapter | None:
    """The adapter config an engine needs to serve ``lm`` (JSON-ready), or None for a full-weight policy."""
    if not is_lora(lm):
        return None
    config = lm.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    config["inference_mode"] = True  # as peft's save_pretrained writes it: the engine only serves it
    return Adapter(json.loads(json.dumps(config, default=str)))


# checkpoints store the recipe's LoraSpec in their hyperparameters: let torch.load(weights_only=True) (Lightning's
# default when resuming) read it back, as algorithms.config does for Algorithm
torch.serialization.add_safe_globals([LoraSpec])
