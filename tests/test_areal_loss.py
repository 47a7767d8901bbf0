"""AReaL's losses as pure functions: reductions to known objectives, the cap, asymmetric clipping."""
import pytest
import torch

from areal.loss import (batch_normalised_advantages, behaviour_stats, decoupled_ppo_loss, ppo_loss,
                        truncated_is_ppo_loss)


def _inputs(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
    prox = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    behav = prox + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = False  # position 0 never carries a prediction
    mask[0, 1] = True
    return logp, prox, behav, adv, mask


def _grad(loss_fn, logp, *args, **kw):
    lp = logp.detach().clone().requires_grad_()
    loss, stats = loss_fn(lp, *args, **kw)
    loss.backward()
    return loss, lp.grad, stats


def _reference_ppo(logp, old, adv, mask, eps):
    """Textbook clipped PPO, token mean: -min(u A, clip(u) A)."""
    u = (logp - old).exp()
    a = adv[:, None]
    per = -torch.minimum(u * a, u.clamp(1 - eps, 1 + eps) * a)
    return (per * mask).sum() / mask.sum()


def test_prox_equal_behav_is_standard_clipped_ppo():
    logp, prox, _, adv, mask = _inputs()
    ref = _reference_ppo(logp, prox, adv, mask, 0.2)
    ref.backward()
    for fn in (decoupled_ppo_loss, ppo_loss, truncated_is_ppo_loss):
        loss, g, _ = _grad(fn, logp, prox, prox, adv, mask, eps_clip=0.2, behav_imp_weight_cap=5.0)
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(g, logp.grad)
    assert (logp.grad != 0).any()


def test_logp_equal_prox_gives_behaviour_weighted_policy_gradient():
    logp, _, behav, adv, mask = _inputs(seed=1)
    prox = logp.detach()  # first minibatch of a step: u = 1, nothing clipped
    _, g, st = _grad(decoupled_ppo_loss, logp, prox, behav, adv, mask, eps_clip=0.2)
    w = (prox - behav).exp()
    expected = -(w * adv[:, None] * mask) / mask.sum()  # d/dlogp of w * (-A u) at u = 1
    torch.testing.assert_close(g, expected)
    assert st["clip_frac"] == 0.0


def test_capped_tokens_get_no_gradient_but_count_in_the_denominator():
    logp, _, behav, adv, mask = _inputs(seed=2)
    prox = logp.detach()
    behav = prox.clone()
    behav[1, 2] = prox[1, 2] - 3.0  # w = e^3 ~ 20 > cap
    behav[2, 3] = prox[2, 3] - 2.0  # w = e^2 ~ 7.4 > cap
    mask[1, 2] = mask[2, 3] = True
    _, g, st = _grad(decoupled_ppo_loss, logp, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=5.0)
    assert g[1, 2] == 0 and g[2, 3] == 0
    n = mask.sum()  # capped tokens stay in the denominator
    others = mask.clone()
    others[1, 2] = others[2, 3] = False
    torch.testing.assert_close(g[others], (-adv[:, None].expand_as(mask) / n)[others])
    assert st["capped_frac"] == pytest.approx(2 / n.item())
    # without a cap they learn, weighted by w
    _, g_nocap, _ = _grad(decoupled_ppo_loss, logp, prox, behav, adv, mask, eps_clip=0.2)
    torch.testing.assert_close(g_nocap[1, 2], -torch.tensor(3.0).exp() * adv[1] / n)
    # truncated IS: clamped to the cap instead of masked
    _, g_tis, _ = _grad(truncated_is_ppo_loss, logp, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=5.0)
    torch.testing.assert_close(g_tis[1, 2], -5.0 * adv[1] / n)
    torch.testing.assert_close(g_tis[others], g[others])


def test_asymmetric_clipping_with_eps_clip_high():
    mask = torch.ones(2, 2, dtype=torch.bool)
    mask[:, 0] = False
    prox = torch.zeros(2, 2)
    logp = torch.tensor([[0.0, 0.22314], [0.0, -0.28768]])  # u = 1.25 (row 0), 0.75 (row 1)
    adv = torch.tensor([1.0, -1.0])
    _, g_sym, st_sym = _grad(decoupled_ppo_loss, logp, prox, prox, adv, mask, eps_clip=0.2)
    assert g_sym[0, 1] == 0 and g_sym[1, 1] == 0  # both outside [0.8, 1.2] on the side that clips
    assert st_sym["clip_frac"] == 1.0
    _, g_hi, st_hi = _grad(decoupled_ppo_loss, logp, prox, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    assert g_hi[0, 1] < 0 and g_hi[1, 1] == 0  # 1.25 < 1.28 learns; the low side still clips at 0.8
    assert st_hi["clip_frac"] == 0.5


def test_naive_ppo_clips_around_behaviour_not_prox():
    logp, prox, behav, adv, mask = _inputs(seed=3)
    naive, g_naive, _ = _grad(ppo_loss, logp, prox, behav, adv, mask, eps_clip=0.2)
    ref = _reference_ppo(logp, behav, adv, mask, 0.2)
    torch.testing.assert_close(naive, ref)
    dec, _, _ = _grad(decoupled_ppo_loss, logp, prox, behav, adv, mask, eps_clip=0.2)
    assert not torch.allclose(dec, naive)


def test_advantage_shapes_and_errors():
    logp, prox, behav, adv, mask = _inputs()
    a = decoupled_ppo_loss(logp, prox, behav, adv, mask)[0]
    b = decoupled_ppo_loss(logp, prox, behav, adv[:, None].expand_as(logp), mask)[0]
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="advantages"):
        decoupled_ppo_loss(logp, prox, behav, adv[:2], mask)
    with pytest.raises(ValueError, match="prox_logp"):
        decoupled_ppo_loss(logp, prox[:, :2], behav, adv, mask)


def test_padding_garbage_off_mask_is_harmless():
    logp, prox, behav, adv, mask = _inputs(seed=4)
    behav2 = torch.where(mask, behav, torch.full_like(behav, -1e9))  # off-mask garbage
    a, ga, sa = _grad(decoupled_ppo_loss, logp, prox, behav, adv, mask, behav_imp_weight_cap=5.0)
    b, gb, sb = _grad(decoupled_ppo_loss, logp, prox, behav2, adv, mask, behav_imp_weight_cap=5.0)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)
    assert sa == sb and all(torch.isfinite(torch.tensor(v)) for v in sa.values())


def test_behaviour_stats_and_batch_advantages():
    mask = torch.tensor([[False, True, True, True]])
    prox = torch.zeros(1, 4)
    st = behaviour_stats(prox, prox, mask)
    assert st["behav_ess"] == pytest.approx(1.0) and st["gap_max"] == 0 and st["behav_w_mean"] == 1
    behav = torch.tensor([[0.0, 0.0, 0.0, -torch.log(torch.tensor(4.0))]])  # w = 1, 1, 4
    st = behaviour_stats(prox, behav, mask, behav_imp_weight_cap=2.0)
    assert st["behav_ess"] == pytest.approx(36 / (3 * 18))  # (sum w)^2 / (n sum w^2)
    assert st["behav_w_max"] == pytest.approx(4.0) and st["capped_frac"] == pytest.approx(1 / 3)
    assert st["gap_mean"] == pytest.approx(torch.log(torch.tensor(4.0)).item() / 3)
    a = batch_normalised_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]))
    assert a.mean().abs() < 1e-6 and a.pow(2).mean().sqrt() == pytest.approx(1.0, abs=1e-5)
