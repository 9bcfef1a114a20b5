"""Advantage estimators: ``fn(inp: AdvantageInputs, cfg) -> Advantages`` with one value per policy token.

Most estimators score a whole trajectory from its reward and its group (outcome rewards); ``@outcome`` turns such a
``fn(rewards (M,), group_ids (M,), cfg) -> (M,)`` into the token-level interface by spreading each trajectory's
value over its policy tokens (every segment of a trajectory gets it). The plain function stays reachable as
``fn.__wrapped__``. Token-level estimators (REINFORCE++, GAE) see the mask and, for GAE, the value head's predictions.

An estimator that needs a value head says so with ``needs_values = True``; the module then builds a value head and
fills ``AdvantageInputs.values``, and the estimator returns ``Advantages.returns`` as the value head's targets.

- GRPO (Shao et al. 2024): (r - group mean) / (group std + eps); ``scale_by_std=False`` drops the division.
- Dr. GRPO (Liu et al. 2025): r - group mean (pair it with ``seq_mean_token_sum_norm`` aggregation).
- RLOO (Ahmadian et al. 2024): r - mean of the *other* members of the group.
- REINFORCE with a baseline (Williams 1992): r - mean reward of the batch.
- REINFORCE++ (Hu 2025): the return (r on every token, gamma = 1) normalized over all policy tokens of the batch;
  ``reinforce_pp_baseline`` subtracts the group mean first, then divides by the batch's token std (verl's
  ``reinforce_plus_plus_baseline``, which also re-centres on the token-weighted batch mean: see Deviations).
- GAE (Schulman et al. 2016) on a value head, whitened over the batch's policy tokens (as verl does for PPO).
- FlashREINFORCE (Hu, Zhang et al. 2026, Eq. 5): ``r - mean(r)`` over the batch, one sample per prompt: the same
  function as ``reinforce``, registered under its own name too.
- ``none``: zero advantage (on-policy distillation alone, ``distill_coef > 0``).

Turn-level credit (a turn is one engine call; ``AdvantageInputs.turns`` names each policy token's turn, and a turn's
advantage lands on that turn's tokens only). Per-turn rewards come from the agent (``AgentResult.turn_rewards``);
a trajectory without them has its reward on its last turn. Returns are discounted per turn:
``G_k = sum_{j >= k} turn_gamma^(j - k) r_j``.
- ``turn_grpo``: ``G_k`` minus the mean of ``G_k`` over the group's trajectories that have a turn k (divided by
  their std with ``scale_by_std``): each turn is compared with the same turn of the other attempts at the prompt.
- ``gigpo``: GiGPO (Feng et al. 2025): an episode-level GRPO advantage of the trajectory reward plus
  ``step_coef`` times a step-level one: ``G_k`` normalized within the turns of the group that acted on the same
  state (``AgentResult.turn_keys``, e.g. the observation), across trajectories and turn positions.
A (group, turn) or (group, state) of one has advantage 0 (as the group estimators here), and so does a turn
with no return.

On-policy distillation (``distill``, added to any estimator's advantage by the module when ``distill_coef > 0``):
``distill_coef * (log pi_teacher - log pi_student)`` per sampled token, the student's logprob the engine's (the
policy that sampled it), both at the sampling temperature: the negative of the sampled (k1) estimate of the reverse
KL(student || teacher), with no discount across tokens (Agarwal et al. 2024; Thinking Machines' on-policy
distillation, 2025).

Every group, batch and token statistic is exact on equal values (``group_stats``, ``whiten``): a group whose rewards
are all equal has exactly zero advantage, whatever the rewards (tested with continuous rewards for every estimator).

Deviations: ``reinforce_pp_baseline`` does not re-centre the group-centred returns on their token-weighted batch mean
(verl and OpenRLHF do): that mean is not 0 when rows differ in length, and subtracting it would give an all-equal group
a non-zero advantage. std is the unbiased sample std (as TRL and verl); a group (or batch) of one has std 0, so its
advantage is 0. REINFORCE++ here has no KL-in-reward term: use ``kl_coef`` (KL in the loss) instead. GAE treats each row
(a segment) as one episode: the trajectory reward arrives at the row's last policy token, prompt and tool tokens are not
steps (the next policy token's value is bootstrapped across them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # (M,) per trajectory, after reward shaping
    group_ids: torch.Tensor  # (M,) long
    traj_ids: torch.Tensor  # (N,) long: the trajectory of each row
    mask: torch.Tensor  # (N, T) bool: policy tokens
    values: torch.Tensor | None = None  # (N, T) detached value predictions (estimators with needs_values only)
    turns: torch.Tensor | None = None  # (N, T) long: each policy token's turn in its trajectory, -1 off the mask
    turn_rewards: torch.Tensor | None = None  # (M, K) per-turn rewards, NaN past a trajectory's last turn
    turn_keys: torch.Tensor | None = None  # (M, K) long: numbered per-turn state keys, -1 where none


@dataclass
class Advantages:
    advantages: torch.Tensor  # (N, T), 0 off the mask
    returns: torch.Tensor | None = None  # (N, T) value-head targets (estimators with needs_values only)


def outcome(fn: Callable) -> Callable:
    """Lift ``fn(rewards (M,), group_ids (M,), cfg) -> (M,)`` to ``fn(AdvantageInputs, cfg) -> Advantages``."""

    @functools.wraps(fn)
    def estimator(inp: AdvantageInputs, cfg) -> Advantages:
        adv = fn(inp.rewards, inp.group_ids, cfg)[inp.traj_ids]  # (N,)
        return Advantages(adv[:, None] * inp.mask)  # (N, T)

    return estimator


def group_stats(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per entry, each (M,) in ``x``'s dtype: ``x`` minus its group's mean, the group's unbiased std (0 for a group of
    one) and the group's size. Exact on equal values: each group is first shifted by its minimum (``x - min`` is
    exactly 0 for a value equal to it) and the statistics are taken in float64, so a group whose values are all equal
    gets exactly 0 deviation and std (in float32, the plain mean of 16 copies of 0.9 is one ulp off, and dividing
    that residue by ``std + eps`` gave every member an advantage of 0.106)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # (M,), (K,)
    x64 = x.double()
    low = torch.full((counts.numel(),), math.inf, dtype=torch.float64, device=x.device)
    shifted = x64 - low.scatter_reduce(0, inverse, x64, "amin")[inverse]  # (M,) >= 0, exactly 0 at the minimum
    zeros = torch.zeros(counts.numel(), dtype=torch.float64, device=x.device)  # (K,)
    dev = shifted - (zeros.index_add(0, inverse, shifted) / counts)[inverse]  # (M,)
    std = (zeros.index_add(0, inverse, dev**2) / (counts - 1).clamp(min=1)).sqrt()[inverse]  # (M,)
    return dev.to(x.dtype), std.to(x.dtype), counts[inverse].to(x.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float, centre: bool = True) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries (unbiased std), 0 off the mask; ``centre=False`` only divides.
    Exact on equal values (shifted by the masked minimum and taken in float64, as ``group_stats``)."""
    if not mask.any():
        return torch.zeros_like(x)
    m = mask.double()
    x64 = torch.where(mask, x.double() - x[mask].min().double(), 0.0)  # exactly 0 at the minimum
    n = m.sum()
    dev = (x64 - x64.sum() / n) * m
    std = ((dev**2).sum() / (n - 1).clamp(min=1)).sqrt()
    return ((dev if centre else x.double() * m) / (std + eps)).to(x.dtype)


