"""Mixture-of-experts routing: capture in the engine, replay in the trainer (R3, "rollout routing replay").

A sparse layer's router picks the top-k experts of each token from its logits. Engine and trainer compute those
logits with different kernels, batch shapes and (in the engine) incrementally, so a near tie can fall the other way
in the trainer: the token then runs through another expert, and its logprob differs from the one it was sampled
with by far more than numerical noise. Routing replay (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", R3) records the experts the engine chose for every position and makes the
trainer's forward use them; the router stays live: the combine weights are the softmax of the trainer's own router
logits, gathered at the replayed experts (renormalized when the config says ``norm_topk_prob``), so the router still
gets gradients.

Pieces, one each:
- ``routers(model)``: the router modules of a Hugging Face MoE (``*TopKRouter`` of transformers 5: ``forward(h) ->
  (logits, scores, indices)``, attributes ``top_k``, ``num_experts``, ``weight``), in layer order; empty for a dense
  model. ``RoutingCapture`` (the torch engine's hooks) records the indices they return.
- ``routed(lm, record, replay)``: a context manager around one policy forward that swaps each router's forward for
  ``_route``: router math in fp32, the free top-k, and with ``replay`` the recorded experts wherever the record has a
  row (``NO_RECORD`` rows, e.g. a turn's last token, which the engine never forwarded, route freely). It yields a
  ``RouterRecord``: per layer the live logits (for the auxiliary loss) and the free and used choices (for metrics).
- ``router_metrics``: agreement of the trainer's free choice with the engine's per layer (share of recorded positions
  with the same top-k set) and the expert load's worst violation (max over experts of load / mean load - 1).

Who records: the torch engine (``RoutingCapture``'s hooks) and ``VLLMEngine(capture_routing=True)`` (capture
functions on vLLM's routers, mapped back to requests in ``engines/vllm/worker.py``; vLLM's own
``enable_return_routed_experts`` needs Model Runner V2, i.e. Triton, which the CPU build lacks).

Deliberate deviations: the record is the engine's *first* computation of each position (a multi-turn prompt's
earlier tokens keep the routing they were sampled with, not the next turn's prefill's); a weight update in the
middle of a request keeps the routing computed before it (the tokens after it were sampled through a recomputed
context whose routing may differ; the trainer's weights differ from both anyway). The replay hook wraps the forward
only, so it refuses activation checkpointing (the backward's recompute would route freely). The load-balancing loss
reads the live logits' own top-k, not the replayed experts.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

NO_RECORD = -1  # the marker of a position without an engine record (int16 routing tensors)
ROUTING_DTYPE = torch.int16  # expert ids up to 32,767: real MoEs have 256+ experts, too many for uint8 and a marker


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k router modules in forward (layer) order; empty for a dense model."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


class RoutingCapture:
    """Forward hooks on every router. ``take()`` returns the experts chosen in the last forward, (B, S, layers, k)
    int16, for the (B, S) tokens that forward ran. For the torch engine's decode loop, a table in batch columns:
    ``start`` one per batch, ``step`` after each forward (prefill, decode step or recompute: only columns never
    recorded are written, so each position keeps its first record), ``rows`` a request's slice. A dense model has
    no routers: ``step`` does nothing and ``rows`` is None."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self._seen: list[torch.Tensor | None] = [None] * len(self.routers)
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        self.table: torch.Tensor | None = None
        self.recorded = 0

    def start(self, batch: int, width: int) -> None:
        self.recorded, self.table = 0, None
        if self.routers:
            shape = (batch, width, len(self.routers), self.routers[0].top_k)  # (B, L + max_new, layers, k)
            self.table = torch.full(shape, NO_RECORD, dtype=ROUTING_DTYPE)

    def step(self, batch: int, steps: int, width: int) -> None:
        """After a forward of the (B, S) tokens at columns [width - S, width): record the columns not yet recorded."""
        if self.table is not None:
            new = self.take(batch, steps)  # (B, S, layers, k)
            self.table[:, self.recorded:width] = new[:, steps - (width - self.recorded):].cpu()
            self.recorded = width

    def rows(self, i: int, start: int, end: int) -> torch.Tensor | None:
        return None if self.table is None else self.table[i, start:end].clone()  # (end - start, layers, k)

    def _hook(self, layer: int):
        def hook(module, args, out):
            self._seen[layer] = out[2]  # (B*S, k) expert ids
        return hook

    def take(self, batch: int, steps: int) -> torch.Tensor:
        ids = torch.stack(self._seen, dim=1)  # (B*S, layers, k)
        self._seen = [None] * len(self.routers)
        return ids.reshape(batch, steps, *ids.shape[1:]).to(ROUTING_DTYPE)  # (B, S, layers, k)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@dataclass
