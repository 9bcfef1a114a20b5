"""Policy losses, off-policy corrections, aggregations, KL/entropy/value terms and the composed objective, against
numbers derived by hand (derivations in the comments); edge cases produce no NaN and the right zero gradients."""

import itertools
import math

import pytest
import torch

from molt_lightning.algorithms import (
    AGGREGATIONS, IS_LEVELS, LOSSES, Algorithm, LossInputs, objective, off_policy,
)
from molt_lightning.algorithms.losses import cispo, gspo, pg, ppo_clip
from molt_lightning.algorithms.objective import k1, k2, k3

ln = math.log


def inputs(ratio, adv, mask=None, logp=None, **kw):
    """LossInputs whose current/old logprob ratio is ``ratio``; ``logprobs`` is a leaf that collects the gradient."""
    ratio, adv = torch.tensor([ratio]), torch.tensor([adv])
    old = torch.tensor([logp]) if logp is not None else torch.full_like(ratio, -1.0)
    logprobs = (old + ratio.log()).requires_grad_(True)
    mask = torch.tensor([mask]) if mask is not None else torch.ones_like(ratio, dtype=torch.bool)
    return LossInputs(logprobs=logprobs, old_logprobs=old, advantages=adv, mask=mask, **kw)


def test_ppo_clip_with_truncated_is_by_hand():
    # Three policy tokens (and one padding position that must not count), clip 0.2, TIS cap 2 (decoupled form).
    # token  ratio r  A    min(rA, clip(r)A)        pi_prox/pi_engine  weight
    #   1     1.5    +1    min(1.5, 1.2)  =  1.2       3.0             2.0 (capped)
    #   2     0.5    -1    min(-0.5, -0.8) = -0.8      0.5             0.5
    #   3     1.1    +1    min(1.1, 1.1)  =  1.1       1.0             1.0
    # loss = -(2*1.2 + 0.5*(-0.8) + 1*1.1) / 3 = -(2.4 - 0.4 + 1.1) / 3 = -1.0333...
    cfg = Algorithm(clip_low=0.2, clip_high=0.2, tis_cap=2.0)
    inp = inputs([1.5, 0.5, 1.1, 9.0], [1.0, -1.0, 1.0, 5.0], [True, True, True, False], [-1.0, -2.0, -0.5, -3.0])
    engine = inp.old_logprobs - torch.tensor([[ln(3.0), ln(0.5), 0.0, 0.0]])
    corr = off_policy(inp.old_logprobs, engine, inp.mask, cfg)
    inp.is_weight = corr.weight
    loss, m = objective(inp, ppo_clip, cfg)
    assert loss.item() == pytest.approx(-(2.4 - 0.4 + 1.1) / 3, abs=1e-6)
    loss.backward()
    # clipped tokens get no gradient; token 3: d/dlogp of -w r A / 3 = -1 * 1.1 * 1 / 3
    assert torch.allclose(inp.logprobs.grad, torch.tensor([[0.0, 0.0, -1.1 / 3, 0.0]]), atol=1e-6)
    assert m["loss/clip_frac"].item() == pytest.approx(2 / 3)
    assert corr.metrics["is/ratio_max"].item() == pytest.approx(3.0, rel=1e-5)
    assert corr.metrics["is/ratio_min"].item() == pytest.approx(0.5, rel=1e-5)
    assert corr.metrics["is/ratio_mean"].item() == pytest.approx((3 + 0.5 + 1) / 3, rel=1e-5)
    assert corr.metrics["is/truncated_frac"].item() == pytest.approx(1 / 3)
    # k3 estimate of KL(engine || trainer): mean of r - 1 - log r over r = 3, 0.5, 1
    k3_mismatch = ((3 - 1 - ln(3)) + (0.5 - 1 - ln(0.5)) + 0) / 3
    assert corr.metrics["mismatch/kl"].item() == pytest.approx(k3_mismatch, rel=1e-5)


