"""Tests for tba/loss.py: VarGrad TB values, invariances, the REINFORCE gradient identity,
group handling, GRPO baseline pieces and the beta schedule."""
import math

import pytest
import torch

from common.contracts.ops import group_mean, group_normalised_advantages
from tba.loss import grpo_loss, linear_beta, tb_loss, tb_loss_no_ref

torch.set_num_threads(1)
D = torch.float64


def t(*xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


def test_hand_computed_two_groups():
    # group 0: KL = [1, -2], r/beta = [2, 0] -> logZ = mean([1, 2]) = 1.5, residuals [0.5, -0.5]
    # group 7: KL = [0, 0, -3], r/beta = [0, 2, 2] -> logZ = 7/3, residuals [7/3, 1/3, -8/3]
    seq = t(-1, -4, -3, -3, -6)
    ref = t(-2, -2, -3, -3, -3)
    r = t(1, 0, 0, 1, 1)
    gid = torch.tensor([0, 0, 7, 7, 7])
    loss, stats = tb_loss(seq, ref, r, gid, beta=0.5)
    expected = (0.25 + 0.25 + 49 / 9 + 1 / 9 + 64 / 9) / 5
    assert loss.item() == pytest.approx(expected)
    assert stats["log_z"] == pytest.approx((1.5 + 7 / 3) / 2)
    assert stats["kl"] == pytest.approx(-4 / 5)
    assert stats["reward_mean"] == pytest.approx(3 / 5)
    res = t(0.5, -0.5, 7 / 3, 1 / 3, -8 / 3)
    assert stats["tb_residual_std"] == pytest.approx(res.std(unbiased=False).item())
    # beta as a 0-dim tensor gives the same loss
    loss_t, _ = tb_loss(seq, ref, r, gid, beta=torch.tensor(0.5))
    assert loss_t.item() == pytest.approx(expected)


def test_invariant_to_reward_shift_within_group():
    seq, ref = torch.randn(6, dtype=D), torch.randn(6, dtype=D)
    r = torch.rand(6, dtype=D)
    gid = torch.tensor([3, 1, 3, 1, 3, 1])
    base, _ = tb_loss(seq, ref, r, gid, beta=0.1)
    shifted = r + 5.0 * (gid == 1)  # constant added to every reward of group 1 only
    out, _ = tb_loss(seq, ref, shifted, gid, beta=0.1)
    assert out.item() == pytest.approx(base.item(), rel=1e-9)


def test_zero_loss_when_balanced_per_group():
    ref, r = torch.randn(7, dtype=D), torch.rand(7, dtype=D)
    gid = torch.tensor([0, 2, 1, 0, 2, 2, 1])
    beta = 0.3
    per_group_const = t(1.7, -0.4, 2.2)[gid]
    seq = ref + r / beta + per_group_const  # logpi - logpi_ref - r/beta constant within a group
    loss, stats = tb_loss(seq, ref, r, gid, beta)
    assert loss.item() == pytest.approx(0.0, abs=1e-18)
    assert stats["tb_residual_std"] == pytest.approx(0.0, abs=1e-9)


def _tiny_policy_seq_logp(theta, tokens):
    """Sum over positions of log_softmax(theta[t])[token]: a position-wise categorical policy."""
    logp = torch.log_softmax(theta, dim=-1)  # (L, V)
    return logp.gather(1, tokens.T).T.sum(dim=1)  # tokens (N, L) -> (N,)


def test_gradient_equals_mean_baseline_reinforce():
    L, V, beta = 4, 5, 0.25
    theta = torch.randn(L, V, dtype=D, requires_grad=True)
    ref_theta = torch.randn(L, V, dtype=D)
    gid = torch.tensor([2, 0, 1, 2, 0, 2, 1, 2, 0])  # sizes 3, 2, 4, shuffled
    n = gid.numel()
    tokens = torch.randint(0, V, (n, L))
    r = torch.rand(n, dtype=D)

    seq = _tiny_policy_seq_logp(theta, tokens)
    ref = _tiny_policy_seq_logp(ref_theta, tokens)
    loss, _ = tb_loss(seq, ref, r, gid, beta)
    (grad_tb,) = torch.autograd.grad(loss, theta, retain_graph=True)

    # closed form: -(2 / (N beta)) sum_j adv_j grad logpi_j, group-mean baselines
    with torch.no_grad():
        kl = seq - ref
        adv = (r - group_mean(r, gid)) - beta * (kl - group_mean(kl, gid))
    grads = [torch.autograd.grad(seq[j], theta, retain_graph=True)[0] for j in range(n)]
    expected = -(2.0 / (n * beta)) * sum(a * g for a, g in zip(adv, grads))
    torch.testing.assert_close(grad_tb, expected, rtol=1e-10, atol=1e-12)


def _loop_reference(seq, ref, r, gid, beta):
    total, count = 0.0, 0
    for g in sorted(set(gid.tolist())):
        idx = [i for i in range(len(gid)) if gid[i].item() == g]
        d = [(r[i] / beta - (seq[i] - ref[i])).item() for i in idx]
        log_z = sum(d) / len(d)
        total += sum((log_z - di) ** 2 for di in d)
        count += len(idx)
    return total / count


def test_shuffled_uneven_groups_match_python_loop():
    sizes = {11: 1, 4: 3, 9: 5, 0: 2}
    gid = torch.tensor([g for g, k in sizes.items() for _ in range(k)])
    gid = gid[torch.randperm(gid.numel())]
    n = gid.numel()
    seq, ref, r = torch.randn(n, dtype=D), torch.randn(n, dtype=D), torch.rand(n, dtype=D)
    loss, _ = tb_loss(seq, ref, r, gid, beta=0.7)
    assert loss.item() == pytest.approx(_loop_reference(seq, ref, r, gid, 0.7), rel=1e-10)
    # no-ref variant is the ref = 0 special case
    loss_nr, _ = tb_loss_no_ref(seq, None, r, gid, beta=0.7)
    assert loss_nr.item() == pytest.approx(_loop_reference(seq, torch.zeros_like(seq), r, gid, 0.7), rel=1e-10)


def test_group_mean():
    x = t(1, 2, 3, 10, 5)
    gid = torch.tensor([5, 9, 5, 9, 2])
    torch.testing.assert_close(group_mean(x, gid), t(2, 6, 2, 6, 5))


@pytest.mark.parametrize("beta", [0.0, -1.0, torch.tensor(0.0), float("nan")])
def test_beta_must_be_positive(beta):
    x = torch.zeros(2, dtype=D)
    with pytest.raises(ValueError):
        tb_loss(x, x, x, torch.tensor([0, 0]), beta)


def test_linear_beta():
    assert linear_beta(0, 1.0, 0.1, 100) == pytest.approx(1.0)
    assert linear_beta(50, 1.0, 0.1, 100) == pytest.approx(0.55)
    assert linear_beta(100, 1.0, 0.1, 100) == pytest.approx(0.1)
    assert linear_beta(10_000, 1.0, 0.1, 100) == pytest.approx(0.1)
    assert linear_beta(5, 0.3, 0.3, 0) == pytest.approx(0.3)  # no annealing
    # TBA's TL;DR schedule: towards 0.05 at step 128, cut to it at step 32
    assert linear_beta(31, 1.0, 0.05, 128, cut_step=32) == pytest.approx(1.0 - 0.95 * 31 / 128)
    assert linear_beta(32, 1.0, 0.05, 128, cut_step=32) == pytest.approx(0.05)


def test_group_normalised_advantages():
    r = t(1, 0, 1, 0, 5, 3, 3)
    gid = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    adv = group_normalised_advantages(r, gid)
    # group 0: mean 0.5, population std 0.5 -> +-1; singleton and constant groups -> 0
    expected = t(1, -1, 1, -1, 0, 0, 0) * (0.5 / (0.5 + 1e-6))
    torch.testing.assert_close(adv, expected)


def test_grpo_loss_on_policy_is_minus_mean_advantage():
    B, T = 3, 6
    logp = torch.randn(B, T, dtype=D, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 2:5] = True  # same number of valid tokens per row
    behav = logp.detach().clone()
    behav[~mask] = 123.0  # garbage off-mask must not leak into the loss
    adv = t(1.0, -2.0, 0.5)
    loss, stats = grpo_loss(logp, behav, mask, adv)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    # uneven rows: token-mean over the batch weights each row by its token count
    mask[0, 1] = True
    behav[0, 1] = logp[0, 1].detach()
    loss2, _ = grpo_loss(logp, behav, mask, adv)
    assert loss2.item() == pytest.approx(-(4 * 1.0 + 3 * -2.0 + 3 * 0.5) / 10)


def test_grpo_k3_kl_term():
    logp = torch.log(t(0.5, 0.25)).view(1, 2)
    ref = torch.log(t(0.25, 0.25)).view(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = grpo_loss(logp, logp.clone(), mask, t(0.0), ref_token_logp=ref, kl_coef=0.1)
    k3 = t(0.5 - math.log(0.5) - 1, 0.0)  # exp(d) - d - 1 with d = log(0.25/0.5), 0
    assert loss.item() == pytest.approx(0.1 * k3.mean().item())
    assert stats["kl"] == pytest.approx(k3.mean().item())
