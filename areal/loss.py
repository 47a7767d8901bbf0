"""AReaL's losses (Fu et al. 2025): decoupled PPO and the variants it is ablated against.

Pure functions of (B, T) per-token tensors, called by the trainer process (areal/algo.py) and by
tests and notebooks. Per response token t with advantage A_t (the AReaL paper's decoupled objective):

    u_t = pi_theta / pi_prox = exp(logp - prox_logp)              (carries the gradient)
    w_t = pi_prox / pi_behav = exp(prox_logp - behav_logp)        (detached)
    L_t = w_t * max(-A_t u_t, -A_t clip(u_t, 1 - eps_clip, 1 + eps_clip_high))
    loss = sum_t mask_t L_t / sum_t mask_t

behav_logp is what the sampler recorded when it drew the token (a trajectory may mix versions
after an interruption); prox_logp comes from one no-grad pass of the weights at the start of
the trainer step, fixed for all its minibatches. Tokens whose w_t exceeds behav_imp_weight_cap
get w_t = 0 but stay in the denominator, so capping never re-weights the other tokens.

Every loss here shares one signature, so an ablation swaps a function, never a string:
    loss_fn(logp, prox_logp, behav_logp, advantages, mask, eps_clip, eps_clip_high=None,
            behav_imp_weight_cap=None) -> (loss, stats)
  - decoupled_ppo_loss: the above (AReaL).
  - ppo_loss: naive PPO, ratio and clip around pi_behav, no proximal term (ignores prox_logp
    and the cap): what AReaL shows collapsing as staleness grows.
  - truncated_is_ppo_loss: decoupled, but w_t clamped at the cap instead of masked (the
    truncated importance sampling other systems use).
  - icepop_ppo_loss, geo_seq_mask_ppo_loss: decoupled, tokens (IcePop) or whole responses (the
    geometric mean of their ratios) whose w leaves [1/b, b] masked: the corrections for the
    sampler-trainer mismatch (common/contracts/mismatch.py measures it); b = `mask_bound`.
advantages: (B,) per sequence (broadcast over its tokens) or (B, T) per token. The token mean
is over the given rows: the caller weights micro-batches by their share of a minibatch's
tokens (areal/algo.py), so micro-batching never changes the gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from common.contracts.mismatch import in_band, seq_mean


def _check(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Validate shapes; return advantages as (B, T) in logp's dtype."""
    for name, t in (("prox_logp", prox_logp), ("behav_logp", behav_logp), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logp's {tuple(logp.shape)}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got {tuple(logp.shape)}")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages[:, None].expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected (B,) or (B, T) = "
                         f"{tuple(logp.shape)}")
    return advantages.to(logp.dtype)


def _masked_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    # off-mask positions may hold padding garbage: a zero log-ratio there keeps exp() finite
    return torch.where(mask, a - b, torch.zeros_like(a))


def behaviour_stats(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor,
                    behav_imp_weight_cap: float | None = None) -> dict:
    """The train/inference gap over valid tokens, as floats: mean/max of w = pi_prox/pi_behav,
    its effective sample size (sum w)^2 / (n sum w^2) (1 = on-policy), the fraction above the
    cap, and mean/max |prox_logp - behav_logp|."""
    mask = mask.bool()
    n = mask.sum().clamp(min=1)
    d = _masked_log_ratio(prox_logp.detach().float(), behav_logp.float(), mask)
    w = d.exp()[mask]
    gap = d.abs()[mask]
    any_tok = bool(mask.any())
    capped = (w > behav_imp_weight_cap).sum() if behav_imp_weight_cap is not None else torch.zeros(())
    return {
        "behav_w_mean": (w.sum() / n).item(),
        "behav_w_max": w.max().item() if any_tok else 0.0,
        "behav_ess": (w.sum() ** 2 / (n * w.pow(2).sum()).clamp(min=1e-30)).item() if any_tok else 1.0,
        "capped_frac": (capped / n).item(),
        "gap_mean": (gap.sum() / n).item(),
        "gap_max": gap.max().item() if any_tok else 0.0,
    }


