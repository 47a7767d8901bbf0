"""The one token log-probability function, shared by the sampler (generators) and the trainer,
and masked reductions.

Temperature convention (one for the whole codebase): a token's log-prob is taken under the
temperature-scaled distribution softmax(logits / T), before any top-k / top-p truncation.
Greedy decoding (T = 0) records log-probs at T = 1. `logp_temperature` encodes this.

Alignment (the only place it happens): logits[:, t] predicts tokens[:, t + 1], so the
returned per-token array is *target-aligned*: out[:, t] = log p(tokens[:, t] | tokens[:, :t]),
with out[:, 0] = 0 (the first token has no prediction). See `common/contracts/batch.py`.
Shapes: B rows, T tokens, V vocab.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from common.contracts.batch import Trajectory, collate


def logp_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: T itself, or 1 for greedy (T = 0)."""
    return float(temperature) if temperature > 0 else 1.0


def logp_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature,
                     lse: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / T)[token]. logits (..., V), tokens (...) -> (...) float32.

    `temperature` is a float or a tensor broadcastable to logits[..., :1] (per-row T in the
    sampler). Computed in fp32 whatever the model dtype, so bf16 models compare cleanly.
    `lse` (...): logsumexp(logits / T) when the caller already has it (the sampler gets it as
    a by-product of its CDF, which saves two passes over (B, V)); computed here otherwise.
    """
    scaled = logits.float()
    if torch.is_tensor(temperature) or temperature != 1:
        scaled = scaled / (temperature.float() if torch.is_tensor(temperature) else temperature)
    if lse is None:
        lse = torch.logsumexp(scaled, dim=-1)
    # gather - logsumexp == log_softmax(...).gather(...) without materialising (..., V) log-probs
    return scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse


def token_logp(model, tokens: torch.Tensor, temperature: float, loss_mask: torch.Tensor | None = None,
               chunk_rows: int | None = None, prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Target-aligned log-probs (B, T) of `tokens` (B, T) under `model` at `temperature`.

    Differentiable (call under torch.no_grad() for behaviour/proximal/reference passes).
    The model is called as a module (`model(x, targets=..., temperature=...)`), so wrappers
    that hook `__call__` (FSDP, DDP) see every forward. Position t's hidden state predicts token
    t + 1, so the targets are the tokens shifted left; with `loss_mask` (B, T) only masked
    tokens are targets and the head runs only at the positions predicting them (no (tokens, V)
    lm_head on prompts), in chunks of positions (`common/engine/model/head.py`); the rest of the
    output is 0. Right padding needs no attention mask: with causal attention, pad tokens after
    a sequence never influence its real tokens; callers mask the padded positions out.
    `chunk_rows` bounds the rows held at once. With `prompt_lens` (B,), a model whose
    `share_prompts` is set (None: on CPU) runs rows that share a prompt with that prompt once
    (`Transformer.forward(..., prefix_lens=)`, `common/engine/model/prefix.py`): the same log-probs up
    to summation order, fewer FLOPs for groups of samples of one prompt.
    """
    T_eff = logp_temperature(temperature)
    B, T = tokens.shape
    outs = []
    step = chunk_rows or B
    autocast = getattr(model, "autocast", contextlib.nullcontext)  # mixed precision: model.compute_dtype
    for i in range(0, B, step):
        x = tokens[i:i + step]
        shared = {"prefix_lens": prompt_lens[i:i + step]} if prompt_lens is not None and _shares(model) else {}
        nxt = x[:, 1:]                                     # (b, T-1): what positions 0..T-2 predict
        if loss_mask is not None:
            nxt = nxt.masked_fill(~loss_mask[i:i + step, 1:], -1)  # -1: no target, head skipped there
        targets = F.pad(nxt, (0, 1), value=-1)             # (b, T): the last position predicts nothing
        with autocast():
            lp = model(x, targets=targets, temperature=T_eff, **shared)  # (b, T) fp32, at the predicting positions
        outs.append(F.pad(lp[:, :-1], (1, 0)))             # (b, T) target-aligned: position 0 has no prediction
    return torch.cat(outs, 0)


def _shares(model) -> bool:
    """Whether `model` runs shared prompts once: our Transformer's `share_prompts` (None: on CPU)."""
    s = getattr(model, "share_prompts", False)
    return s if s is not None else model.device.type == "cpu"


@torch.no_grad()
def reference_seq_logp(model, trajs: list[Trajectory], temperature: float) -> torch.Tensor:
    """(N,) sum of `model`'s token log-probs over each trajectory's completion, at `temperature`,
    on the model's device: the generators' reference pass (TBA's KL term), evaluation's KL and
    red-teaming's fluency term, through `token_logp`. The padded batch is built on the CPU and
    moved to the model's device (a CPU batch fed to a CUDA model was the first GPU crash)."""
    b = collate(trajs).to(model.device)
    return seq_logp(token_logp(model, b.tokens, temperature, b.loss_mask, prompt_lens=b.prompt_lens), b.loss_mask)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=-1) -> torch.Tensor:
    return (x * mask).sum(dim)


def seq_logp(token_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sequence log-prob (B,): SUM of completion-token log-probs (no length normalisation)."""
    return masked_sum(token_logp, loss_mask, dim=-1)


# ---------------------------------------------------------------- per-group reductions
# group_id (N,) int64 prompt ids in any order; G = number of distinct groups

def group_index(group_id: Tensor) -> tuple[Tensor, Tensor]:
    """Map arbitrary int64 prompt ids to dense 0..G-1 indices; also return group sizes (G,)."""
    _, inv = torch.unique(group_id, return_inverse=True)
    counts = torch.bincount(inv)
    return inv, counts


def group_sums(x: Tensor, inv: Tensor, n_groups: int) -> Tensor:
    # index_add instead of a Python loop: one kernel whatever the number or order of groups
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x)


def group_mean(x: Tensor, group_id: Tensor) -> Tensor:
    """(N,) -> (N,): each element replaced by the mean of its group (groups in any order/size)."""
    if x.shape != group_id.shape or x.dim() != 1:
        raise ValueError(f"group_mean: x {tuple(x.shape)} and group_id {tuple(group_id.shape)} must be equal 1-D")
    inv, counts = group_index(group_id)
    means = group_sums(x, inv, counts.numel()) / counts.to(x.dtype)
    return means[inv]


def group_normalised_advantages(reward: Tensor, group_id: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO advantage (r - mean_g r) / (std_g r + eps), population std; singleton groups -> 0."""
    reward = reward.float() if not reward.is_floating_point() else reward
    centred = reward - group_mean(reward, group_id)
    std = group_mean(centred.pow(2), group_id).sqrt()
    # a singleton group has centred == 0 exactly, so its advantage is 0 without special-casing
    return centred / (std + eps)
