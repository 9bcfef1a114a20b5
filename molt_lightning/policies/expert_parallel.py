"""Expert parallelism (EP) for mixture-of-experts policies: each rank holds ``E / world`` experts of every sparse layer,
and the tokens routed to another rank's experts travel there and back by all-to-all (``--trainer.strategy fsdp2_ep``).

The design is GShard / Megatron-style EP with all-to-all dispatch and combine, on the data-parallel ranks themselves
(EP size = DP size; every rank has its own tokens):

- **Router on every rank, on its own tokens.** Attention, norms, embeddings and the routers are FSDP2-sharded as under
  ``fsdp2`` (``parallel.shard``); the router (and ``moe.routed``'s replay hook, unchanged) picks each token's top-k
  global expert ids locally. Only the expert MLPs are distributed.
- **Dispatch** (``_ep_forward``, replacing ``Qwen3MoeExperts.forward(hidden, top_k_index, top_k_weights)`` per
  module): the (token, slot) assignments are sorted by expert id, hence by owner rank (expert ``e`` lives on rank
  ``e // (E / world)``); the per-rank counts are exchanged (one small all-to-all), then each assignment's hidden row and
  its local expert id travel by ``dist.all_to_all_single`` (uneven splits) inside ``_Exchange``, whose backward is
  the reverse all-to-all. Each rank runs its experts over what it received (the same loop as transformers' eager
  experts), the outputs travel back the same way, and the source rank weights them by its routing weights and sums the
  k slots of each token. Routing weights never leave their rank, so the router's gradient stays local.
- **Parameters.** The expert tensors stay under their Hugging Face names and shapes, as DTensors sharded on the expert
  dimension (``Shard(0)``) over the same data-parallel mesh FSDP2 uses, so every rank's local block is
  ``gate_up_proj (E/world, 2I, H)`` and ``down_proj (E/world, H, I)``. FSDP2 ignores them (``ignored_params``): they
  are never gathered for compute. Being DTensors, the rest comes for free and stays correct: ``full_tensor()`` in
  ``weights.buckets`` all-gathers the full ``(E, 2I, H)`` / ``(E, H, I)`` tensors for the engine (every
  rank iterates the parameters in the same order), ``clip_grad_norm_`` computes the global norm over all experts, the
  optimizer updates local blocks, and the distributed checkpoint saves shards.
- **Gradient scale.** The loop multiplies each rank's loss by the world size because FSDP2 averages gradients over
  ranks. An expert's gradient is not averaged: it already sums every rank's tokens through the all-to-all backward, so
  it would come out ``world`` times too large; ``_ScaleGrad`` divides it by ``world`` where the local block enters the
  compute. Two ranks then take the same SGD step as one process (tests/test_expert_parallel.py).

Why by hand: no maintained library does EP for Hugging Face Qwen3-MoE under data parallelism on gloo. transformers'
own EP (``distributed_config``/``MoeExpertsParallel``) is tensor-parallel style (every rank sees the same tokens and an
all-reduce sums the experts' partial outputs): wrong for ranks with different batches. torchtitan and Megatron's
token dispatchers target their own model classes and NCCL.

Deviations and limits: no capacity factor and no token dropping (every assignment is computed: exact, uneven load);
per sparse layer the forward runs four all-to-alls (counts, rows, expert ids, outputs) and the backward two; a token
whose k experts live on one rank travels k times (DeepEP-style dispatch would send it once); EP size equals the
data-parallel size (no separate EP mesh dimension); the experts' ``config._experts_implementation`` is bypassed (always
the eager loop); a local expert no token reached gets a zero gradient rather than none (the same SGD step; AdamW's
moments and weight decay still move it); every rank must run the same number of MoE forwards (the loop guarantees it:
an empty micro-batch still runs one row with weight 0). Activation checkpointing of an MoE policy
fails before this module matters (the recompute calls the routers without ``moe.routed``'s hook), under any strategy.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def expert_modules(lm: nn.Module) -> list[nn.Module]:
    """The modules that hold a sparse layer's experts as 3D tensors (transformers 5's ``*Experts``: ``gate_up_proj``
    (E, 2I, H), ``down_proj`` (E, H, I), ``num_experts``), in layer order; empty for a dense model."""
    return [m for m in lm.modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.ndim == 3
            and isinstance(getattr(m, "down_proj", None), nn.Parameter) and hasattr(m, "num_experts")]


def check(lm: nn.Module, world: int) -> list[nn.Module]:
    """The expert modules to shard over ``world`` ranks, or a clear error (dense policy, E not divisible)."""
    mods = expert_modules(lm)
    if not mods:
        raise ValueError(f"--trainer.strategy fsdp2_ep shards the experts of a mixture-of-experts policy, but "
                         f"{type(lm).__name__} is dense (no expert tensors): use --trainer.strategy fsdp2, or an MoE "
                         f"policy (e.g. molt_lightning.models.tiny.moe_policy)")
    for m in mods:
        if m.num_experts % world:
            raise ValueError(f"--trainer.strategy fsdp2_ep: {m.num_experts} experts per layer do not split evenly "
                             f"over {world} ranks: use a --trainer.devices that divides {m.num_experts}")
        if getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or not getattr(m, "has_gate", True):
            raise NotImplementedError(f"fsdp2_ep handles gated experts without bias in transformers' standard layout; "
                                      f"{type(m).__name__} differs: use --trainer.strategy fsdp2")
    return mods


def shard_experts(lm: nn.Module, mesh) -> set[nn.Parameter]:
    """Keep this rank's ``E / world`` experts of every sparse layer (as ``Shard(0)`` DTensors over ``mesh``, the 1D
    data-parallel mesh) and route their tokens by all-to-all; returns the expert parameters, for FSDP2 to ignore."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    params = set()
    for m in check(lm, world):
        local = m.num_experts // world
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(m, name)  # (E, 2I, H) or (E, H, I), identical on every rank (same checkpoint)
            block = full.detach()[rank * local:(rank + 1) * local].clone()  # (E/world, ...)
            shard = DTensor.from_local(block, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                       stride=full.stride())
            setattr(m, name, nn.Parameter(shard, requires_grad=full.requires_grad))
            params.add(getattr(m, name))
        m._ep = types.SimpleNamespace(group=mesh.get_group(), world=world, rank=rank, local=local)
        m.forward = types.MethodType(_ep_forward, m)  # instance attribute: the class's forward is untouched
    return params


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (the experts' 1/world, see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows of ``x`` (sum(send), ...): ``send[r]`` rows go to rank r, ``recv[r]`` rows come from it, in rank order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))  # (sum(recv), ...)
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """``_all_to_all`` with a gradient: the backward sends each row's gradient back where the row came from. (Our own
    few lines: ``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated in torch 2.13.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _ep_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``Qwen3MoeExperts.forward`` with this rank's experts: hidden (n, H), top_k_index (n, k) global expert ids,
    top_k_weights (n, k) -> (n, H). Every rank must call it (collectives), with any n, including 0."""
    ep = self._ep
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # (n*k,) the assignments, token-major
    order = torch.argsort(flat, stable=True)  # (n*k,) sorted by expert, hence by the rank that holds it
    expert, token = flat[order], order // k  # (n*k,), (n*k,)
    send_counts = torch.bincount(expert // ep.local, minlength=ep.world)  # (world,) assignments for each rank
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()

    x = _Exchange.apply(hidden[token], send, recv, ep.group)  # (m, H) the rows for this rank's experts
    ids = _all_to_all(expert % ep.local, send, recv, ep.group)  # (m,) their local expert ids

    scale = 1.0 / ep.world  # the experts' gradient sums every rank's tokens: undo the loop's loss * world
    gate_up = _ScaleGrad.apply(self.gate_up_proj.to_local(), scale)  # (E/world, 2I, H)
    down = _ScaleGrad.apply(self.down_proj.to_local(), scale)  # (E/world, H, I)
    y = torch.zeros_like(x)  # (m, H)
    # transformers' eager loop, over every local expert, hit or not: the weights are always in the graph, so each
    # rank holds a gradient (0 when unused) for each expert tensor and runs the same backward collectives
    for e in range(ep.local):
        rows = (ids == e).nonzero().squeeze(-1)  # (m_e,)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)  # (m_e, I) each
        y = y.index_add(0, rows, F.linear(self.act_fn(gate) * up, down[e]))  # (m_e, H) into (m, H)

    back = _Exchange.apply(y, recv, send, ep.group)  # (n*k, H) outputs, in ``order``
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)  # (n*k, H)
    return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))  # (n, H): sum of the k slots
