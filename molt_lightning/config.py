"""The recipe's records, by group, as commented defaults: what to roll out, how to cut a batch for training, the
optimizer, and mixture-of-experts routing. ``AsyncRLModule`` takes one of each (``algorithms.Algorithm`` is the
algorithm's record, ``lora.LoraSpec`` the adapter's); a recipe nests their fields (``model: {rollout: {max_lag: 0}}``,
``--model.rollout.max_lag 0``) and LightningCLI answers a wrong key with the close ones. ``check`` methods raise a
``ValueError`` naming the field and the fix; the module calls them when it is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass
class Rollout:
    """What to roll out, and how the rollout side runs (``rollout``, ``admission``)."""

    group_size: int = 8  # agent runs per prompt (a GRPO group)
    prompts_per_step: int = 8  # groups per training batch
    max_lag: int = 1  # staleness bound in policy versions; 0 is synchronous on-policy training
    temperature: float = 1.0  # sampling temperature; the trainer recomputes logprobs at the same one
    top_p: float = 1.0  # nucleus sampling (engines.base.nucleus); the trainer recomputes logprobs in the same nucleus
    max_context: int | None = None  # longest token sequence an agent may build (None: the policy's max positions)
    agent_timeout_s: float = 300.0  # an agent run still going after this fails (counted, never trained on)
    task_seed: int = 0  # seed of the task stream (epoch e reads tasks(task_seed + e)), the requests and the engines
    max_failure_rate: float = 0.5  # stop the run when more than this share of recent agent runs failed (1: never)
    admit_ahead: bool = True  # while the trainer waits for a batch, start groups for later ones too
    switch_interval_ms: float | None = None  # Python's thread switch interval while agents run (None: its 5 ms)
    endpoint_host: str = "127.0.0.1"  # where the agents' endpoint listens; anything but loopback needs a token
    endpoint_token: str | None = None  # a secret every session key carries (harnesses in other namespaces/machines)

    def check(self) -> None:
        _at_least(self, "rollout", group_size=1, prompts_per_step=1, max_lag=0)
        if not 0 < self.max_failure_rate <= 1:
            raise ValueError(f"model.rollout.max_failure_rate must be in (0, 1] (1 turns the breaker off), got "
                             f"{self.max_failure_rate}")
        if self.temperature <= 0:
            raise ValueError("model.rollout.temperature must be > 0 for RL (greedy sampling has no logprobs to "
                             f"correct against), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"model.rollout.top_p must be in (0, 1] (1: the whole distribution), got {self.top_p}")
        check_host(self.endpoint_host, self.endpoint_token)
        if self.switch_interval_ms is not None and self.switch_interval_ms <= 0:
            raise ValueError(f"model.rollout.switch_interval_ms must be > 0 (or null: Python's own), got "
                             f"{self.switch_interval_ms}")


@dataclass
class Batching:
    """How one rollout batch is cut for training (``batching``) and what one forward may hold in memory."""

    updates_per_batch: int = 1  # epochs over each batch (PPO epochs; the ratio is against the batch's first policy)
    mini_batches: int = 1  # optimizer steps per epoch; trainer.max_steps counts optimizer steps
    micro_batch_tokens: int | None = None  # most padded tokens per forward/backward (accumulation); None: one pass
    logit_chunk_tokens: int = 512  # policy tokens per chunk of the output head (chunk x vocabulary floats at a time)
    share_prefix: bool = True  # run a prompt its rows share once per micro-batch (``prefix``; dense text policies)
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward pass (less memory)

    def check(self) -> None:
        _at_least(self, "batching", updates_per_batch=1, mini_batches=1, logit_chunk_tokens=1,
                  micro_batch_tokens=1 if self.micro_batch_tokens is not None else None)


@dataclass
class Optim:
    """AdamW over the trainable parameters (a LoRA policy's adapter; the value head of a critic estimator)."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm per optimizer step (0: no clipping)


@dataclass
class MoE:
    """Mixture-of-experts policies (``moe``); a dense policy takes the defaults."""

    routing: Literal["free", "replay"] = "free"  # replay: train through the experts the engine chose (R3)
    aux_coef: float = 0.0  # weight of the router load-balancing loss (transformers' load_balancing_loss_func)

    def check(self, engine) -> None:
        if self.routing == "replay" and not engine.captures_routing:
            raise ValueError(f"model.moe.routing=replay needs an engine that records the experts it routed each token "
                             f"to; {type(engine).__name__} does not: use molt_lightning.engines.TorchEngine or "
                             f"VLLMEngine(capture_routing=True), or model.moe.routing: free")


def check_host(host: str, token: str | None) -> None:
    """The agents' endpoint stays on loopback unless a token guards it."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ValueError(f"endpoint host {host!r} is not an IP address (e.g. 127.0.0.1, or an interface's "
                         "address for harnesses in other namespaces)") from None
    if not loopback and not token:
        raise ValueError(f"binding the endpoint to {host} exposes the policy beyond this machine's loopback: set "
                         "model.rollout.endpoint_token to a secret too (every session key then carries it), or "
                         "keep endpoint_host at 127.0.0.1")


class NotImported(ValueError):
    """A dotted path that does not import; ``reason`` is why (the import's own error)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def imported(path: str, what: str, fix: str = "") -> Any:
    """The object at the dotted ``path`` (``pkg.module.name``, or ``pkg.module:name``) a recipe names; else
    ``NotImported`` saying "<what> '<path>' does not import (<why>)[: <fix>]". Every dotted path is imported here."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        raise NotImported(f"{what} {path!r} does not import ({e})" + (f": {fix}" if fix else ""), str(e)) from None


def _at_least(record, group: str, **least) -> None:
    for name, low in least.items():
        if low is not None and getattr(record, name) < low:
            raise ValueError(f"model.{group}.{name} must be >= {low}, got {getattr(record, name)}")


# checkpoints store the recipe's records in their hyperparameters: let torch.load(weights_only=True) (Lightning's
# default when resuming) read them back
torch.serialization.add_safe_globals([Rollout, Batching, Optim, MoE])
