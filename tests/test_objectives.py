"""The objectives of the objectives issue as pure functions, against hand-derived numbers and, where a peer implements
one, against that implementation's formula written out independently: FlashREINFORCE and its binary-KL trust region,
the length penalties, turn-level credit (turn_grpo, GiGPO) and on-policy distillation's advantage."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.special import rel_entr

from molt_lightning.algorithms import ADVANTAGES, LOSSES, REWARD_SHAPERS, Algorithm, LossInputs, build, objective
from molt_lightning.algorithms.advantages import AdvantageInputs, distill, turn_returns
from molt_lightning.algorithms.losses import binary_kl
from molt_lightning.trajectory import ConsistencyError, Kind, Outcomes, Span, Status, Trajectory, collate

FLASH = Algorithm(advantage="flash_reinforce", loss="flash_reinforce", aggregation="seq_mean_token_mean",
                  is_form="bypass", is_mode="none", binary_kl_delta=3e-3)


# ----- FlashREINFORCE -----
def test_binary_kl_matches_scipy():
    p, q = torch.tensor([0.9, 0.5, 0.01, 0.7]), torch.tensor([0.5, 0.5, 0.2, 0.69])
    want = rel_entr(p.numpy(), q.numpy()) + rel_entr(1 - p.numpy(), 1 - q.numpy())
    assert torch.allclose(binary_kl(p.log(), q.log()), torch.tensor(want, dtype=torch.float32), atol=1e-6)


def test_flash_reinforce_loss_by_hand():
    # row 0: behavior = current = 0.5 on both tokens: KL 0, ratio 1, admitted: loss -A log 0.5 per token.
    # row 1: behavior 0.9, current 0.5: KL(Bern(.9)||Bern(.5)) = .9 ln 1.8 + .1 ln .2 = 0.368 > delta: no gradient.
    current = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]])).requires_grad_()
    behavior = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.9]]))
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    per_token, metrics = LOSSES["flash_reinforce"](LossInputs(current, behavior, adv, mask), FLASH)
    assert torch.allclose(per_token, torch.tensor([[math.log(2), math.log(2)], [0.0, 0.0]]), atol=1e-6)
    assert metrics["loss/clip_frac"] == pytest.approx(0.5)  # one of two rows (half the tokens) outside the region
    assert metrics["loss/binary_kl"] == pytest.approx((0 + 0.9 * math.log(1.8) + 0.1 * math.log(0.2)) / 2, abs=1e-5)
    per_token.sum().backward()
    assert torch.allclose(current.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))  # d(-A log pi)/d log pi = -A


def reference_flash_reinforce(log_probs, behavior_log_probs, rewards, mask, delta):
    """The authors' loss (yifanzhang-pro/FlashREINFORCE, flashreinforce/loss.py), written out from its description:
    one trajectory per row, batch-mean baseline, sampled-token binary KL per row, sample-mean aggregation."""
    with torch.no_grad():
        adv = rewards - rewards.mean()
        p = behavior_log_probs.exp().clamp(1e-6, 1 - 1e-6)
        q = log_probs.detach().exp().clamp(1e-6, 1 - 1e-6)
        kl = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
        lengths = mask.sum(-1)
        admitted = (kl * mask).sum(-1) / lengths <= delta
        ratio = torch.exp(log_probs.detach() - behavior_log_probs) * admitted[:, None]
        weights = ratio * adv[:, None]
    return -((weights * log_probs * mask).sum(-1) / lengths).mean()


def test_flash_reinforce_equals_the_reference_formula_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        N, T = 6, 9
        behavior = -torch.rand(N, T, generator=g) * 2
        current = (behavior + torch.randn(N, T, generator=g) * (0.01 if trial % 2 else 0.2)).clamp(max=-1e-3)
        current.requires_grad_()
        mask = torch.rand(N, T, generator=g) < 0.8
        mask[:, 0] = True
        rewards = torch.randint(0, 2, (N,), generator=g).float()
        fns = build(FLASH)
        adv = fns.advantage(AdvantageInputs(rewards, torch.arange(N), torch.arange(N), mask), FLASH).advantages
        ours, _ = objective(LossInputs(current, behavior, adv, mask), fns.loss, FLASH)
        (grad_ours,) = torch.autograd.grad(ours, current)
        theirs = reference_flash_reinforce(current, behavior, rewards, mask.float(), FLASH.binary_kl_delta)
        (grad_theirs,) = torch.autograd.grad(theirs, current)
        assert torch.allclose(ours, theirs, atol=1e-6)
        assert torch.allclose(grad_ours, grad_theirs, atol=1e-7)


def test_flash_reinforce_needs_the_bypass_form():
    with pytest.raises(ValueError, match="is_form: bypass"):
        build(Algorithm(loss="flash_reinforce"))


# ----- length penalties -----
def outcomes(lengths, turns, truncated):
    n = len(lengths)
    return Outcomes(torch.ones(n), torch.tensor(lengths), torch.zeros(n, dtype=torch.long),
                    torch.tensor(truncated), torch.tensor(turns))


def test_stop_properly_and_linear_penalties_by_hand():
    out = outcomes([10, 40, 20], [1, 3, 2], [False, True, False])
    cfg = Algorithm(truncation_penalty=0.5, token_penalty=0.01, turn_penalty=0.1)
    rewards = torch.tensor([1.0, 1.0, 0.0])
    assert torch.allclose(REWARD_SHAPERS["stop_properly"](rewards, out, cfg), torch.tensor([1.0, 0.5, 0.0]))
    assert torch.allclose(REWARD_SHAPERS["length"](rewards, out, cfg),
                          torch.tensor([1 - 0.1 - 0.1, 1 - 0.4 - 0.3, 0 - 0.2 - 0.2]))


def test_shapers_chain_in_order_with_overlong():
    cfg = Algorithm(reward_shaping=["overlong", "stop_properly", "length"], overlong_max_tokens=30, overlong_buffer=10,
                    truncation_penalty=1.0, token_penalty=0.001)
    out = outcomes([10, 25, 40], [1, 1, 1], [False, False, True])
    shaped = build(cfg).shape_rewards(torch.ones(3), out, cfg)
    # overlong: 0, (25-20)/10 = 0.5, 1 (capped); stop_properly: -1 on the third; length: -0.001 per token
    assert torch.allclose(shaped, torch.tensor([1 - 0.010, 1 - 0.5 - 0.025, 1 - 1 - 1 - 0.040]))
    assert build(Algorithm()).shape_rewards(torch.ones(3), out, Algorithm()).eq(1).all()  # "none": unchanged
    with pytest.raises(ValueError, match="unknown reward_shaping 'overlng'"):
        build(Algorithm(reward_shaping=["overlng"]))


# ----- turn-level credit -----
def turn_inputs(rewards, groups, turn_rewards, turn_keys=None, token_turns=None):
    """One row per trajectory whose policy tokens are ``token_turns`` (each the turn it belongs to; -1 context)."""
    turn_rewards = torch.tensor(turn_rewards)
    M, K = turn_rewards.shape
    token_turns = torch.tensor(token_turns if token_turns is not None else [[-1] + list(range(K))] * M)
    return AdvantageInputs(torch.tensor(rewards), torch.tensor(groups), torch.arange(M), token_turns >= 0,
                           turns=token_turns, turn_rewards=turn_rewards,
                           turn_keys=torch.tensor(turn_keys) if turn_keys is not None else None)


def test_turn_returns_by_hand():
    nan = math.nan
    got = turn_returns(torch.tensor([[1.0, 2.0, 4.0], [0.0, 3.0, nan]]), 0.5)
    want = torch.tensor([[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4], [1.5, 3, nan]])
    assert torch.allclose(got, want, equal_nan=True)


def test_turn_grpo_by_hand():
    # one group of two 2-turn trajectories and a 3-turn one; gamma 0.5; mean-only baseline per turn index.
    nan = math.nan
    inp = turn_inputs([0, 0, 0], [0, 0, 0], [[1.0, 2.0, nan], [0.0, 0.0, nan], [0.0, 1.0, 2.0]],
                      token_turns=[[-1, 0, 0, -1, 1], [-1, 0, -1, 1, 1], [-1, 0, 1, -1, 2]])
    cfg = Algorithm(advantage="turn_grpo", turn_gamma=0.5, scale_by_std=False)
    # returns: [1 + .5 * 2, 2] = [2, 2]; [0, 0]; [0 + .5 * (1 + .5 * 2), 1 + .5 * 2, 2] = [1, 2, 2]
    # turn 0: [2, 0, 1], mean 1; turn 1: [2, 0, 2], mean 4/3; turn 2: one trajectory has it (advantage 0)
    a = ADVANTAGES["turn_grpo"](inp, cfg).advantages
    t0, t1 = [1.0, -1.0, 0.0], [2 - 4 / 3, -4 / 3, 2 - 4 / 3]
    want = torch.tensor([[0, t0[0], t0[0], 0, t1[0]], [0, t0[1], 0, t1[1], t1[1]], [0, t0[2], t1[2], 0, 0.0]])
    assert torch.allclose(a, want, atol=1e-6)
    std = ADVANTAGES["turn_grpo"](inp, Algorithm(turn_gamma=0.5)).advantages  # scale_by_std: / sample std of turn
    s = torch.tensor([2.0, 0.0, 2.0]).std()
    assert std[0, 4] == pytest.approx(float((2 - 4 / 3) / (s + 1e-6)), rel=1e-5)


def test_turn_grpo_puts_no_credit_on_a_turn_that_decides_nothing():
    # the two-turn task of the benchmark: only turn 0 is scored; turn 1's tokens get 0, turn 0's GRPO's advantage
    inp = turn_inputs([1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0], [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    turn = ADVANTAGES["turn_grpo"](inp, Algorithm()).advantages
    traj = ADVANTAGES["grpo"](inp, Algorithm()).advantages
    assert (turn[:, 2] == 0).all() and (traj[:, 2] != 0).all()
    assert torch.allclose(turn[:, 1], traj[:, 1])


def reference_gigpo(total_rewards, group_ids, step_rewards, anchors, gamma, omega, eps=1e-6):
    """GiGPO (Feng et al. 2025) as verl-agent computes it, written out with plain Python loops: episode advantage
    = GRPO of the total reward within the prompt's group; step advantage = discounted step return normalized within
    the steps of the group that share an anchor state (mean and unbiased std); a singleton gets 0 here (our group
    convention)."""
    M = len(total_rewards)
    episode = []
    for i in range(M):
        g = [total_rewards[j] for j in range(M) if group_ids[j] == group_ids[i]]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1)) if len(g) > 1 else 0.0
        episode.append((total_rewards[i] - mean) / (std + eps))
    returns = []
    for rs in step_rewards:
        out, running = [], 0.0
        for r in reversed(rs):
            running = r + gamma * running
            out.insert(0, running)
        returns.append(out)
    adv = []
    for i in range(M):
        row = []
        for k, key in enumerate(anchors[i]):
            peers = [returns[j][kk] for j in range(M) for kk, kj in enumerate(anchors[j])
                     if group_ids[j] == group_ids[i] and kj == key]
            if len(peers) == 1:
                step = 0.0
            else:
                mean = sum(peers) / len(peers)
                std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (len(peers) - 1))
                step = (returns[i][k] - mean) / (std + eps)
            row.append(episode[i] + omega * step)
        adv.append(row)
    return adv


def test_gigpo_equals_the_reference_formula_on_random_inputs():
    import random

    rng = random.Random(0)
    for _ in range(20):
        M, K = 8, 4
        groups = [rng.randrange(2) for _ in range(M)]
        lengths = [rng.randint(1, K) for _ in range(M)]
        step_rewards = [[rng.choice([0.0, 0.0, 1.0, -0.5]) for _ in range(n)] for n in lengths]
        anchors = [[f"s{rng.randrange(3)}" for _ in range(n)] for n in lengths]  # states revisited across runs
        totals = [sum(r) for r in step_rewards]
        gamma, omega = rng.choice([1.0, 0.95, 0.5]), rng.choice([1.0, 0.5])
        want = reference_gigpo(totals, groups, step_rewards, anchors, gamma, omega)
        keys = {}
        turn_rewards = [r + [math.nan] * (K - len(r)) for r in step_rewards]
        turn_keys = [[keys.setdefault(a, len(keys)) for a in row] + [-1] * (K - len(row)) for row in anchors]
        token_turns = [[-1] + [k for k in range(n) for _ in range(2)] + [-1] * (2 * (K - n)) for n in lengths]
        inp = turn_inputs(totals, groups, turn_rewards, turn_keys, token_turns)
        got = ADVANTAGES["gigpo"](inp, Algorithm(turn_gamma=gamma, step_coef=omega)).advantages
        for i in range(M):
            for k in range(lengths[i]):
                assert got[i, 1 + 2 * k] == pytest.approx(want[i][k], abs=1e-4)
                assert got[i, 2 + 2 * k] == pytest.approx(want[i][k], abs=1e-4)


def test_gigpo_without_state_keys_is_an_error_naming_the_fix():
    inp = turn_inputs([1.0, 0.0], [0, 0], [[1.0], [0.0]], turn_keys=[[-1], [-1]])
    with pytest.raises(ValueError, match="turn_keys"):
        ADVANTAGES["gigpo"](inp, Algorithm())


def test_outcomes_place_an_outcome_reward_on_the_last_turn_and_number_the_keys():
    def traj(turns, reward, **kw):
        spans = [Span.context(Kind.PROMPT, [1])]
        for k in range(turns):
            spans += [Span.policy([2, 3], [-0.1, -0.2], [0, 0], turn=k), Span.context(Kind.ENV, [4])]
        return Trajectory(0, 0, [spans], reward=reward, turns=turns, **kw)

    batch = collate([traj(3, 1.0), traj(2, 0.5, turn_rewards=[0.25, 0.25], turn_keys=["a", "b"]),
                     traj(1, 0.0, turn_keys=["b"], status=Status.TRUNCATED)], pad_id=0)
    out = batch.outcomes
    assert torch.allclose(out.turn_rewards,
                          torch.tensor([[0, 0, 1.0], [0.25, 0.25, math.nan], [0, math.nan, math.nan]]),
                          equal_nan=True)
    assert out.turn_keys.tolist() == [[-1, -1, -1], [0, 1, -1], [1, -1, -1]]
    assert out.turns.tolist() == [3, 2, 1] and out.truncated.tolist() == [False, False, True]
    assert batch.turns[0].tolist() == [-1, 0, 0, -1, 1, 1, -1, 2, 2, -1]
    with pytest.raises(ConsistencyError, match="2 per-turn values for 3 turns"):
        collate([traj(3, 1.0, turn_rewards=[1.0, 0.0])], pad_id=0)


# ----- on-policy distillation -----
def test_distill_advantage_by_hand():
    student = torch.log(torch.tensor([[0.5, 0.5, 0.2]]))
    teacher = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    got = distill(student, teacher, mask, Algorithm(distill_coef=0.5))
    assert torch.allclose(got, torch.tensor([[0.5 * math.log(1.8), 0.0, 0.0]]), atol=1e-6)


def test_distillation_needs_a_teacher_and_a_coefficient():
    from molt_lightning import AsyncRLModule
    from molt_lightning.tasks import arithmetic

    with pytest.raises(ValueError, match="model.teacher"):
        AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks, algo=Algorithm(distill_coef=1.0))
    with pytest.raises(ValueError, match="distill_coef"):
        AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks,
                      teacher="molt_lightning.models.tiny.arithmetic_policy")


def test_per_turn_lists_of_the_wrong_shape_fail_the_run_with_the_reason():
    from molt_lightning.agents.client import AgentResult
    from molt_lightning.rollout.agent_run import _check_turns

    assert _check_turns(AgentResult(1.0, turn_rewards=[0.0, 1.0], turn_keys=["a", ("b", 1)]), 2) is None
    assert "turn_rewards has 1 entries for 2 turns" in _check_turns(AgentResult(1.0, turn_rewards=[1.0]), 2)
    assert "turn_keys has 3 entries for 2 turns" in _check_turns(AgentResult(1.0, turn_keys=[1, 2, 3]), 2)
    assert "non-finite" in _check_turns(AgentResult(1.0, turn_rewards=[math.nan, 1.0]), 2)
    assert "hashable" in _check_turns(AgentResult(1.0, turn_keys=[["a"], ["b"]]), 2)
