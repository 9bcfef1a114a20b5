"""Advantage estimators, reward shaping, group filters, the registry and config checks, against numbers derived by
hand (the derivation is in the comments). Losses, corrections and aggregations: test_algorithms_losses.py."""

import math
import sys
import textwrap

import pytest
import torch

from molt_lightning.algorithms import (
    ADVANTAGES, LOSSES, AdvantageInputs, Algorithm, build, resolve,
)
from molt_lightning.algorithms.advantages import (
    dr_grpo, gae, grpo, reinforce, reinforce_pp, reinforce_pp_baseline, rloo, whiten,
)
from molt_lightning.algorithms.losses import ppo_clip
from molt_lightning.algorithms.shaping import nonzero_std, overlong
from molt_lightning.trajectory import Outcomes

# Seven trajectories: group 0 has rewards 1,0,0,1; group 1 is all-equal (1,1); group 2 is a single sample.
R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.3])
G = torch.tensor([0, 0, 0, 0, 1, 1, 2])


def test_grpo_by_hand():
    # group 0: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025.
    # group 1: all equal -> 0 (0 / (0 + eps)). group 2: a single sample -> mean = r, std 0 -> 0.
    s = 0.5 / math.sqrt(1 / 3)
    adv = grpo.__wrapped__(R, G, Algorithm(eps=1e-12))
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s, 0, 0, 0]), atol=1e-5)
    # scale_by_std=False: the mean-only baseline r - 0.5
    mean_only = grpo.__wrapped__(R, G, Algorithm(scale_by_std=False))
    assert torch.allclose(mean_only, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0]))


def test_dr_grpo_ignores_scale_by_std():
    # Dr. GRPO: r - group mean, whatever scale_by_std says
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0])
    assert torch.allclose(dr_grpo.__wrapped__(R, G, Algorithm(scale_by_std=True)), expected)


def test_rloo_by_hand():
    # group 0, member 0: the others are 0,0,1 -> mean 1/3 -> 1 - 1/3 = 2/3; member 1: others 1,0,1 -> 0 - 2/3.
    # (equivalently n/(n-1) (r - mean) = 4/3 * +-0.5). group 1: 1 - 1 = 0. group 2: no other member -> 0.
    adv = rloo.__wrapped__(R, G, Algorithm())
    assert torch.allclose(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0]))


def test_reinforce_batch_mean_baseline_by_hand():
    # batch mean = (1 + 0 + 0 + 1 + 1 + 1 + 0.3) / 7 = 4.3 / 7 = 0.614286; advantage = r - 0.614286
    adv = reinforce.__wrapped__(R, G, Algorithm())
    assert torch.allclose(adv, R - 4.3 / 7)
    assert reinforce.__wrapped__(torch.tensor([0.7]), torch.tensor([0]), Algorithm()).item() == 0  # single sample


def test_outcome_estimators_spread_over_each_trajectorys_tokens():
    # Trajectory 1 has two segments (rows 1 and 2): both rows carry its advantage, only on policy tokens.
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    traj_ids = torch.tensor([0, 1, 1])
    mask = torch.tensor([[False, True, True], [False, True, False], [False, False, True]])
    out = grpo(AdvantageInputs(rewards, groups, traj_ids, mask), Algorithm(eps=0.0))
    # mean 0.5, std sqrt(0.5) -> +-0.5 / 0.707107 = +-0.707107
    a = 0.5 / math.sqrt(0.5)
    assert torch.allclose(out.advantages, torch.tensor([[0, a, a], [0, -a, 0], [0, 0, -a]]), atol=1e-6)
    assert out.returns is None


def test_reinforce_pp_token_weighted_batch_normalization_by_hand():
    # rewards 1 and 0; trajectory 0 has 3 policy tokens, trajectory 1 has 1.
    # token returns [1, 1, 1, 0]: mean 0.75, unbiased var = (3 * 0.25^2 + 0.75^2) / 3 = 0.75 / 3 = 0.25, std 0.5
    # -> (1 - 0.75) / 0.5 = 0.5 on trajectory 0's tokens, (0 - 0.75) / 0.5 = -1.5 on trajectory 1's.
    mask = torch.tensor([[False, True, True, True], [False, True, False, False]])
    inp = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.tensor([0, 1]), mask)
    adv = reinforce_pp(inp, Algorithm(eps=0.0)).advantages
    assert torch.allclose(adv, torch.tensor([[0, 0.5, 0.5, 0.5], [0, -1.5, 0, 0]]))


