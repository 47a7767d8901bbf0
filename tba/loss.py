"""Losses for the trainer process: TBA's VarGrad trajectory balance and the GRPO baseline.

Runs inside the trainer (the single process that owns the optimizer); every function here is a
pure function of tensors, so generators and tests can call it too.

Trajectory balance (TBA, Bartoldson et al. 2025). The target is
    pi*(y|x) ∝ pi_ref(y|x) exp(r(x,y) / beta).
For one prompt x with K responses y_j, VarGrad replaces the learned log-partition by its
per-group estimate (detached, no gradient):
    logZ_hat(x) = mean_j [ r_j/beta - (logpi(y_j|x) - logpi_ref(y_j|x)) ]
    L = mean_{x,j} ( logZ_hat(x) + logpi(y_j|x) - logpi_ref(y_j|x) - r_j/beta )^2
logpi is the SUM of token log-probs (no length normalisation). No importance weights and no
clipping: TB is an off-policy objective, which is what lets TBA learn from stale samples.

Gradient identity (tested in tests/test_tba_loss.py). With N responses in the batch,
KL_j = logpi_j - logpi_ref_j and group means taken within each prompt's group,
    grad L = -(2 / (N beta)) * sum_j adv_j * grad logpi_j,
    adv_j  = (r_j - mean_g r) - beta * (KL_j - mean_g KL),
i.e. mean-baseline REINFORCE on the KL-regularised reward, scaled by 2/(N beta).

GRPO baseline (synchronous): PPO-clip on per-token ratios exp(logp - behav_logp) with
group-normalised advantages (r - mean_g r) / (std_g r + eps), token-mean over the batch, plus an
optional k3 KL estimator exp(ref - logp) - (ref - logp) - 1 weighted by kl_coef; its masked
variants (IcePop's token mask, a sequence-level geometric mask) leave out tokens or responses whose
pi_trainer / pi_sampler leaves [1/b, b]: corrections for the sampler-trainer mismatch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from common.contracts.mismatch import in_band, seq_mean
from common.contracts.ops import group_index, group_sums


def _check_beta(beta) -> Tensor | float:
    b = float(beta)  # works for floats and 0-dim tensors; rejects anything bigger
    if not b > 0:  # also catches NaN
        raise ValueError(f"tb_loss: beta must be > 0, got {b}")
    return beta


def tb_loss(seq_logp: Tensor, ref_seq_logp: Tensor, reward: Tensor, group_id: Tensor,
            beta: float | Tensor) -> tuple[Tensor, dict]:
    """VarGrad trajectory-balance loss over N responses (all 1-D, length N).

    seq_logp: summed policy log-prob of each response (carries the gradient);
    ref_seq_logp: summed reference log-prob; reward: r(x, y); group_id: prompt id per response.
    Returns (scalar loss, stats of detached floats: log_z, kl, tb_residual_std, reward_mean).
    """
    beta = _check_beta(beta)
    n = seq_logp.shape[0]
    for name, t in (("ref_seq_logp", ref_seq_logp), ("reward", reward), ("group_id", group_id)):
        if t.shape != (n,):
            raise ValueError(f"tb_loss: {name} has shape {tuple(t.shape)}, expected ({n},)")
    if n == 0:
        raise ValueError("tb_loss: empty batch")
    reward = reward.to(seq_logp.dtype)
    ref_seq_logp = ref_seq_logp.to(seq_logp.dtype)

    kl = seq_logp - ref_seq_logp                      # log pi/pi_ref of each whole response
    target = reward / beta                            # log of the unnormalised tilt
    inv, counts = group_index(group_id)
    # logZ_hat is a per-group constant: detached so only logpi receives gradient (VarGrad)
    log_z_g = group_sums((target - kl).detach(), inv, counts.numel()) / counts.to(kl.dtype)
    residual = log_z_g[inv] + kl - target
    loss = residual.pow(2).mean()

    stats = {
        "log_z": log_z_g.mean().item(),               # mean over prompts, not responses
        "kl": kl.detach().mean().item(),
        "tb_residual_std": residual.detach().std(unbiased=False).item(),
        "reward_mean": reward.detach().mean().item(),
    }
    return loss, stats


def tb_loss_no_ref(seq_logp: Tensor, ref_seq_logp: Tensor | None, reward: Tensor, group_id: Tensor,
                   beta: float | Tensor) -> tuple[Tensor, dict]:
    """TB without a reference model (logpi_ref = 0): target pi* ∝ exp(r / beta).
    Same signature as tb_loss (ref_seq_logp is ignored) so variants are drop-in replacements."""
    return tb_loss(seq_logp, torch.zeros_like(seq_logp), reward, group_id, beta)


def grpo_loss(token_logp: Tensor, behav_logp: Tensor, loss_mask: Tensor, advantages: Tensor,
              ref_token_logp: Tensor | None = None, kl_coef: float = 0.0,
              eps_clip: float = 0.2) -> tuple[Tensor, dict]:
    """PPO-clip GRPO loss on (B, T) per-token log-probs; advantages (B,) broadcast over tokens.

    Token-mean over all valid (mask True) tokens of the batch. With ref_token_logp and
    kl_coef > 0, adds kl_coef * k3 where k3 = exp(ref - logp) - (ref - logp) - 1.
    Returns (scalar loss, stats: clip_frac, ratio_mean, kl).
    """
    if token_logp.shape != behav_logp.shape or token_logp.shape != loss_mask.shape:
        raise ValueError(f"grpo_loss: token_logp {tuple(token_logp.shape)}, behav_logp "
                         f"{tuple(behav_logp.shape)}, loss_mask {tuple(loss_mask.shape)} must match")
    if advantages.shape != token_logp.shape[:1]:
        raise ValueError(f"grpo_loss: advantages {tuple(advantages.shape)} expected ({token_logp.shape[0]},)")
    mask = loss_mask.bool()
    n_tok = mask.sum().clamp(min=1)
    # off-mask positions may hold padding garbage: zero the log-ratio there so exp() stays finite
    log_ratio = torch.where(mask, token_logp - behav_logp, torch.zeros_like(token_logp))
    ratio = log_ratio.exp()
    adv = advantages.to(token_logp.dtype)[:, None]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - eps_clip, 1 + eps_clip) * adv)
    per_tok = -surr

    kl_mean = 0.0
    if ref_token_logp is not None and kl_coef != 0.0:
        d = torch.where(mask, ref_token_logp - token_logp, torch.zeros_like(token_logp))
        k3 = d.exp() - d - 1  # unbiased, non-negative estimator of KL(pi || pi_ref)
        per_tok = per_tok + kl_coef * k3
        kl_mean = ((k3.detach() * mask).sum() / n_tok).item()

    loss = (per_tok * mask).sum() / n_tok
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > eps_clip) & mask
        stats = {
            "clip_frac": (clipped.sum() / n_tok).item(),
            "ratio_mean": ((ratio * mask).sum() / n_tok).item(),
            "kl": kl_mean,
        }
    return loss, stats


def _masked_grpo(token_logp: Tensor, behav_logp: Tensor, loss_mask: Tensor, advantages: Tensor, keep: Tensor,
                 ref_token_logp: Tensor | None, kl_coef: float, eps_clip: float) -> tuple[Tensor, dict]:
    """grpo_loss over the tokens `keep` marks, the others 0 but still counted in the token mean."""
    mask = loss_mask.bool()
    loss, st = grpo_loss(token_logp, behav_logp, mask & keep, advantages, ref_token_logp, kl_coef, eps_clip)
    n, kept = mask.sum().clamp(min=1), (mask & keep).sum()
    return loss * kept / n, {**st, "masked_frac": ((mask & ~keep).sum() / n).item()}


def _log_ratio(token_logp: Tensor, behav_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi_trainer / pi_sampler) per token, detached (the weights GRPO trains are the ones that
    sampled: this is the mismatch, common/contracts/mismatch.py), 0 off the mask."""
    return torch.where(mask, token_logp.detach() - behav_logp, torch.zeros_like(token_logp))