def test_clip_higher_is_asymmetric():
    # clip_low 0.2, clip_high 0.28 (DAPO): r = 1.25, A = +1 stays inside [0.8, 1.28]: loss -1.25, grad -1.25 / 2;
    # r = 0.75, A = -1: min(-0.75, -0.8) = -0.8 is the clipped branch: loss 0.8, no gradient.
    inp = inputs([1.25, 0.75], [1.0, -1.0])
    per_token, m = ppo_clip(inp, Algorithm(clip_low=0.2, clip_high=0.28))
    assert torch.allclose(per_token, torch.tensor([[-1.25, 0.8]]))
    per_token.mean().backward()
    assert torch.allclose(inp.logprobs.grad, torch.tensor([[-1.25 / 2, 0.0]]))
    assert m["loss/clip_frac"].item() == 0.5


def test_dual_clip_by_hand():
    # clip 0.2, dual_clip c = 3:
    # r = 5, A = -1: min(-5, -1.2) = -5, dual: max(-5, 3 * -1) = -3 -> loss 3, no gradient (dual-clipped)
    # r = 2, A = -1: min(-2, -1.2) = -2, max(-2, -3) = -2 -> loss 2, d(-rA)/dlogp = r = 2
    # r = 5, A = +1: min(5, 1.2) = 1.2 -> loss -1.2 (dual-clip only acts on A < 0), no gradient
    inp = inputs([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    per_token, m = ppo_clip(inp, Algorithm(dual_clip=3.0))
    assert torch.allclose(per_token, torch.tensor([[3.0, 2.0, -1.2]]))
    per_token.sum().backward()
    assert torch.allclose(inp.logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    assert m["loss/dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["loss/clip_frac"].item() == pytest.approx(1 / 3)  # only the A > 0 token took the clipped branch


def test_gspo_sequence_ratio_by_hand():
    # row 0: token log-ratios 0.1, 0.3 -> mean 0.2 -> s = e^0.2 = 1.221403 > 1.2, A = +1: clipped: -1.2 on each
    #   token, no gradient.
    # row 1: log-ratios 0.05, -0.05, 0 -> s = 1, A = -2: loss 2 on each token; gradient of the row's loss
    #   -s * A w.r.t. each token's logprob is -A * s / 3 = 2/3, and seq_mean_token_mean averages 2 rows -> 1/3.
    r0 = [math.exp(0.1), math.exp(0.3), 1.0]
    r1 = [math.exp(0.05), math.exp(-0.05), 1.0]
    ratio = torch.tensor([r0, r1])
    logprobs = (torch.full((2, 3), -1.0) + ratio.log()).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    inp = LossInputs(logprobs, torch.full((2, 3), -1.0), torch.tensor([[1.0] * 3, [-2.0] * 3]), mask)
    cfg = Algorithm(aggregation="seq_mean_token_mean")
    per_token, m = gspo(inp, cfg)
    assert torch.allclose(per_token[mask], torch.tensor([-1.2, -1.2, 2.0, 2.0, 2.0]), atol=1e-6)
    loss, _ = objective(inp, gspo, cfg)
    assert loss.item() == pytest.approx((-1.2 + 2.0) / 2, abs=1e-6)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]), atol=1e-6)
    assert m["loss/clip_frac"].item() == pytest.approx(2 / 5)  # both tokens of row 0


def test_cispo_by_hand():
    # clip_low 1 (no lower bound, as MiniMax-M1), clip_high 0.2: w = sg(clamp(r, 0, 1.2))
    # r = 1.5, 0.5, 1.0 -> w = 1.2, 0.5, 1.0; A = 1, -1, 2; log pi = -1, -2, -0.5
    # per-token -w A log pi = 1.2, -1.0, 1.0; token mean 1.2 / 3 = 0.4
    # gradient -w A / 3 = -0.4, 0.5 / 3, -2 / 3: the clipped token keeps a gradient (the point of CISPO)
    inp = inputs([1.5, 0.5, 1.0], [1.0, -1.0, 2.0], logp=[-1.0 - ln(1.5), -2.0 - ln(0.5), -0.5])
    cfg = Algorithm(clip_low=1.0, clip_high=0.2)
    loss, m = objective(inp, cispo, cfg)
    assert loss.item() == pytest.approx(0.4, abs=1e-6)
    loss.backward()
    assert torch.allclose(inp.logprobs.grad, torch.tensor([[-0.4, 0.5 / 3, -2 / 3]]), atol=1e-6)
    assert m["loss/clip_frac"].item() == pytest.approx(1 / 3)


def test_pg_is_plain_policy_gradient():
    # loss = -mean(A) and d loss / d logp = -A / n, whatever the old logprobs say
    inp = inputs([3.0, 0.1], [0.5, -2.0])
    loss, m = objective(inp, pg, Algorithm())
    loss.backward()
    assert loss.item() == pytest.approx(0.75)
    assert torch.allclose(inp.logprobs.grad, torch.tensor([[-0.25, 1.0]]))
    assert m["loss/clip_frac"].item() == 0


def test_on_policy_ppo_equals_pg():
    # r = 1 and engine == prox: ppo_clip is plain policy gradient and the IS weight is 1
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    corr = off_policy(logp, logp.detach(), mask, Algorithm())
    inp = LossInputs(logp, corr.old_logprobs, torch.tensor([[0.5, -2.0]]), mask, is_weight=corr.weight)
    loss, _ = objective(inp, ppo_clip, Algorithm())
    loss.backward()
    assert loss.item() == pytest.approx(0.75) and torch.allclose(logp.grad, torch.tensor([[-0.25, 1.0]]))
    assert corr.metrics["mismatch/kl"].item() == pytest.approx(0, abs=1e-7)


def test_aggregations_by_hand():
    # per-token x (NaN/inf at padding must not leak) and three rows: 3 tokens, 1 token, none.
    #   token_mean              (1 + 2 + 3 + 4) / 4               = 2.5
    #   seq_mean_token_mean     (mean(1,2,3) + 4) / 2 = (2 + 4) / 2 = 3
    #   seq_mean_token_sum      (6 + 4) / 2                        = 5
    #   seq_mean_token_sum_norm (6 + 4) / (2 rows * 10 tokens)     = 0.5
    x = torch.tensor([[1.0, 2.0, 3.0, math.nan], [4.0, math.inf, 0, 0], [math.nan, 0, 0, 0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])
    cfg = Algorithm(loss_norm_tokens=10)
    got = {name: fn(x, mask, cfg).item() for name, fn in AGGREGATIONS.items()}
    assert got == {"token_mean": 2.5, "seq_mean_token_mean": 3.0, "seq_mean_token_sum": 5.0,
                   "seq_mean_token_sum_norm": 0.5}


def test_is_levels_and_modes_by_hand():
    # row 0: token ratios 2, 0.25, 4 (product 2, geometric mean 2^(1/3) = 1.259921); row 1: 0.5. band [0.4, 1.5]
    #   level      mode      weights                            clamped / zeroed
    #   token      truncate  1.5, 0.25, 1.5 | 0.5              2/4 truncated
    #   token      clip      1.5, 0.4,  1.5 | 0.5              3/4 truncated
    #   token      mask      0,   0,    0   | 0.5              3/4 masked
    #   sequence   truncate  1.5, 1.5,  1.5 | 0.5              3/4
    #   sequence   mask      0,   0,    0   | 0.5              3/4 masked
    #   geometric  mask      1.259921 x 3   | 0.5              nothing masked
    g = 2 ** (1 / 3)
    expected = {
        ("token", "truncate"): ([1.5, 0.25, 1.5, 0.5], 0.5, 0.0),
        ("token", "clip"): ([1.5, 0.4, 1.5, 0.5], 0.75, 0.0),
        ("token", "mask"): ([0, 0, 0, 0.5], 0.0, 0.75),
        ("token", "none"): ([1, 1, 1, 1], 0.0, 0.0),
        ("sequence", "truncate"): ([1.5, 1.5, 1.5, 0.5], 0.75, 0.0),
        ("sequence", "clip"): ([1.5, 1.5, 1.5, 0.5], 0.75, 0.0),
        ("sequence", "mask"): ([0, 0, 0, 0.5], 0.0, 0.75),
        ("geometric", "truncate"): ([g, g, g, 0.5], 0.0, 0.0),
        ("geometric", "clip"): ([g, g, g, 0.5], 0.0, 0.0),
        ("geometric", "mask"): ([g, g, g, 0.5], 0.0, 0.0),
    }
    prox = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, 0.0, 0.0, 0.0]])
    engine = prox - torch.tensor([[ln(2), ln(0.25), ln(4), 0.0], [ln(0.5), 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    for (level, mode), (weights, truncated, masked) in expected.items():
        corr = off_policy(prox, engine, mask, Algorithm(is_level=level, is_mode=mode, tis_cap=1.5, is_floor=0.4))
        assert torch.allclose(corr.weight[mask], torch.tensor(weights, dtype=torch.float), atol=1e-6), (level, mode)
        assert (corr.weight[~mask] == 0).all()
        assert corr.metrics["is/truncated_frac"].item() == pytest.approx(truncated), (level, mode)
        assert corr.metrics["is/masked_frac"].item() == pytest.approx(masked), (level, mode)
        assert torch.equal(corr.old_logprobs, prox)  # decoupled: PPO's old policy is the trainer's
    m = off_policy(prox, engine, mask, Algorithm()).metrics  # token level: 2, 0.25, 4, 0.5
    assert m["is/ratio_min"].item() == pytest.approx(0.25) and m["is/ratio_max"].item() == pytest.approx(4.0)
    assert m["is/ratio_mean"].item() == pytest.approx((2 + 0.25 + 4 + 0.5) / 4)
    assert m["mismatch/abs_logprob_diff"].item() == pytest.approx((ln(2) + ln(4) * 2 + ln(2)) / 4)


def test_bypass_form_takes_the_engine_as_the_old_policy():
    prox, engine = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    corr = off_policy(prox, engine, torch.ones(1, 2, dtype=torch.bool), Algorithm(is_form="bypass", is_mode="none"))
    assert torch.equal(corr.old_logprobs, engine) and (corr.weight == 1).all()
    # the gap is still measured: prox - engine = +0.5, -1.0
    assert corr.metrics["is/ratio_max"].item() == pytest.approx(math.exp(0.5))
    assert corr.metrics["is/ratio_min"].item() == pytest.approx(math.exp(-1.0))


def test_kl_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = log 0.5 = -0.693147
    #   k1 = -log r = 0.693147,  k2 = (log r)^2 / 2 = 0.240227,  k3 = r - 1 - log r = 0.5 - 1 + 0.693147 = 0.193147
    # gradients w.r.t. log pi: k1 -> 1, k2 -> -(log r) = 0.693147, k3 -> 1 - r = 0.5
    for fn, value, grad in [(k1, ln(2), 1.0), (k2, ln(2) ** 2 / 2, ln(2)), (k3, 0.5 - 1 + ln(2), 0.5)]:
        logp = torch.tensor([[ln(0.5)]], requires_grad=True)
        kl = fn(logp, torch.tensor([[ln(0.25)]]))
        kl.sum().backward()
        assert kl.item() == pytest.approx(value, rel=1e-5) and logp.grad.item() == pytest.approx(grad, rel=1e-5)


def test_objective_adds_kl_entropy_and_value_terms_by_hand():
    # Two tokens, pg loss with A = 1, -1 (policy term 0), kl_coef 0.1 (k3 = 0.193147 on token 0, 0 on token 1),
    # entropy_coef 0.01 with entropies 1.0, 0.5, value_coef 0.5 with V = 0.2, 0.6 and returns 1, 0:
    #   loss/kl      = 0.1 * (0.193147 + 0) / 2          = 0.00965736
    #   loss/entropy = -0.01 * (1.0 + 0.5) / 2           = -0.0075
    #   loss/value   = 0.5 * 0.5 * (0.8^2 + 0.6^2) / 2   = 0.125
    logp = torch.tensor([[ln(0.5), -1.0]], requires_grad=True)
    entropy = torch.tensor([[1.0, 0.5]], requires_grad=True)
    values = torch.tensor([[0.2, 0.6]], requires_grad=True)
    inp = LossInputs(logp, logp.detach(), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool),
                     entropy=entropy, ref_logprobs=torch.tensor([[ln(0.25), -1.0]]), values=values,
                     returns=torch.tensor([[1.0, 0.0]]))
    loss, m = objective(inp, pg, Algorithm(kl_coef=0.1, entropy_coef=0.01, value_coef=0.5))
    assert m["loss/policy"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["loss/kl"].item() == pytest.approx(0.1 * (0.5 - 1 + ln(2)) / 2, rel=1e-5)
    assert m["loss/entropy"].item() == pytest.approx(-0.0075)
    assert m["loss/value"].item() == pytest.approx(0.125)
    assert loss.item() == pytest.approx(m["loss/kl"].item() - 0.0075 + 0.125, rel=1e-5)
    assert m["kl/ref"].item() == pytest.approx((0.5 - 1 + ln(2)) / 2, rel=1e-5)
    loss.backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.005, -0.005]]))  # -coef / n
    assert torch.allclose(values.grad, torch.tensor([[-0.2, 0.15]]))  # 0.5 * (V - R) / 2


