"""The stacks ``molt-bench run`` can run here, behind one small record each.

- ``molt``: ``AsyncRLModule`` as the protocol says (asynchronous, staleness bound ``max_lag``).
- ``molt-sync``: the same code path with ``max_lag: 0`` (exact on-policy); its recorded protocol says so, so
  comparing it with ``molt`` needs ``--allow-diff max_lag``.
- ``trl``: TRL's ``GRPOTrainer`` (optional extra ``molt-lightning[trl]``) as a TRL user runs it: its own generation
  (transformers ``generate``; ``--engine vllm``: its vLLM colocate mode), a dataset of conversational prompts and the
  protocol's ``task.reward`` function; single-turn protocols only (``task.max_turns: 1``, e.g.
  ``arithmetic-single-turn``, the single-turn variant of ``arithmetic-tiny``); synchronous (``max_lag: 0``). See
  ``stacks/trl.py``.
- ``trl-rollout-func``: TRL's ``GRPOTrainer`` with the protocol's own (multi-turn) agent program inside TRL's
  ``rollout_func`` hook, sampled by molt's ``TorchEngine``: the matched multi-turn comparison, not stock TRL;
  synchronous (``max_lag: 0``). See ``stacks/trl_rollout_func.py``.
- ``tinker-cookbook``: tinker-cookbook's RL trainer (``rl.train.main``, unchanged) training a LoRA adapter through
  ``molt tinker``, molt's server for the Tinker API; single-turn protocols with ``model.lora`` (e.g.
  ``arithmetic-single-turn-lora``); synchronous, and the cookbook's fixed Adam betas, unclipped summed loss and
  mean-centred advantages are recorded as changes. See ``stacks/tinker_cookbook.py``.

A stack is a name, the protocol fields it changes (recorded in the run's protocol), honest notes, a ``check``
that refuses protocol values it cannot honour, and ``run_seed(protocol, seed, workdir, options) -> frame``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from .support import check_supported, unsupported  # noqa: F401  (the stacks' shared checks)


@dataclass
class Stack:
    name: str
    module: str  # where check() and run_seed() live, imported only when the stack runs
    changes: dict = field(default_factory=dict)
    notes: str = ""

    def _impl(self):
        return importlib.import_module(self.module)

    def check(self, protocol) -> None:
        self._impl().check(protocol)

    @property
    def run_seed(self) -> Callable:
        return self._impl().run_seed

    def describe(self, options: dict) -> dict:
        return self._impl().describe(options)


STACKS = {
    "molt": Stack("molt", "molt_lightning.bench.stacks.molt",
                  notes="molt AsyncRLModule, asynchronous rollouts bounded by max_lag"),
    "molt-sync": Stack("molt-sync", "molt_lightning.bench.stacks.molt", changes={"max_lag": 0},
                       notes="molt AsyncRLModule with max_lag 0: synchronous on-policy, same code path"),
    "trl": Stack("trl", "molt_lightning.bench.stacks.trl", changes={"max_lag": 0},
                 notes="stock TRL GRPOTrainer, synchronous, TRL's own generation; SINGLE-TURN: one completion per "
                       "prompt scored by the protocol's task.reward (multi-turn agents: run the protocol's "
                       "single-turn variant, or trl-rollout-func) (see stacks/trl.py)"),
    "trl-rollout-func": Stack(
        "trl-rollout-func", "molt_lightning.bench.stacks.trl_rollout_func", changes={"max_lag": 0},
        notes="TRL GRPOTrainer, synchronous; the protocol's multi-turn agent runs through TRL's rollout_func on "
              "molt's TorchEngine (see stacks/trl_rollout_func.py)"),
    "tinker-cookbook": Stack(
        "tinker-cookbook", "molt_lightning.bench.stacks.tinker_cookbook",
        changes={"max_lag": 0, "optimizer.betas": [0.9, 0.95], "optimizer.weight_decay": 0.0,
                 "optimizer.grad_clip": 0.0, "algorithm.scale_by_std": False,
                 "algorithm.aggregation": "seq_mean_token_sum"},
        notes="tinker-cookbook 0.6.1 rl.train.main, unchanged, through `molt tinker` (LoRA, alpha 32); synchronous; "
              "what the cookbook fixes is recorded as changes: Adam betas (0.9, 0.95) eps 1e-8, no weight decay, no "
              "gradient clipping, advantage = reward - group mean, loss summed over tokens (seq_mean_token_sum: the "
              "same step under Adam); loss_fn ppo with the protocol's clip band; sampling seeded by the server, so "
              "seeds differ only in their prompts; SINGLE-TURN (see stacks/tinker_cookbook.py)"),
}


def get_stack(name: str) -> Stack:
    if name not in STACKS:
        raise ValueError(f"unknown stack {name!r}: use one of {sorted(STACKS)}; runs made elsewhere come in through "
                         "`molt-bench import`")
    return STACKS[name]
