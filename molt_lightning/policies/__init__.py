"""Policy types and the one loader every side uses: mixture-of-experts routing (``moe``) and expert parallelism
(``expert_parallel``), vision-language inputs (``vision``), LoRA adapters (``lora``).

``load_lm`` lives here, below the trainer and the engines, because both load a policy folder.
"""

from __future__ import annotations

import torch
from torch import nn


def load_lm(folder: str, dtype: torch.dtype) -> nn.Module:
    """The policy's LM from a Hugging Face folder: a causal LM, or for a config with a vision tower (LLaVA) the
    image-text-to-text model (transformers maps those to their own auto class, not ``AutoModelForCausalLM``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(AutoConfig.from_pretrained(folder), "vision_config", None) is not None
    return (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(folder, dtype=dtype)