class RouterRecord:
    """What one policy forward's routers did, per layer (rows are the forward's flattened (N*T) positions)."""

    logits: list[torch.Tensor] = field(default_factory=list)  # (N*T, E) live router logits, with gradient
    free: list[torch.Tensor] = field(default_factory=list)  # (N*T, k) the trainer's own top-k
    used: list[torch.Tensor] = field(default_factory=list)  # (N*T, k) the experts the forward ran (replayed or free)


def _route(router: nn.Module, hidden: torch.Tensor, replayed: torch.Tensor | None, out: RouterRecord, layer: int):
    """The router's forward with optional replay; same math as transformers' ``Qwen3MoeTopKRouter`` when free."""
    h = hidden.reshape(-1, router.weight.shape[1])  # (n, H)
    logits = F.linear(h, router.weight)  # (n, E)
    probs = torch.softmax(logits.float(), dim=-1)  # (n, E) router math in fp32
    free = torch.topk(probs, router.top_k, dim=-1).indices  # (n, k)
    used = free
    if replayed is not None:
        replayed = replayed.reshape(-1, router.top_k).long()  # (n, k)
        has = (replayed >= 0).all(-1, keepdim=True)  # (n, 1): a position without a record routes freely
        used = torch.where(has, replayed, free)  # (n, k)
    weights = probs.gather(-1, used)  # (n, k): live probabilities at the used experts (gradient to the router)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(-1, keepdim=True)
    # indexed, not appended: an activation-checkpoint recompute runs the router again
    out.logits[layer], out.free[layer], out.used[layer] = logits, free, used
    return logits, weights.to(logits.dtype), used


@contextmanager
def routed(lm: nn.Module, record: torch.Tensor | None, replay: bool):
    """Run the block's forward of ``lm`` through ``_route``; with ``replay``, use ``record`` (N, T, layers, k), the
    engine's choices for the forward's (N, T) tokens. Yields the ``RouterRecord``; a dense ``lm`` yields an empty
    one."""
    mods, out = routers(lm), RouterRecord()
    if record is not None and replay and record.shape[2] != len(mods):
        raise ValueError(f"the routing record has {record.shape[2]} layers, the policy {len(mods)} routers: the "
                         "engine served another model; start it from the policy's own folder")
    out.logits, out.free, out.used = [None] * len(mods), [None] * len(mods), [None] * len(mods)
    for layer, r in enumerate(mods):
        rec = record[:, :, layer] if (replay and record is not None) else None  # (N, T, k)
        r.forward = lambda hidden, r=r, rec=rec, layer=layer: _route(r, hidden, rec, out, layer)
    try:
        yield out
    finally:
        for r in mods:
            del r.forward  # back to the class's forward


def router_metrics(rec: RouterRecord, record: torch.Tensor | None, attention_mask: torch.Tensor,
                   num_experts: int) -> dict[str, torch.Tensor]:
    """``moe/agree_l{i}``: share of positions with an engine record whose free top-k set equals the engine's;
    ``moe/load_violation_max``: max over layers and experts of load / mean load - 1 over real (unpadded) positions."""
    if not rec.used:
        return {}
    real = attention_mask.reshape(-1).bool()  # (N*T,)
    metrics = {}
    with torch.no_grad():
        for layer, (free, used) in enumerate(zip(rec.free, rec.used)):
            if record is not None:
                engine = record[:, :, layer].reshape(-1, free.shape[-1]).long()  # (N*T, k)
                has = real & (engine >= 0).all(-1)  # (N*T,)
                same = (free.sort(-1).values == engine.sort(-1).values).all(-1)  # (N*T,)
                metrics[f"moe/agree_l{layer}"] = same[has].float().mean() if has.any() else torch.tensor(1.0)
            load = torch.bincount(used[real].reshape(-1), minlength=num_experts).float()  # (E,)
            violation = load.max() / load.mean().clamp(min=1e-9) - 1
            metrics["moe/load_violation_max"] = torch.maximum(metrics.get("moe/load_violation_max", violation),
                                                              violation)
    return metrics


def aux_loss(rec: RouterRecord, attention_mask: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss of the forward's live router logits (transformers' own
    ``load_balancing_loss_func``, padding excluded); 0 for a dense policy."""
    if not rec.logits:
        return torch.zeros((), device=attention_mask.device)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(tuple(rec.logits), num_experts, top_k, attention_mask)
