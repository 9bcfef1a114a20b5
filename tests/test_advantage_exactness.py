"""Every advantage estimator and normalizer is exact on equal rewards, with continuous (non-dyadic) rewards.

The rule (``algorithms/sampling.py``): a group whose rewards are all equal has zero advantage under every group
baseline; a batch whose rewards are all equal has zero advantage under every batch baseline. In float32 the mean of
n copies of 0.9 is one ulp off, and ``(r - mean) / (std + eps)`` inflated that residue to 0.106 for every member
(the issue's reproduction, kept below). Hypothesis draws batches of groups, some all-equal at a random real value,
and checks exact zeros (``== 0``, not approx) there, plus agreement with a float64 NumPy reference elsewhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_lightning.algorithms import ADVANTAGES, AdvantageInputs, Algorithm
from molt_lightning.algorithms.advantages import group_stats, whiten

GROUP = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # group baselines: an equal group -> 0
BATCH = ("reinforce", "flash_reinforce", "reinforce_pp")  # batch baselines: an equal batch -> 0
TURNS = ("turn_grpo", "gigpo")  # per-turn baselines within the group
CFG = Algorithm()
value = st.floats(-10, 10, allow_nan=False, width=32)


def test_the_issue_reproductions_are_exactly_zero():
    n = 16
    inp = AdvantageInputs(torch.full((n,), 0.9), torch.zeros(n, dtype=torch.long), torch.arange(n),
                          torch.ones(n, 1, dtype=torch.bool))
    assert (ADVANTAGES["grpo"](inp, CFG).advantages == 0).all()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]] * 2, dtype=torch.bool)
    inp = AdvantageInputs(torch.full((8,), 0.7), torch.arange(8) // 4, torch.arange(8), mask)
    assert (ADVANTAGES["reinforce_pp"](inp, CFG).advantages == 0).all()


@st.composite
def batches(draw):
    """Groups of 1-16 trajectories, each all-equal (at a random real value) or continuous; one row per trajectory
    with 1-5 policy tokens of 1-3 turns; per-turn rewards and state keys equal within an all-equal group."""
    rewards, groups, equal, turn_rewards, turn_keys, token_turns = [], [], [], [], [], []
    K, T = 3, 6
    for g in range(draw(st.integers(1, 5))):
        n, same = draw(st.integers(1, 16)), draw(st.booleans())
        shared = (draw(value), [draw(value) for _ in range(K)], draw(st.integers(1, K)))
        for _ in range(n):
            r, steps, k = shared if same else (draw(value), [draw(value) for _ in range(K)], draw(st.integers(1, K)))
            rewards.append(r)
            groups.append(g)
            equal.append(same)
            turn_rewards.append(steps[:k] + [math.nan] * (K - k))
            turn_keys.append(list(range(k)) + [-1] * (K - k))  # state = turn index
            tokens = (sorted(j % k for j in range(draw(st.integers(1, 5)))) if not same
                      else sorted(j % k for j in range(k)))
            token_turns.append(tokens + [-1] * (T - len(tokens)))
    turns = torch.tensor(token_turns)
    return AdvantageInputs(torch.tensor(rewards), torch.tensor(groups), torch.arange(len(rewards)), turns >= 0,
                           turns=turns, turn_rewards=torch.tensor(turn_rewards),
                           turn_keys=torch.tensor(turn_keys)), torch.tensor(equal)


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans())
@pytest.mark.slow
def test_an_all_equal_group_has_exactly_zero_advantage_under_every_group_baseline(drawn, scale):
    inp, equal = drawn
    cfg = Algorithm(scale_by_std=scale)
    for name in GROUP + TURNS:
        adv = ADVANTAGES[name](inp, cfg).advantages
        assert (adv[equal] == 0).all(), (name, adv[equal])
        assert torch.isfinite(adv).all(), name


@settings(max_examples=100, deadline=None)
@given(value, st.integers(1, 64))
def test_an_all_equal_batch_has_exactly_zero_advantage_under_every_batch_baseline(r, n):
    mask = torch.arange(4)[None, :] <= torch.arange(n)[:, None] % 4  # rows of 1-4 policy tokens
    inp = AdvantageInputs(torch.full((n,), r), torch.zeros(n, dtype=torch.long), torch.arange(n), mask)
    for name in BATCH + GROUP:
        assert (ADVANTAGES[name](inp, CFG).advantages == 0).all(), name


def reference(rewards: np.ndarray, groups: np.ndarray, name: str, eps: float) -> np.ndarray:
    """The outcome estimators in float64 NumPy, written from their formulas (one value per trajectory)."""
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        r = rewards[groups == g]
        n, dev = len(r), r - r.mean()
        std = r.std(ddof=1) if n > 1 else 0.0
        out[groups == g] = {"grpo": dev / (std + eps), "dr_grpo": dev, "rloo": dev * n / max(n - 1, 1)}[name]
    return out


@settings(max_examples=150, deadline=None)
@given(batches())
@pytest.mark.slow
def test_outcome_estimators_match_a_float64_reference_on_continuous_rewards(drawn):
    inp, _ = drawn
    r, g = inp.rewards.double().numpy(), inp.group_ids.numpy()
    for name in ("grpo", "dr_grpo", "rloo"):
        got = ADVANTAGES[name](inp, CFG).advantages[:, 0].double().numpy()  # every row has token 0 on the mask
        np.testing.assert_allclose(got, reference(r, g, name, CFG.eps), rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(ADVANTAGES["reinforce"](inp, CFG).advantages[:, 0].double().numpy(), r - r.mean(),
                               rtol=1e-5, atol=1e-5)
    # REINFORCE++: token-weighted whitening of the trajectory reward over the policy tokens
    tokens = np.repeat(r, inp.mask.sum(1).numpy())
    expected = (tokens - tokens.mean()) / ((tokens.std(ddof=1) if len(tokens) > 1 else 0.0) + CFG.eps)
    np.testing.assert_allclose(ADVANTAGES["reinforce_pp"](inp, CFG).advantages[inp.mask].double().numpy(), expected,
                               rtol=1e-4, atol=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.lists(value, min_size=1, max_size=40), value)
def test_statistics_are_shift_invariant_and_zero_on_constants(xs, c):
    x = torch.tensor(xs)
    dev, std, _ = group_stats(x, torch.zeros(len(xs), dtype=torch.long))
    assert (group_stats(torch.full_like(x, c), torch.zeros_like(x, dtype=torch.long))[0] == 0).all()
    mask = torch.ones(len(xs), dtype=torch.bool)
    assert (whiten(torch.full_like(x, c), mask, 1e-6) == 0).all()
    np.testing.assert_allclose(dev.double().numpy(), np.float64(xs) - np.float64(xs).mean(), atol=1e-5)
    if len(xs) > 1:
        np.testing.assert_allclose(float(std[0]), np.float64(xs).std(ddof=1), rtol=1e-5, atol=1e-6)
    shifted = group_stats(x + c, torch.zeros(len(xs), dtype=torch.long))[0]  # x + c is rounded to float32
    np.testing.assert_allclose(shifted.numpy(), dev.numpy(), atol=1e-5)
