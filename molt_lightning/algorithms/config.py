"""The recipe's algorithm record: which pieces (by registered name or dotted path) and their knobs.

One flat dataclass, so ``molt fit --help`` lists every knob. The defaults are GRPO with PPO clipping, token-mean
aggregation and token-level truncated importance sampling (TIS, cap 2) in the decoupled form. ``check`` turns a bad
combination into one error that names the problem and the fix; ``algorithms.build`` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Algorithm:
    # ----- pieces: registered names or dotted paths (pkg.module.fn) -----
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce | reinforce_pp | reinforce_pp_baseline | gae |
    #                          flash_reinforce | turn_grpo | gigpo | none (distillation alone)
    loss: str = "ppo_clip"  # ppo_clip | gspo | cispo | pg | flash_reinforce
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    reward_shaping: str | list[str] = "none"  # none | overlong | stop_properly | length, or a list applied in order
    group_filter: str = "none"  # none | nonzero_std (DAPO dynamic sampling)
    token_selection: str | list[str] = "none"  # none | top_entropy | overlong_filter, or a list applied in order
    # ----- advantages -----
    scale_by_std: bool = True  # GRPO: divide by the group's reward std (False: Dr. GRPO's mean-only estimator)
    eps: float = 1e-6  # added to every std we divide by
    gamma: float = 1.0  # GAE discount per policy token
    lam: float = 1.0  # GAE lambda
    value_coef: float = 0.5  # GAE: weight of the value head's loss 0.5 * (V - return)^2 (token mean)
    turn_gamma: float = 1.0  # turn_grpo, gigpo: discount per turn of the per-turn returns
    step_coef: float = 1.0  # gigpo: weight (omega) of the step-level advantage added to the episode-level one
    distill_coef: float = 0.0  # > 0: add distill_coef * (log teacher - log student) per token (model.teacher)
    # ----- policy loss -----
    clip_low: float = 0.2  # PPO ratio clipped to [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's
    clip_high: float = 0.2  # clip-higher. CISPO clips its IS weight to the same band; GSPO its sequence ratio.
    dual_clip: float = 0.0  # dual-clip constant c > 1 (Ye et al. 2020) for negative advantages; 0 turns it off
    binary_kl_delta: float = 3e-3  # flash_reinforce: a row trains only if its mean binary KL <= this (trust region)
    loss_norm_tokens: int = 0  # seq_mean_token_sum_norm: the constant token normalizer (Dr. GRPO's max length)
    # ----- off-policy correction against the engine's logprobs -----
    is_form: str = "decoupled"  # decoupled (PPO old = trainer before the update; IS weight vs engine) | bypass
    is_level: str = "token"  # token | sequence (product over the row) | geometric (geometric mean over the row)
    is_mode: str = "truncate"  # truncate: min(w, cap) | clip: clamp(w, floor, cap) | mask: w in band | none
    tis_cap: float = 2.0  # upper bound of the IS weight (truncate, clip) or of the band (mask)
    is_floor: float = 0.0  # lower bound of the IS weight (clip) or of the band (mask; IcePop uses 0.5)
    # ----- regularizers -----
    kl_coef: float = 0.0  # > 0 loads a frozen reference policy and adds kl_coef * KL(policy || reference) per token
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman 2020)
    entropy_coef: float = 0.0  # entropy bonus: the loss subtracts entropy_coef * per-token entropy
    # ----- token selection (selection.py) -----
    top_entropy_share: float = 0.2  # top_entropy: the share of the batch's policy tokens, highest entropy first
    # ----- reward shaping (DAPO overlong) -----
    overlong_max_tokens: int = 0  # L_max: longest response (policy tokens of a trajectory) before the full penalty
    overlong_buffer: int = 0  # L_cache: the penalty ramps from 0 to -overlong_penalty over the last this many tokens
    overlong_penalty: float = 1.0
    # ----- reward shaping (length penalties) -----
    truncation_penalty: float = 1.0  # stop_properly: subtracted from a truncated trajectory's reward
    token_penalty: float = 0.0  # length: subtracted per policy token of the trajectory
    turn_penalty: float = 0.0  # length: subtracted per turn of the trajectory

    @property
    def selections(self) -> list[str]:
        """``token_selection`` as a list of names (``none`` dropped)."""
        names = [self.token_selection] if isinstance(self.token_selection, str) else list(self.token_selection)
        return [n for n in names if n != "none"]

    @property
    def shapers(self) -> list[str]:
        """``reward_shaping`` as a list of names (``none`` dropped)."""
        names = [self.reward_shaping] if isinstance(self.reward_shaping, str) else list(self.reward_shaping)
        return [n for n in names if n != "none"]

    def check(self) -> None:
        """Raise ``ValueError`` naming the problem and the fix (names are checked by ``algorithms.build``)."""
        problems = []
        if not 0 <= self.clip_low <= 1 or self.clip_high < 0:
            problems.append(f"clip_low={self.clip_low}, clip_high={self.clip_high}: need 0 <= clip_low <= 1 and "
                            "clip_high >= 0 (the ratio is clipped to [1 - clip_low, 1 + clip_high])")
        if self.dual_clip != 0 and self.dual_clip <= 1:
            problems.append(f"dual_clip={self.dual_clip}: use a constant > 1 (3.0 in the paper), or 0 to turn it off")
        if not 0 <= self.is_floor < self.tis_cap:
            problems.append(f"is_floor={self.is_floor}, tis_cap={self.tis_cap}: need 0 <= is_floor < tis_cap")
        if self.is_form == "bypass" and self.is_mode != "none":
            problems.append("is_form='bypass' takes the engine's logprobs as PPO's old policy, so there is no separate "
                            f"IS weight to {self.is_mode}: set is_mode: none (or use is_form: decoupled)")
        if self.aggregation == "seq_mean_token_sum_norm" and self.loss_norm_tokens <= 0:
            problems.append("aggregation 'seq_mean_token_sum_norm' divides by a constant: set loss_norm_tokens to the "
                            "longest response a trajectory may generate (Dr. GRPO's MAX_TOKENS)")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            problems.append(f"gamma={self.gamma}, lam={self.lam}: both must lie in [0, 1]")
        if min(self.kl_coef, self.entropy_coef, self.value_coef, self.distill_coef, self.step_coef) < 0:
            problems.append("kl_coef, entropy_coef, value_coef, distill_coef and step_coef must be >= 0")
        if not 0 <= self.turn_gamma <= 1:
            problems.append(f"turn_gamma={self.turn_gamma} must lie in [0, 1]")
        if self.loss == "flash_reinforce" and (self.is_form != "bypass" or self.is_mode != "none"):
            problems.append("loss 'flash_reinforce' takes its ratio and binary-KL trust region against the engine's "
                            "(behavior) logprobs: set is_form: bypass and is_mode: none")
        if self.binary_kl_delta <= 0:
            problems.append(f"binary_kl_delta={self.binary_kl_delta} must be > 0 (the paper uses 1e-3 to 1e-2)")
        if "overlong" in self.shapers and not 0 < self.overlong_buffer <= self.overlong_max_tokens:
            problems.append("reward_shaping 'overlong' needs 0 < overlong_buffer <= overlong_max_tokens "
                            f"(got {self.overlong_buffer}, {self.overlong_max_tokens})")
        if not 0 < self.top_entropy_share <= 1:
            problems.append(f"top_entropy_share={self.top_entropy_share} must lie in (0, 1] (0.2: the top 20%)")
        if problems:
            raise ValueError("algo: " + "; ".join(problems))


# checkpoints store the recipe's Algorithm in their hyperparameters: let torch.load(weights_only=True) (Lightning's
# default when resuming) read it back
torch.serialization.add_safe_globals([Algorithm])