def _clipped_surrogate(log_u: Tensor, adv: Tensor, eps_clip: float, eps_clip_high: float | None) -> tuple[Tensor, Tensor]:
    """Per-token max(-A u, -A clip(u, 1 - eps, 1 + eps_high)) and where the clipped term won."""
    hi = eps_clip if eps_clip_high is None else eps_clip_high
    u = log_u.exp()
    unclipped, clipped = -adv * u, -adv * u.clamp(1 - eps_clip, 1 + hi)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def _reduce(per_tok: Tensor, clip_won: Tensor, mask: Tensor, extra: dict) -> tuple[Tensor, dict]:
    n = mask.sum().clamp(min=1)
    loss = (per_tok * mask).sum() / n
    return loss, {"clip_frac": ((clip_won & mask).sum() / n).item(), **extra}


def decoupled_ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                       eps_clip: float = 0.2, eps_clip_high: float | None = None,
                       behav_imp_weight_cap: float | None = None) -> tuple[Tensor, dict]:
    """AReaL's decoupled PPO objective (module docstring). Stats: clip_frac plus
    `behaviour_stats` (capped_frac, behav_w_mean/max, behav_ess, gap_mean/max)."""
    adv = _check(logp, prox_logp, behav_logp, advantages, mask)
    mask = mask.bool()
    surr, clip_won = _clipped_surrogate(_masked_log_ratio(logp, prox_logp.detach(), mask), adv, eps_clip, eps_clip_high)
    w = _masked_log_ratio(prox_logp.detach(), behav_logp, mask).exp()
    if behav_imp_weight_cap is not None:
        w = torch.where(w > behav_imp_weight_cap, torch.zeros_like(w), w)  # masked, still counted in n
    return _reduce(w * surr, clip_won, mask, behaviour_stats(prox_logp, behav_logp, mask, behav_imp_weight_cap))


def truncated_is_ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                          eps_clip: float = 0.2, eps_clip_high: float | None = None,
                          behav_imp_weight_cap: float | None = None) -> tuple[Tensor, dict]:
    """Decoupled PPO with the behaviour weight clamped at the cap (w = min(w, cap)) instead of
    masked: a token far off the behaviour policy still learns, at weight `cap`."""
    adv = _check(logp, prox_logp, behav_logp, advantages, mask)
    mask = mask.bool()
    surr, clip_won = _clipped_surrogate(_masked_log_ratio(logp, prox_logp.detach(), mask), adv, eps_clip, eps_clip_high)
    w = _masked_log_ratio(prox_logp.detach(), behav_logp, mask).exp()
    if behav_imp_weight_cap is not None:
        w = w.clamp(max=behav_imp_weight_cap)
    return _reduce(w * surr, clip_won, mask, behaviour_stats(prox_logp, behav_logp, mask, behav_imp_weight_cap))


def ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
             eps_clip: float = 0.2, eps_clip_high: float | None = None,
             behav_imp_weight_cap: float | None = None) -> tuple[Tensor, dict]:
    """Naive PPO: u = pi_theta / pi_behav clipped around the behaviour policy, no behaviour
    weight. prox_logp and the cap are not used by the loss (same signature as its siblings);
    the stats still report the gap, so runs of both losses log the same metrics."""
    adv = _check(logp, prox_logp, behav_logp, advantages, mask)
    mask = mask.bool()
    surr, clip_won = _clipped_surrogate(_masked_log_ratio(logp, behav_logp, mask), adv, eps_clip, eps_clip_high)
    return _reduce(surr, clip_won, mask, behaviour_stats(prox_logp, behav_logp, mask, None))


def icepop_ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                    eps_clip: float = 0.2, eps_clip_high: float | None = None,
                    behav_imp_weight_cap: float | None = None, mask_bound: float = 2.0) -> tuple[Tensor, dict]:
    """Decoupled PPO with IcePop's two-sided token mask (inclusionAI's Ring-1T report, 2025: masked
    importance sampling against the training-inference mismatch): a token whose behaviour ratio
    w_t = pi_prox / pi_behav leaves [1/b, b] (b = `mask_bound`) leaves the loss (0, still counted in
    the mean); inside the band w_t weights it as in decoupled_ppo_loss. The band replaces the
    one-sided cap (behav_imp_weight_cap is not used). Stats add masked_frac."""
    adv = _check(logp, prox_logp, behav_logp, advantages, mask)
    mask = mask.bool()
    surr, clip_won = _clipped_surrogate(_masked_log_ratio(logp, prox_logp.detach(), mask), adv, eps_clip, eps_clip_high)
    log_w = _masked_log_ratio(prox_logp.detach(), behav_logp, mask)
    keep = mask & in_band(log_w, mask_bound)
    w = torch.where(keep, log_w.exp(), torch.zeros_like(log_w))
    stats = {**behaviour_stats(prox_logp, behav_logp, mask, None),
             "masked_frac": ((mask & ~keep).sum() / mask.sum().clamp(min=1)).item()}
    return _reduce(w * surr, clip_won, mask, stats)


