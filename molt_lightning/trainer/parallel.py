"""Data parallelism for the RL loop: who owns what, the FSDP2 plan, and the few collectives the loop needs.

Ranks and engines (the one place that says it):
- **Rank 0 owns the rollout source and the engine.** Each step it takes one batch of ``prompts_per_step`` groups from
  the source and broadcasts the trajectories (token ids, logprobs, versions: a few hundred KB) to every rank. Every
  rank then builds the same batch and the same plan (``batching.plan``) and trains on its own rows: whole groups, so no
  prompt is trained by two ranks within a step, and the union of the ranks' rows is the batch. Advantages are computed
  on the whole batch on every rank (group and batch statistics need all of it; they are cheap).
  We chose one source over a share of prompts per rank because the staleness bound is about one engine's version and
  one consumption counter: with a single source ``max_lag`` stays exactly what it is in one process, and a rank can
  never run ahead of the engine. The price is one broadcast per step.
- **Weight sync** (``molt_lightning.trainer.weights``) gathers full tensors bucket by bucket (under FSDP2 every rank
  takes part in each all-gather), and rank 0 stages each bucket into the engine and commits the version at the end.
- **Gradients**: the loss is normalized by batch-wide counts (``batching.Norm``) and multiplied by the world size,
  because DDP and FSDP2 average gradients over ranks; so the gradient equals the single-process one.

Strategies: ``ddp`` (Lightning's ``DDPStrategy``) and ``fsdp2`` (``FSDP2Strategy`` below: Lightning's
``ModelParallelStrategy`` with all ranks data-parallel; ``shard`` applies ``fully_shard`` to every decoder layer and
then to each ``Policy`` root in ``configure_model``). Anything else is refused with the choices.
``fsdp2_ep`` (``FSDP2EPStrategy``, mixture-of-experts policies) is ``fsdp2`` whose ``shard`` first splits every
sparse layer's experts over the ranks, with all-to-all dispatch (``expert_parallel``); FSDP2 ignores the experts.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, StrategyRegistry

log = logging.getLogger(__name__)
STRATEGIES = ("auto", "ddp", "fsdp2", "fsdp2_ep")  # the names --trainer.strategy takes
SUPPORTED = "auto (one process), ddp, fsdp2, fsdp2_ep (mixture-of-experts: experts split over the ranks)"
LORA_UNDER_FSDP2 = ("model.lora with --trainer.strategy fsdp2 or fsdp2_ep is not supported yet (the adapter's sync "
                    "and peft's frozen base are not wired through fully_shard): use --trainer.strategy ddp, or one "
                    "process, or "
                    "drop model.lora for full fine-tuning under fsdp2")


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with every rank in the data-parallel dimension (no tensor parallelism): FSDP2."""

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard) over all ranks, molt-lightning")


# ----- expert parallelism (the plan is in expert_parallel.py) -----
class FSDP2EPStrategy(FSDP2Strategy):
    """``fsdp2`` for every parameter but the experts, which are split over the ranks (``expert_parallel``)."""


if "fsdp2_ep" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2_ep", FSDP2EPStrategy,
                              description="FSDP2 plus expert parallelism (all-to-all) over all ranks, molt-lightning")


def check_strategy(trainer) -> None:
    """A clear error for strategies and device counts the loop does not run under; a warning for emulated bf16."""
    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)) \
            or type(strategy).__name__ in ("FSDPStrategy", "DeepSpeedStrategy"):
        raise ValueError(f"strategy {type(strategy).__name__} is not supported by AsyncRLModule: use {SUPPORTED} "
                         "(--trainer.strategy fsdp2 for sharded parameters)")
    if isinstance(strategy, ModelParallelStrategy) and strategy.device_mesh.ndim > 1 \
            and strategy.device_mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not supported yet: use --trainer.strategy fsdp2 (all ranks shard "
                         "the parameters and split the data)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    on_cpu = trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    if on_cpu and trainer.num_devices > (cores or 1):  # processes on this node (other nodes count their own cores)
        raise ValueError(f"{trainer.num_devices} CPU processes on a machine with {cores} cores would time-slice every "
                         f"collective: use --trainer.devices {cores} or fewer")
    if on_cpu and str(trainer.precision).startswith("bf16") and not native_bf16():
        log.warning("--trainer.precision %s on a CPU without native bf16 (no AVX512-BF16, no AMX): torch emulates "
                    "its matmuls, and SmolLM2's backward pass measured 19x slower than in float32 on such a CPU; "
                    "use --trainer.precision 32-true here (bf16-mixed pays where the CPU has them)", trainer.precision)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX on x86; other architectures: assumed)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return any(getattr(torch.cpu, name, lambda: True)() for name in ("_is_avx512_bf16_supported",
                                                                     "_is_amx_tile_supported"))


def is_sharded(strategy) -> bool:
    return isinstance(strategy, ModelParallelStrategy)


def shard(policy: torch.nn.Module, strategy) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the ``Policy`` root (embeddings, head, norm, value head).
    Returns ``policy``."""
    if not is_sharded(strategy):
        return policy
    from torch.distributed.fsdp import fully_shard

    from ..policies.lora import is_lora
    from .policy import decoder_of

    if is_lora(policy.lm):
        raise ValueError(LORA_UNDER_FSDP2)
    mesh = strategy.device_mesh["data_parallel"]
    layers = getattr(decoder_of(policy.lm), "layers", None)
    if layers is None:
        raise ValueError(f"fsdp2: {type(policy.lm).__name__} has no base_model.layers to shard; use ddp")
    experts = None  # fsdp2_ep: this rank's experts, which FSDP2 leaves alone
    if isinstance(strategy, FSDP2EPStrategy):
        from ..policies.expert_parallel import shard_experts

        experts = shard_experts(policy.lm, mesh)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=experts)
    fully_shard(policy, mesh=mesh, ignored_params=experts)
    return policy


@contextmanager
def grad_sync(strategy, policy: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter for every micro-batch but a mini-batch's last (accumulation)."""
    if enabled or isinstance(strategy, SingleDeviceStrategy):
        yield
    elif is_sharded(strategy):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        with getattr(strategy, "block_backward_sync", nullcontext)():
            yield


def broadcast(obj: Any, trainer) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if trainer.world_size == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any, trainer) -> list[Any]:
    if trainer.world_size == 1:
        return [obj]
    out = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


# what gloo and NCCL say when a rank of another node is gone (its process died, or the network to it broke)
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited|NCCL communicator was "
                       r"aborted|Watchdog caught collective operation timeout|Socket Timeout|Timed out waiting")


def lost_peer(error: BaseException) -> str | None:
    """The message for a collective that failed because a rank of the run is gone (None: some other error). It names
    this process's rank and node, and the peer's address where the backend gives one."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or not PEER_GONE.search(str(error)):
        return None
    env = os.environ.get
    node = env("GROUP_RANK") or env("SLURM_NODEID") or "?"
    nodes = env("GROUP_WORLD_SIZE") or env("SLURM_NNODES") or "?"  # torchrun's, SLURM's
    first = str(error).splitlines()[0].split("] ", 1)[-1].split(". This is typically")[0][:200]  # gloo's boilerplate
    return (f"trainer rank {torch.distributed.get_rank()} of {torch.distributed.get_world_size()} (node {node} of "
            f"{nodes}) lost contact with another rank: {first}. A trainer process on another node died or hangs, or "
            "the network between the nodes broke, so every node stops. Relaunch every node with --ckpt_path last: "
            "the run resumes from its last checkpoint")


def all_reduce(t: torch.Tensor, trainer, op=None) -> torch.Tensor:
    if trainer.world_size > 1:
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
    return t
