"""Advantage estimators, policy losses, off-policy corrections and aggregations: pure functions in registries,
picked by name (or a user's dotted path) from the recipe's ``Algorithm`` record.

| piece            | interface                                                   | registry         | module        |
|------------------|-------------------------------------------------------------|------------------|---------------|
| advantage        | ``fn(AdvantageInputs, cfg) -> Advantages`` (``@outcome``)    | ``ADVANTAGES``   | advantages.py |
| distillation     | ``distill(student, teacher, mask, cfg) -> (N, T)`` added     | (one function)   | advantages.py |
| policy loss      | ``fn(LossInputs, cfg) -> (per-token loss (N, T), metrics)`` | ``LOSSES``       | losses.py     |
| aggregation      | ``fn(x (N, T), mask, cfg) -> scalar``                       | ``AGGREGATIONS`` | objective.py  |
| KL estimator     | ``fn(logprobs, ref_logprobs) -> (N, T)``                    | ``KL_ESTIMATORS``| objective.py  |
| IS level/mode    | see correction.py                                           | ``IS_LEVELS``... | correction.py |
| reward shaping   | ``fn(rewards (M,), outcomes, cfg) -> (M,)``                 | ``REWARD_SHAPERS``| shaping.py   |
| group filter     | ``fn(rewards: list[float]) -> bool``                        | ``GROUP_FILTERS``| shaping.py    |
| token selection  | ``fn(SelectionInputs, cfg) -> mask (N, T)``                 | ``SELECTIONS``   | selection.py  |

Adding one costs one function, one registry line and one test. ``build(cfg)`` checks the record and resolves every
name once, so a typo fails at construction with the list of choices, not mid-run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import advantages as adv
from . import losses
from .advantages import AdvantageInputs, Advantages, on_last_turn
from .config import Algorithm
from .correction import IS_FORMS, IS_LEVELS, IS_MODES, Correction, off_policy
from .losses import LossInputs, masked_mean
from .objective import AGGREGATIONS, KL_ESTIMATORS, objective
from .registry import resolve
from .selection import SELECTIONS, SelectionInputs, chained
from .shaping import GROUP_FILTERS, REWARD_SHAPERS, chain

ADVANTAGES: dict[str, Callable] = {
    "grpo": adv.grpo, "dr_grpo": adv.dr_grpo, "rloo": adv.rloo, "reinforce": adv.reinforce,
    "reinforce_pp": adv.reinforce_pp, "reinforce_pp_baseline": adv.reinforce_pp_baseline, "gae": adv.gae,
    "flash_reinforce": adv.reinforce, "turn_grpo": adv.turn_grpo, "gigpo": adv.gigpo, "none": adv.zero,
}
LOSSES: dict[str, Callable] = {"ppo_clip": losses.ppo_clip, "gspo": losses.gspo, "cispo": losses.cispo, "pg": losses.pg,
                               "flash_reinforce": losses.flash_reinforce}


@dataclass(frozen=True)
class Functions:
    """The functions the module calls each step, resolved once from the recipe's ``Algorithm``."""

    advantage: Callable  # fn(AdvantageInputs, cfg) -> Advantages
    loss: Callable  # fn(LossInputs, cfg) -> (per-token loss, metrics)
    shape_rewards: Callable  # fn(rewards, outcomes, cfg) -> rewards (the recipe's shapers, in order)
    group_filter: Callable | None  # fn(rewards: list[float]) -> keep?; None keeps every group
    select: Callable  # fn(SelectionInputs, cfg) -> mask: the recipe's token selections, in order (none: the mask)
    needs_entropy: bool  # a selection reads the policy's entropies before the update
    entropy_grad: bool  # entropy_coef > 0: the entropy bonus needs the entropies' gradient
    needs_values: bool  # the estimator reads a value head (GAE)
    needs_reference: bool  # kl_coef > 0: a frozen copy of the initial policy
    distill: Callable | None  # distill_coef > 0: fn(student, teacher logprobs, mask, cfg) -> (N, T) added advantage


def build(cfg: Algorithm, teacher: str | None = None) -> Functions:
    """Check ``cfg`` (and that a distillation ``teacher`` comes with ``distill_coef > 0``) and resolve its names."""
    cfg.check()
    if (teacher is None) != (cfg.distill_coef == 0):
        raise ValueError("on-policy distillation needs both model.teacher (the teacher's model folder) and "
                         f"model.algo.distill_coef > 0; got teacher={teacher!r}, distill_coef={cfg.distill_coef}")
    for name, registry, what in [(cfg.aggregation, AGGREGATIONS, "aggregation"), (cfg.is_level, IS_LEVELS, "is_level"),
                                 (cfg.is_mode, IS_MODES, "is_mode"), (cfg.is_form, IS_FORMS, "is_form"),
                                 (cfg.kl_estimator, KL_ESTIMATORS, "kl_estimator")]:
        resolve(name, registry, what)  # fail now, with the choices, rather than at the first step
    advantage, select = resolve(cfg.advantage, ADVANTAGES, "advantage"), chained(cfg.selections)
    return Functions(
        advantage=advantage, loss=resolve(cfg.loss, LOSSES, "loss"),
        shape_rewards=chain([resolve(name, REWARD_SHAPERS, "reward_shaping") for name in cfg.shapers]),
        group_filter=resolve(cfg.group_filter, GROUP_FILTERS, "group_filter"),
        select=select, needs_entropy=select.needs_entropy, entropy_grad=cfg.entropy_coef > 0,
        needs_values=getattr(advantage, "needs_values", False), needs_reference=cfg.kl_coef > 0,
        distill=adv.distill if cfg.distill_coef > 0 else None,
    )


__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "GROUP_FILTERS", "IS_FORMS", "IS_LEVELS", "IS_MODES", "KL_ESTIMATORS", "LOSSES",
    "REWARD_SHAPERS", "SELECTIONS", "AdvantageInputs", "Advantages", "Algorithm", "Correction", "Functions",
    "LossInputs", "SelectionInputs", "build",
    "masked_mean", "objective", "off_policy", "on_last_turn", "resolve",
]