def icepop_grpo_loss(token_logp: Tensor, behav_logp: Tensor, loss_mask: Tensor, advantages: Tensor,
                     ref_token_logp: Tensor | None = None, kl_coef: float = 0.0, eps_clip: float = 0.2,
                     mask_bound: float = 2.0) -> tuple[Tensor, dict]:
    """grpo_loss with IcePop's two-sided token mask (inclusionAI's Ring-1T report, 2025): a token whose
    pi_trainer / pi_sampler leaves [1/b, b] (b = `mask_bound`) leaves the loss. Stats add masked_frac."""
    mask = loss_mask.bool()
    keep = in_band(_log_ratio(token_logp, behav_logp, mask), mask_bound)
    return _masked_grpo(token_logp, behav_logp, mask, advantages, keep, ref_token_logp, kl_coef, eps_clip)


def geo_seq_mask_grpo_loss(token_logp: Tensor, behav_logp: Tensor, loss_mask: Tensor, advantages: Tensor,
                           ref_token_logp: Tensor | None = None, kl_coef: float = 0.0, eps_clip: float = 0.2,
                           mask_bound: float = 2.0) -> tuple[Tensor, dict]:
    """grpo_loss with a sequence-level geometric mask (verl's and slime's sequence masks): a response
    whose geometric-mean pi_trainer / pi_sampler, exp(mean_t log ratio), leaves [1/b, b] leaves the
    loss whole. Stats add masked_frac (of tokens)."""
    mask = loss_mask.bool()
    keep = in_band(seq_mean(_log_ratio(token_logp, behav_logp, mask), mask), mask_bound)[:, None].expand_as(mask)
    return _masked_grpo(token_logp, behav_logp, mask, advantages, keep, ref_token_logp, kl_coef, eps_clip)


# --grpo.loss: each name is one of the functions above
GRPO_LOSSES = {"grpo": grpo_loss, "icepop": icepop_grpo_loss, "geo_seq_mask": geo_seq_mask_grpo_loss}


def linear_beta(step: int, beta_init: float, beta_final: float, anneal_steps: int, cut_step: int = 0) -> float:
    """beta_init at step 0, linearly to beta_final at anneal_steps, constant afterwards; with
    cut_step > 0, beta_final from cut_step on even before anneal_steps (TBA's TL;DR schedule
    heads for 0.05 at step 128 and drops to it at step 32)."""
    if anneal_steps <= 0 or step >= anneal_steps or 0 < cut_step <= step:
        return float(beta_final)
    frac = max(step, 0) / anneal_steps
    return float(beta_init + frac * (beta_final - beta_init))
