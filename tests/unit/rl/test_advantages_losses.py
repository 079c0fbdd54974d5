import math

import pytest
import torch

from megatron_tlt.rl.advantages import group_advantages, informative_groups
from megatron_tlt.rl.losses import PPOLossConfig, aggregate, ppo_loss


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r, std_normalize=False)
    assert torch.equal(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    s = group_advantages(r, std_normalize=True, eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(s[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert torch.equal(informative_groups(r), torch.tensor([True, False]))
    with pytest.raises(ValueError, match="num_groups, G>=2"):
        group_advantages(torch.ones(3))


def test_ppo_loss_on_policy_is_minus_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = ppo_loss(logp, logp, adv, mask, PPOLossConfig())
    assert loss.item() == pytest.approx(-2.0)
    assert m["clip_frac"].item() == 0 and m["ratio_mean"].item() == pytest.approx(1.0)


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    cfg = PPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, m = ppo_loss(logp, old, torch.tensor([1.0]), mask, cfg)
    # A>0: min(1.5, 1.28) = 1.28 (clipped); min(0.5, 0.8) = 0.5 (not clipped)
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    loss, _ = ppo_loss(logp, old, torch.tensor([-1.0]), mask, cfg)
    # A<0: min(-1.5, -1.28) = -1.5; min(-0.5, -0.8) = -0.8 (clipped)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_gradient_is_zero_when_clipped():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[2.0]])).requires_grad_()
    loss, _ = ppo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), PPOLossConfig())
    loss.backward()
    assert logp.grad.item() == 0.0


def test_kl_k3_and_aggregation():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, m = ppo_loss(logp, logp, torch.tensor([0.0]), mask, PPOLossConfig(kl_coef=0.5), ref_logp=ref)
    k3 = math.exp(1.0) - 1.0 - 1.0
    assert m["kl_ref"].item() == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.5 * k3 / 2)
    v = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mk = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, mk, "token").item() == pytest.approx(6.0 / 3)
    assert aggregate(v, mk, "sequence").item() == pytest.approx((2.0 + 2.0) / 2)
    assert aggregate(v, mk, "token", normalizer=6.0).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs ref_logp"):
        ppo_loss(logp, logp, torch.tensor([0.0]), mask, PPOLossConfig(kl_coef=0.1))