@outcome
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``, or ``r - mean_group`` with ``cfg.scale_by_std=False``."""
    adv, std, _ = group_stats(rewards, group_ids)  # (M,) each
    return adv / (std + cfg.eps) if cfg.scale_by_std else adv


@outcome
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """Dr. GRPO: ``r - mean_group`` (no std division, whatever ``scale_by_std`` says)."""
    return group_stats(rewards, group_ids)[0]


@outcome
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_group)``; 0 for a group of one."""
    adv, _, n = group_stats(rewards, group_ids)  # (M,) each
    return adv * n / (n - 1).clamp(min=1)


@outcome
def reinforce(rewards: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: ``r - mean(r)`` (each trajectory counted once)."""
    return group_stats(rewards, torch.zeros_like(group_ids))[0]  # the batch as one group: exact on equal rewards


def reinforce_pp(inp: AdvantageInputs, cfg) -> Advantages:
    """REINFORCE++: every policy token's return is the trajectory reward (gamma = 1), normalized over all policy
    tokens of the batch (token-weighted mean and std, as OpenRLHF and verl)."""
    returns = inp.rewards[inp.traj_ids][:, None].expand(inp.mask.shape)  # (N, T)
    return Advantages(whiten(returns, inp.mask, cfg.eps))


def reinforce_pp_baseline(inp: AdvantageInputs, cfg) -> Advantages:
    """REINFORCE++ with the group mean subtracted, then divided by the batch's token std (not re-centred: see the
    module docstring)."""
    centred = group_stats(inp.rewards, inp.group_ids)[0][inp.traj_ids][:, None].expand(inp.mask.shape)  # (N, T)
    return Advantages(whiten(centred, inp.mask, cfg.eps, centre=False))


def gae(inp: AdvantageInputs, cfg) -> Advantages:
    """GAE(gamma, lambda) over each row's policy tokens, reward at the row's last policy token:

    delta_t = r_t + gamma * V_next - V_t,  A_t = delta_t + gamma * lambda * A_next,  returns = A + V,
    where "next" is the next *policy* token of the row (V_next = 0 after the last one). Advantages are then
    whitened over the batch; the returns (value targets) are not.
    """
    values, mask = inp.values, inp.mask
    N, T = mask.shape
    last = torch.where(mask, torch.arange(T, device=mask.device), -1).amax(dim=1)  # (N,) last policy token
    token_rewards = torch.zeros_like(values)  # (N, T)
    rows = torch.arange(N, device=mask.device)[last >= 0]  # rows with at least one policy token
    token_rewards[rows, last[rows]] = inp.rewards[inp.traj_ids][rows]
    adv = torch.zeros_like(values)  # (N, T)
    next_value = torch.zeros(N, dtype=values.dtype, device=values.device)  # (N,)
    next_adv = torch.zeros_like(next_value)  # (N,)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + cfg.gamma * next_value - values[:, t]  # (N,)
        a = delta + cfg.gamma * cfg.lam * next_adv  # (N,)
        m = mask[:, t]
        adv[:, t] = torch.where(m, a, 0.0)
        next_adv = torch.where(m, a, next_adv)  # prompt and tool tokens are not steps: carry across them
        next_value = torch.where(m, values[:, t], next_value)
    returns = (adv + values) * mask  # (N, T)
    return Advantages(whiten(adv, mask, cfg.eps), returns)


gae.needs_values = True


def zero(inp: AdvantageInputs, cfg) -> Advantages:
    """No advantage: the distillation term alone trains the policy."""
    return Advantages(torch.zeros(inp.mask.shape, device=inp.mask.device))


def turn_returns(turn_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_k = r_k + gamma * G_{k+1}`` along each row of (M, K) per-turn rewards, NaN past a row's last turn."""
    returns, following = torch.full_like(turn_rewards, math.nan), torch.zeros_like(turn_rewards[:, 0])  # (M, K), (M,)
    for k in reversed(range(turn_rewards.shape[1])):
        valid = ~turn_rewards[:, k].isnan()
        following = torch.where(valid, turn_rewards[:, k] + gamma * following, 0.0)
        returns[:, k] = torch.where(valid, following, math.nan)
    return returns


