"""Shared-prefix packing: the samples of a group share their prompt, so the decoder runs the prompt once.

A GRPO batch holds ``group_size`` samples of every prompt, and on short answers the prompt is most of each row (the
SmolLM2 recipe: a ~40-token chat prompt, ~10 generated tokens). ``pack`` puts the rows of a micro-batch that agree
up to their first trained position into one sequence: that shared prefix once, then each row's own tokens after it,
each row attending only to the prefix and to itself (a 4D mask), at the position ids it would have alone. The
decoder runs on the packed sequences, and ``Packed.unpack`` gathers its hidden states back to the batch's (N, T, H)
layout, so the head and the loss see exactly what the unpacked forward gives them: equal logprobs up to float
rounding, and the same gradients (the gather adds the rows' gradients at the shared positions, as their sum would).

Rows are grouped by their tokens, not by group ids: a multi-turn row shares its first prompt only with rows that have
the same one, and a row that shares nothing is packed alone (its own prefix and no suffix). Mixture-of-experts
(routing records are per row), vision-language policies (image features are placed by token) and attention kernels
without custom 4D masks are not packed (``supported``).

Written by hand: transformers takes a custom 4D mask and position ids, but no maintained library builds shared-prefix
packs for training (TRL and verl recompute the prompt for every sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASKED_KERNELS = ("sdpa", "eager")  # attention implementations that take a custom 4D mask as given


def supported(lm) -> str | None:
    """Why ``lm`` cannot be packed, or None when it can."""
    config = lm.config
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language policy places image features by token position"
    if getattr(config.get_text_config(), "num_experts", 0):
        return "a mixture-of-experts policy's routing records are per row"
    if getattr(config, "_attn_implementation", None) not in MASKED_KERNELS:
        return f"attention implementation {config._attn_implementation!r} takes no custom 4D mask"
    return None


@dataclass
class Packed:
    input_ids: torch.Tensor  # (G, S) the packed sequences: a shared prefix, then each member row's own tokens
    position_ids: torch.Tensor  # (G, S) each token's position in its own row
    allowed: torch.Tensor  # (G, 1, S, S) bool: query may attend to key (causal, own row or prefix; pads: self)
    index: torch.Tensor  # (N, T) each batch position's place in the flattened (G * S) packed positions
    tokens: int  # valid packed tokens (what the decoder computes)
    unpacked_tokens: int  # valid tokens of the rows (what it would compute unpacked)

    def mask(self, kernel: str, dtype: torch.dtype) -> torch.Tensor:
        """The 4D mask as ``kernel`` takes it: bool for sdpa, additive (0 or the dtype's minimum) for eager."""
        if kernel == "sdpa":
            return self.allowed
        return torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device).masked_fill(
            ~self.allowed, torch.finfo(dtype).min)

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """(G, S, H) packed hidden states -> (N, T, H) in the batch's layout."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # (G * S, H)
        return flat[self.index.reshape(-1)].reshape(*self.index.shape, hidden.shape[-1])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Packed | None:
    """Pack right-padded rows (N, T) that share a prefix; None when no two rows do (nothing to save) or a row's
    padding is not all at its end. A row's prefix is its tokens up to and including the position that predicts its
    first trained token; rows with equal prefixes form a pack."""
    lengths_t = attention_mask.sum(-1)  # (N,)
    width = input_ids.shape[1]
    if not torch.equal(attention_mask.bool(), torch.arange(width, device=lengths_t.device)[None] < lengths_t[:, None]):
        return None
    ids, lengths = input_ids.tolist(), lengths_t.tolist()
    sel = loss_mask[:, 1:].bool()  # (N, T-1): positions whose hidden state the head reads
    first = torch.where(sel.any(-1), sel.int().argmax(-1), lengths_t - 1).tolist()  # a row with none: all of it
    groups: dict[tuple, list[int]] = {}
    for r, q in enumerate(first):
        groups.setdefault(tuple(ids[r][:q + 1]), []).append(r)
    if len(groups) == len(ids):
        return None
    seqs, pos, seg = [], [], []
    local, pack_of = [None] * len(ids), [0] * len(ids)  # row r's positions' places in pack pack_of[r]
    for g, (prefix, rows) in enumerate(groups.items()):
        p = len(prefix)
        seq, where, segment = list(prefix), list(range(p)), [0] * p
        for i, r in enumerate(rows, start=1):
            local[r] = list(range(p)) + list(range(len(seq), len(seq) + lengths[r] - p))
            local[r] += [0] * (width - lengths[r])  # padding reads the pack's first position (never trained)
            pack_of[r] = g
            seq += ids[r][p:lengths[r]]
            where += range(p, lengths[r])
            segment += [i] * (lengths[r] - p)
        seqs.append(seq)
        pos.append(where)
        seg.append(segment)
    span, device = max(map(len, seqs)), input_ids.device
    index = torch.tensor(local, device=device) + span * torch.tensor(pack_of, device=device)[:, None]  # (N, T)
    fill = lambda rows, v: torch.tensor([x + [v] * (span - len(x)) for x in rows], device=device)  # noqa: E731
    segment = fill(seg, -1)  # (G, S): 0 the prefix, i the pack's i-th row, -1 padding
    k = torch.arange(span, device=device)
    causal = k[None, :] <= k[:, None]  # (S, S) [query, key]: key <= query
    key_seg, query_seg = segment[:, None, :], segment[:, :, None]  # (G, 1, S), (G, S, 1)
    allowed = causal & (key_seg >= 0) & ((key_seg == 0) | (key_seg == query_seg))  # (G, S, S)
    allowed |= torch.eye(span, dtype=torch.bool, device=device)  # a padding query attends to itself (no NaN)
    return Packed(input_ids=fill(seqs, int(ids[0][0])), position_ids=fill(pos, 0), allowed=allowed[:, None],
                  index=index, tokens=sum(map(len, seqs)), unpacked_tokens=sum(lengths))