def test_reinforce_pp_baseline_by_hand():
    # groups {t0: 1, t1: 0} and {t2: 1}: centred rewards 0.5, -0.5, 0. Tokens: t0 one, t1 one, t2 two
    # -> [0.5, -0.5, 0, 0]: mean 0, unbiased var (0.25 + 0.25) / 3 = 1/6, std 0.408248
    # -> [1.224745, -1.224745, 0, 0]
    mask = torch.tensor([[True, False], [True, False], [True, True]])
    inp = AdvantageInputs(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]), mask)
    adv = reinforce_pp_baseline(inp, Algorithm(eps=0.0)).advantages
    z = 0.5 / math.sqrt(1 / 6)
    assert torch.allclose(adv, torch.tensor([[z, 0], [-z, 0], [0, 0]]), atol=1e-6)


def test_gae_by_hand_skips_tool_tokens():
    # Row 0: [prompt, policy, policy, tool, policy], values at the policy tokens 0.5, 0.2, 0.8 (99 elsewhere must be
    # ignored), reward 1 at the last policy token, gamma 0.9, lambda 0.5 (gamma * lambda = 0.45):
    #   t=4: delta = 1 + 0.9 * 0 - 0.8 = 0.2                 A = 0.2
    #   t=2: delta = 0 + 0.9 * 0.8 - 0.2 = 0.52              A = 0.52 + 0.45 * 0.2 = 0.61
    #   t=1: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32             A = -0.32 + 0.45 * 0.61 = -0.0455
    # returns = A + V: 0.4545, 0.81, 1.0. Row 1 has no policy token: everything 0.
    mask = torch.tensor([[False, True, True, False, True], [False] * 5])
    values = torch.tensor([[99.0, 0.5, 0.2, 99.0, 0.8], [99.0] * 5])
    inp = AdvantageInputs(torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), torch.tensor([0, 1]), mask, values)
    out = gae(inp, Algorithm(gamma=0.9, lam=0.5, eps=0.0))
    raw = torch.tensor([[0, -0.0455, 0.61, 0, 0.2], [0] * 5])
    assert torch.allclose(out.returns, torch.tensor([[0, 0.4545, 0.81, 0, 1.0], [0] * 5]), atol=1e-6)
    # advantages are whitened over the three policy tokens: mean 0.254833, unbiased std 0.331172
    mean = (-0.0455 + 0.61 + 0.2) / 3
    std = math.sqrt(((-0.0455 - mean) ** 2 + (0.61 - mean) ** 2 + (0.2 - mean) ** 2) / 2)
    assert torch.allclose(out.advantages, (raw - mean) / std * mask, atol=1e-5)
    assert gae.needs_values and not getattr(grpo, "needs_values", False)


def test_gae_with_gamma_lambda_one_is_reward_minus_value():
    # gamma = lambda = 1: A_t = r - V_t for every policy token (the deltas telescope)
    mask = torch.tensor([[False, True, True, True]])
    values = torch.tensor([[0.0, 0.1, 0.4, 0.7]])
    out = gae(AdvantageInputs(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0]), mask, values), Algorithm())
    assert torch.allclose(out.returns, torch.tensor([[0, 1.0, 1.0, 1.0]]))
    assert torch.allclose(out.returns - values * mask, torch.tensor([[0, 0.9, 0.6, 0.3]]))


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_edge_cases_all_equal_rewards_single_sample_empty_rows(name):
    # all-equal rewards in every group, a single-sample group, a row with no policy token: finite, 0 everywhere
    mask = torch.tensor([[False, True, True], [False, True, False], [False, False, False]])

    def inputs(rewards, groups, traj_ids, mask):  # one turn per trajectory, its reward on it, one shared state key
        return AdvantageInputs(rewards, groups, traj_ids, mask, values=torch.zeros(mask.shape),
                               turns=torch.where(mask, 0, -1), turn_rewards=rewards[:, None],
                               turn_keys=torch.zeros(len(rewards), 1, dtype=torch.long))

    inp = inputs(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]), mask)
    out = ADVANTAGES[name](inp, Algorithm()).advantages
    assert torch.isfinite(out).all() and (out[~mask] == 0).all()
    if name not in ("reinforce", "flash_reinforce", "reinforce_pp", "gae"):  # group baselines: equal rewards -> 0
        assert (out == 0).all()
    single = inputs(torch.tensor([0.4]), torch.tensor([0]), torch.tensor([0]), torch.tensor([[False, True]]))
    assert torch.isfinite(ADVANTAGES[name](single, Algorithm()).advantages).all()