def geo_seq_mask_ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                          eps_clip: float = 0.2, eps_clip_high: float | None = None,
                          behav_imp_weight_cap: float | None = None, mask_bound: float = 2.0) -> tuple[Tensor, dict]:
    """Decoupled PPO with a sequence-level geometric mask (the sequence masks of verl's and slime's
    rollout corrections): a response whose geometric-mean behaviour ratio exp(mean_t log w_t) leaves
    [1/b, b] leaves the loss whole (its tokens 0, still counted); the kept ones' tokens are weighted
    by w_t, capped as in decoupled_ppo_loss. Stats add masked_frac (of tokens) and masked_seq_frac."""
    adv = _check(logp, prox_logp, behav_logp, advantages, mask)
    mask = mask.bool()
    surr, clip_won = _clipped_surrogate(_masked_log_ratio(logp, prox_logp.detach(), mask), adv, eps_clip, eps_clip_high)
    log_w = _masked_log_ratio(prox_logp.detach(), behav_logp, mask)
    rows = mask.any(1)
    keep_row = rows & in_band(seq_mean(log_w, mask), mask_bound)  # the geometric mean of each response's ratios
    keep = mask & keep_row[:, None]
    w = torch.where(keep, log_w.exp(), torch.zeros_like(log_w))
    if behav_imp_weight_cap is not None:
        w = torch.where(w > behav_imp_weight_cap, torch.zeros_like(w), w)
    stats = {**behaviour_stats(prox_logp, behav_logp, mask, behav_imp_weight_cap),
             "masked_frac": ((mask & ~keep).sum() / mask.sum().clamp(min=1)).item(),
             "masked_seq_frac": ((rows & ~keep_row).sum() / rows.sum().clamp(min=1)).item()}
    return _reduce(w * surr, clip_won, mask, stats)


# --areal.loss: each name is one of the functions above
LOSSES = {"decoupled": decoupled_ppo_loss, "truncated_is": truncated_is_ppo_loss, "ppo": ppo_loss,
          "icepop": icepop_ppo_loss, "geo_seq_mask": geo_seq_mask_ppo_loss}


def shaped_reward(reward: Tensor, bias: float = 0.0, scaling: float = 1.0, clip: float | None = None) -> Tensor:
    """AReaL's reward shaping (its realhf math agent and PPO interface: reward_output_bias,
    reward_output_scaling, max_reward_clip): (r - bias) x scaling, clipped to [-clip, clip]. Its
    math run maps success s in {0, 1} to ((s - 0.5) x 2 - 0) x 5 = +-5: bias 0.5, scaling 10."""
    r = (reward.float() - bias) * scaling
    return r if clip is None else r.clamp(-clip, clip)


def token_normalised_advantages(reward: Tensor, n_tokens: Tensor, eps: float = 1e-5) -> Tensor:
    """(r - mean) / (std + eps) with the mean and the (population) std over every valid token of the
    batch, each sequence's reward counted once per token it trains (AReaL's `masked_normalization` of
    its per-token advantages, `adv_norm: true, group_adv_norm: false`); rows with no token count 0."""
    r, w = reward.float(), n_tokens.float()
    total = w.sum().clamp(min=1)
    mean = (r * w).sum() / total
    std = (((r - mean) ** 2) * w).sum().div(total).sqrt()
    return (r - mean) / (std + eps)


def batch_normalised_advantages(reward: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - mean r) / (std r + eps) over every sequence of the batch (AReaL paper's setting;
    population std). The group-normalised variant is common.contracts.ops.group_normalised_advantages."""
    r = reward.float()
    c = r - r.mean()
    return c / (c.pow(2).mean().sqrt() + eps)
