"""Supervised fine-tuning's pure pieces, below the trainer's command (``commands.sft``) and the policy builders that
warm-start the embedded policies (``models``): a conversation rendered token for token as its rollout would be
(``render``), rows padded into a batch (``collate``), the token-mean loss on the assistant tokens (``sft_loss``) and the
learning-rate schedule (``warmup_cosine``)."""

from __future__ import annotations

import math

import torch
from torch.nn.utils.rnn import pad_sequence


def render(template, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on the tokens the policy generates) of a conversation, built exactly as
    ``AgentClient.chat_turn`` builds its rollout; raises ``ValueError`` if the template rewrites earlier turns once
    later ones follow (RL would start a new segment there)."""
    ids, mask, seen = [], [], []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        context = messages[:i]
        piece = (template.prompt_ids(context, tools) if not seen
                 else template.delta_ids(seen, context[len(seen):], tools))
        if piece is None:
            raise ValueError(f"the chat template renders the turns before message {i} differently once it follows "
                             "(it rewrites history): split the conversation at that assistant message")
        gen = template.encode(reply_text(template, msg, tools)) + [template.eos_id]
        close = template.close_turn_ids(gen)
        ids += piece + gen + close
        mask += [0] * len(piece) + [1] * len(gen) + [0] * len(close)
        seen = messages[: i + 1]
    return ids, mask


def reply_text(template, msg: dict, tools: list | None = None) -> str:
    """What the policy generates for an assistant message: its rendering between the generation prompt and the
    end-of-turn token (content, then tool calls in the template's syntax)."""
    if not msg.get("tool_calls"):
        return msg["content"]
    text = template.render([{"role": "user", "content": "u"}, msg], tools=tools)
    start = template.render([{"role": "user", "content": "u"}], add_generation_prompt=True, tools=tools)
    return text[len(start):].split(template.turn_suffix, 1)[0]


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ``(input_ids, labels, attention_mask)``, each (B, T); labels are -100 off the loss mask."""
    def padded(seqs: list[list[int]], fill: int) -> torch.Tensor:  # (B, T)
        return pad_sequence([torch.tensor(s, dtype=torch.long) for s in seqs], batch_first=True, padding_value=fill)

    return (padded([ids for ids, _ in rows], pad_id),
            padded([[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in rows], -100),
            padded([[1] * len(ids) for ids, _ in rows], 0))


def sft_loss(logprobs: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Negative log-likelihood of the labelled tokens divided by ``tokens`` (default: their count): the token mean.
    ``logprobs`` (B, T-1) are next-token logprobs (position t predicts token t+1), ``labels`` (B, T) as ``collate``
    makes them; equal to transformers' ``model(input_ids, labels=labels).loss``."""
    mask = labels[:, 1:] != -100  # (B, T-1)
    count = mask.sum() if tokens is None else tokens
    return -(logprobs * mask).sum() / count.clamp(min=1)


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The learning-rate factor at ``step`` of ``total``: linear warm-up over ``warmup`` steps, cosine decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


# ----- data -----
