"""Advantage estimators and losses against numbers derived by hand."""

import math

import pytest
import torch

from molt_lightning.algorithms import ADVANTAGES, LOSSES, Algorithm, LossInputs, resolve
from molt_lightning.algorithms.advantages import grpo
from molt_lightning.algorithms.losses import ppo_clip


def test_grpo_advantages_by_hand():
    # group 0: rewards 1,0,0,1 -> mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    # -> advantages +-0.5 / 0.57735 = +-0.866025. Group 1: all equal -> 0. Group 2: a single sample -> 0.
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.3])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = grpo(r, g, Algorithm(eps=0.0 + 1e-12))
    s = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s, 0, 0, 0]), atol=1e-5)
    mean_only = grpo(r, g, Algorithm(scale_by_std=False))
    assert torch.allclose(mean_only, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0]))


def test_ppo_clip_with_truncated_is_by_hand():
    # Three policy tokens (and one padding position that must not count), clip 0.2, TIS cap 2.
    # token  ratio r  A    min(rA, clip(r)A)        pi_prox/pi_engine  weight
    #   1     1.5    +1    min(1.5, 1.2)  =  1.2       3.0             2.0 (capped)
    #   2     0.5    -1    min(-0.5, -0.8) = -0.8      0.5             0.5
    #   3     1.1    +1    min(1.1, 1.1)  =  1.1       1.0             1.0
    # loss = -(2*1.2 + 0.5*(-0.8) + 1*1.1) / 3 = -(2.4 - 0.4 + 1.1) / 3 = -1.0333...
    prox = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    ratio = torch.tensor([[1.5, 0.5, 1.1, 9.0]])
    logp = (prox + ratio.log()).requires_grad_(True)
    engine = prox - torch.tensor([[math.log(3.0), math.log(0.5), 0.0, 0.0]])
    inp = LossInputs(logprobs=logp, prox_logprobs=prox, engine_logprobs=engine,
                     advantages=torch.tensor([[1.0, -1.0, 1.0, 5.0]]), mask=torch.tensor([[True, True, True, False]]))
    loss, m = ppo_clip(inp, Algorithm(clip_low=0.2, clip_high=0.2, tis_cap=2.0))
    assert loss.item() == pytest.approx(-(2.4 - 0.4 + 1.1) / 3, abs=1e-6)
    loss.backward()
    # clipped tokens get no gradient; token 3: d/dlogp of -w r A / 3 = -1 * 1.1 * 1 / 3
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, -1.1 / 3, 0.0]]), atol=1e-6)
    assert m["loss/clip_frac"].item() == pytest.approx(2 / 3)
    assert m["is/ratio_max"].item() == pytest.approx(3.0, rel=1e-5)
    assert m["is/ratio_min"].item() == pytest.approx(0.5, rel=1e-5)
    assert m["is/ratio_mean"].item() == pytest.approx((3 + 0.5 + 1) / 3, rel=1e-5)
    assert m["is/truncated_frac"].item() == pytest.approx(1 / 3)
    # k3 estimate of KL(engine || trainer): mean of r - 1 - log r over r = 3, 0.5, 1
    k3 = ((3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5)) + 0) / 3
    assert m["mismatch/kl"].item() == pytest.approx(k3, rel=1e-5)


def test_on_policy_loss_is_plain_policy_gradient():
    # r = 1 and engine == prox: loss = -mean(A) and d loss / d logp = -A / n
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inp = LossInputs(logp, logp.detach(), logp.detach(), torch.tensor([[0.5, -2.0]]), torch.ones(1, 2, dtype=torch.bool))
    loss, m = ppo_clip(inp, Algorithm())
    loss.backward()
    assert loss.item() == pytest.approx(0.75)
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, 1.0]]))
    assert m["loss/clip_frac"].item() == 0 and m["mismatch/kl"].item() == pytest.approx(0, abs=1e-7)


def test_registry_by_name_and_dotted_path():
    assert resolve("grpo", ADVANTAGES) is grpo
    assert resolve("molt_lightning.algorithms.losses.ppo_clip", LOSSES) is ppo_clip
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        resolve("nope", LOSSES)
    with pytest.raises(ValueError, match="cannot import"):
        resolve("molt_lightning.algorithms.losses.nope", LOSSES)