def test_whiten_of_a_single_token_is_zero_not_nan():
    assert whiten(torch.tensor([[3.0]]), torch.tensor([[True]]), 1e-6).item() == 0


def test_overlong_reward_shaping_by_hand():
    # L_max 20, L_cache 5 -> the ramp starts at 15 tokens: excess = clamp((len - 15) / 5, 0, 1)
    # lengths 10, 15, 17, 20, 30 -> 0, 0, 0.4, 1, 1; penalty 1 is subtracted from the reward
    cfg = Algorithm(reward_shaping="overlong", overlong_max_tokens=20, overlong_buffer=5)
    shaped = overlong(torch.ones(5), Outcomes(torch.ones(5), torch.tensor([10, 15, 17, 20, 30]), torch.zeros(5)), cfg)
    assert torch.allclose(shaped, torch.tensor([1.0, 1.0, 0.6, 0.0, 0.0]))


def test_dynamic_sampling_filter():
    assert nonzero_std([1.0, 0.0, 1.0]) and not nonzero_std([1.0, 1.0]) and not nonzero_std([0.3])


# ----- registry and config -----
def test_registry_by_name_and_dotted_path():
    assert resolve("grpo", ADVANTAGES) is grpo
    assert resolve("molt_lightning.algorithms.losses.ppo_clip", LOSSES) is ppo_clip
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        resolve("nope", LOSSES)
    with pytest.raises(ValueError, match="cannot import"):
        resolve("molt_lightning.algorithms.losses.nope", LOSSES)


def test_a_users_own_loss_and_estimator_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(textwrap.dedent("""
        import torch
        from molt_lightning.algorithms.advantages import outcome

        @outcome
        def sign(rewards, group_ids, cfg):
            return torch.sign(rewards - 0.5)

        def neg_logp(inp, cfg):
            return -inp.advantages * inp.logprobs, {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    pieces = build(Algorithm(advantage="my_algos.sign", loss="my_algos.neg_logp"))
    assert pieces.advantage is sys.modules["my_algos"].sign and pieces.loss.__name__ == "neg_logp"
    out = pieces.advantage(AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 1]),
                                           torch.ones(2, 1, dtype=torch.bool)), Algorithm())
    assert out.advantages.flatten().tolist() == [1.0, -1.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "nope"}, "unknown loss 'nope'"),
    ({"is_level": "tokens"}, "unknown is_level 'tokens'"),
    ({"aggregation": "mean"}, "unknown aggregation 'mean'"),
    ({"is_form": "bypass"}, "set is_mode: none"),
    ({"aggregation": "seq_mean_token_sum_norm"}, "set loss_norm_tokens"),
    ({"dual_clip": 0.5}, "dual_clip=0.5"),
    ({"clip_low": 1.5}, "clip_low=1.5"),
    ({"is_mode": "mask", "is_floor": 3.0}, "is_floor=3.0"),
    ({"reward_shaping": "overlong"}, "overlong_buffer"),
    ({"group_filter": "zero_std"}, "unknown group_filter"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(Algorithm(**kwargs))


def test_build_declares_what_the_loop_must_provide():
    assert build(Algorithm(advantage="gae")).needs_values and not build(Algorithm()).needs_values
    assert build(Algorithm(kl_coef=0.1)).needs_reference and not build(Algorithm()).needs_reference
    assert build(Algorithm(group_filter="nonzero_std")).group_filter is nonzero_std
    assert build(Algorithm()).group_filter is None
