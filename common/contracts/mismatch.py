"""The sampler-trainer mismatch: the same tokens, the same weights, two engines' log-probs.

Runs in the trainer process (each algorithm calls `mismatch_stats` where it has the trainer's
log-probs under the weights it holds before its first update: AReaL's proximal pass, the loss
pass of TBA and GRPO). On the tokens sampled by exactly those weights (`same_weights`: the runtime
marks them, common/runtime/trainer.py, only while the trainer's weights are the ones it published
last), with d_t = logp_trainer - logp_sampler:

    mismatch_abs_mean, mismatch_abs_max   mean and max |d_t|
    mismatch_kl                           k3 estimate of KL(sampler || trainer): mean of exp(d) - d - 1
                                          (unbiased, >= 0, for tokens drawn from the sampler)
    mismatch_frac                         fraction of those tokens with |d_t| > `tol` (default 1e-3)
    mismatch_tokens                       how many tokens were compared

No tokens to compare (the weights moved since the last publish, or every row is stale): no keys,
so the metrics hold the mismatch only where it was measured. An on-policy step is off-policy by
this much before any staleness. `in_band` and `seq_mean` are the two pieces the masked corrections
of areal/loss.py and tba/loss.py share (a ratio's band [1/b, b], a response's geometric mean).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

MISMATCH_TOL = 1e-3  # |d| above this counts in mismatch_frac: bf16 paths exceed it, fp32 paths should not


def same_weights(versions: Tensor, mask: Tensor, version: int | None) -> Tensor:
    """(B, T) bool: the loss tokens sampled by weights `version` (None: the trainer's weights are
    not a published version's, so none)."""
    if version is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return mask.bool() & (versions == version)


def mismatch_stats(trainer_logp: Tensor, sampler_logp: Tensor, same: Tensor, tol: float = MISMATCH_TOL) -> dict:
    """The module docstring's stats over the tokens `same` marks ({} when it marks none)."""
    same = same.bool()
    n = int(same.sum())
    if n == 0:
        return {}
    d = (trainer_logp.detach().double() - sampler_logp.double())[same]  # k3 of d ~ 1e-6 needs float64
    a = d.abs()
    return {"mismatch_abs_mean": a.mean().item(), "mismatch_abs_max": a.max().item(),
            "mismatch_kl": (d.exp() - d - 1).mean().item(), "mismatch_frac": (a > tol).float().mean().item(),
            "mismatch_tokens": float(n)}


def scatter_rows(full: Tensor, rows: Tensor, part: Tensor) -> None:
    """Write a micro-batch's (b, t) per-token values into rows `rows` of the batch's (B, T) `full`."""
    full[rows.to(full.device), :part.shape[1]] = part.detach().to(full.dtype)


def in_band(log_ratio: Tensor, bound: float) -> Tensor:
    """Where exp(log_ratio) lies in [1/bound, bound] (compared in log space: no overflow): the band of
    the masked corrections (IcePop's, the sequence masks; areal/loss.py, tba/loss.py)."""
    if not bound >= 1:
        raise ValueError(f"mask_bound={bound}: need >= 1 (the band is [1/b, b])")
    return log_ratio.abs() <= math.log(bound)


def seq_mean(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """(B,) mean of each row's per-token log-ratios over its mask: the log of the geometric-mean ratio."""
    return (log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)