def keyed_normalize(x: torch.Tensor, keys: torch.Tensor, cfg) -> torch.Tensor:
    """``x - mean`` (``/ (std + eps)`` with ``cfg.scale_by_std``) within the entries sharing a key, for the
    entries of ``x`` that are not NaN and whose key is >= 0; 0 elsewhere (and for a key held once)."""
    valid = ~x.isnan() & (keys >= 0)
    out = torch.zeros_like(x)
    if valid.any():
        adv, std, _ = group_stats(x[valid], keys[valid])
        out[valid] = adv / (std + cfg.eps) if cfg.scale_by_std else adv
    return out


def on_turns(turn_adv: torch.Tensor, inp: AdvantageInputs) -> torch.Tensor:
    """(M, K) per-turn advantages onto each row's policy tokens (N, T): a token gets its own turn's."""
    turns = inp.turns.clamp(min=0)  # (N, T)
    per_token = turn_adv[inp.traj_ids[:, None].expand_as(turns), turns]  # (N, T)
    return torch.where(inp.mask & (inp.turns >= 0), per_token, 0.0)


def turn_grpo(inp: AdvantageInputs, cfg) -> Advantages:
    """Per-turn discounted returns, baselined by the same turn of the group's other trajectories."""
    returns = turn_returns(inp.turn_rewards, cfg.turn_gamma)  # (M, K)
    K = returns.shape[1]
    keys = inp.group_ids[:, None] * K + torch.arange(K, device=returns.device)  # (M, K): (group, turn index)
    return Advantages(on_turns(keyed_normalize(returns, keys, cfg), inp))


def gigpo(inp: AdvantageInputs, cfg) -> Advantages:
    """GiGPO: episode-level GRPO advantage + ``step_coef`` * step-level advantage within (group, state) groups."""
    if not (inp.turn_keys >= 0).any():
        raise ValueError("advantage 'gigpo' groups turns by state, but no trajectory of the batch gave turn keys: "
                         "return AgentResult(reward, turn_keys=[one per turn]) from the agent (EnvAgent gives the "
                         "observation each turn acted on), or use advantage: turn_grpo")
    episode = grpo.__wrapped__(inp.rewards, inp.group_ids, cfg)  # (M,)
    returns = turn_returns(inp.turn_rewards, cfg.turn_gamma)  # (M, K)
    n_states = int(inp.turn_keys.max()) + 1
    keys = torch.where(inp.turn_keys >= 0, inp.group_ids[:, None] * n_states + inp.turn_keys, -1)  # (M, K)
    step = keyed_normalize(returns, keys, cfg)  # (M, K)
    return Advantages(on_turns(episode[:, None] + cfg.step_coef * step, inp))


def distill(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """On-policy distillation's per-token advantage ``distill_coef * (log teacher - log student)``, 0 off the mask."""
    return torch.where(mask, cfg.distill_coef * (teacher_logprobs - student_logprobs), 0.0)


def on_last_turn(turn_rewards: torch.Tensor, turns: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """(M, K) per-turn rewards with ``delta`` (M,) (what reward shaping changed) added on each trajectory's last
    turn (``turns`` (M,) of them)."""
    out, last = turn_rewards.clone(), (turns - 1).clamp(min=0)
    out[torch.arange(len(last), device=last.device), last] += delta
    return out
