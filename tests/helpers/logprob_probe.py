"""The batch the export tests compare logprobs on, and the trainer's own logprobs of it (``Policy.outputs``, what
``training_step`` computes; under FSDP2 every rank takes part in the forward)."""

from __future__ import annotations

import torch

TEXTS = ["What is 12*34?", "CALC 734*56 ANSWER 41104"]


def batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])  # (2, T)
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])  # (2, T)
    return input_ids, mask


def trainer_logprobs(policy, tokenizer) -> torch.Tensor:
    input_ids, mask = batch(tokenizer)
    device = next(policy.parameters()).device
    with torch.no_grad():
        out = policy.outputs(input_ids.to(device), mask.to(device), mask.bool().to(device), 1.0)
    return (out.logprobs.cpu() * mask[:, 1:]).float()  # (2, T-1)