# ----- edge cases: every loss x aggregation x correction -----
CASES = list(itertools.product(sorted(LOSSES), sorted(AGGREGATIONS), sorted(IS_LEVELS), ["truncate", "mask", "clip"]))


def edge_batch():
    """Row 0: normal; row 1: extreme ratios (log-ratio +-50 to the old policy, engine logprobs far off);
    row 2: fully masked (empty response). Padding positions hold garbage."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -60.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -2.0], [-50.1, -10.0, -3.0], [-1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.0, -0.7, -9.0], [-70.0, -0.01, -3.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [False, False, False]])
    adv = torch.tensor([[1.0, 1.0, 7.0], [-1.0, -1.0, 7.0], [3.0, 3.0, 3.0]])
    return logp, old, engine, mask, adv


@pytest.mark.parametrize("loss_name, agg, level, mode", CASES)
def test_edge_cases_no_nan_and_zero_gradients_off_the_mask(loss_name, agg, level, mode):
    logp, old, engine, mask, adv = edge_batch()
    cfg = Algorithm(loss=loss_name, aggregation=agg, is_level=level, is_mode=mode, loss_norm_tokens=4, dual_clip=3.0,
                    is_floor=0.5)
    corr = off_policy(old, engine, mask, cfg)
    inp = LossInputs(logp, old, adv, mask, is_weight=corr.weight, entropy=torch.zeros(3, 3))
    loss, m = objective(inp, LOSSES[loss_name], cfg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()  # padding and the empty row get no gradient
    assert all(torch.isfinite(v) for v in {**m, **corr.metrics}.values())
    assert all(v.dim() == 0 and not v.requires_grad for v in {**m, **corr.metrics}.values())
    counted = corr.metrics["is/truncated_frac"] + corr.metrics["is/masked_frac"]
    assert counted > 0  # the extreme engine gaps were clamped or masked, and counted


def test_extreme_ppo_ratio_is_clipped_with_zero_gradient_and_counted():
    # log-ratio +50 with A > 0 (clipped) and -50 with A < 0 (clipped): exp stays finite, both gradients are 0
    # (one token per row, so GSPO's sequence ratio is the token's)
    logp = torch.tensor([[0.0], [-100.0]], requires_grad=True)
    inp = LossInputs(logp, torch.tensor([[-50.0], [-50.0]]), torch.tensor([[1.0], [-1.0]]), torch.ones(2, 1).bool())
    for fn in (ppo_clip, gspo):
        per_token, m = fn(inp, Algorithm())
        per_token.sum().backward()
        assert torch.isfinite(per_token).all() and (logp.grad == 0).all() and m["loss/clip_frac"] == 1
        logp.grad = None


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_fully_masked_batch_gives_zero_loss_and_zero_gradient(loss_name):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.zeros(1, 2, dtype=torch.bool)
    cfg = Algorithm()
    corr = off_policy(logp, logp.detach() - 1, mask, cfg)
    inp = LossInputs(logp, corr.old_logprobs, torch.ones(1, 2), mask, is_weight=corr.weight)
    loss, m = objective(inp, LOSSES[loss_name], cfg)
    loss.backward()
    assert loss.item() == 0 and (logp.grad == 0).all()
    assert corr.metrics["is/ratio_min"].item() == 1.0 and corr.metrics["is/truncated_frac"].item() == 0
