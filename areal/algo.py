"""AReaL's trainer hooks (Fu et al. 2025), called by `common/runtime/trainer.py` in the trainer process.

Per trainer step (the AReaL paper's algorithm):
  batch       the oldest B = prompts_per_step x n unconsumed trajectories whose oldest token is
              at most eta = max_staleness versions behind the current weights, each used once
              (`ReplayBuffer.pop_oldest`; rows past the bound are dropped and counted). Sync mode
              (eta = 0, settled by the run's config check) takes exactly the batch the current
              weights generated.
  prox pass   one no-grad pass of the current weights over the batch, at the sampling
              temperature, through the one log-prob function (`common.ops.token_logp`):
              prox_logp, fixed for every minibatch of the step. With several trainer ranks
              each computes its micro-batches' rows and `rank_sum` completes the tensor.
  advantages  no critic, no reference: the sequence reward normalised over the n samples of its
              prompt ("group", default) or over the whole batch ("batch", the paper's), the
              same for every token of the response (gamma = lambda = 1, reward on the last token).
  updates     the batch split into `n_minibatches` minibatches of about equal token counts,
              one optimizer step each (the trainer loops, see `common.algorithm.Algorithm.minibatches`).
  loss        `loss_fn` (areal/loss.py, default decoupled_ppo_loss): a token mean over the
              whole minibatch; micro-batches (token-budget first-fit-decreasing packing) are
              weighted by their share of its tokens, so micro-batching never changes the gradient.
              Any loss that takes (logp, prox_logp, behav_logp, advantages, mask) fits, with
              eps_clip / eps_clip_high / behav_imp_weight_cap and micro-batch fields by keyword
              if it names them; every stat it returns is logged (common/algorithm.py: the loss
              contract), the behaviour-weight stats computed here over the whole batch.
Staleness is bounded twice: by admission in the generators (`common.runtime.generator.Control`,
started < (eta + v + 1) x prompts per version) and by the filter here, which makes the bound
exact whatever order groups finish in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from areal.loss import batch_normalised_advantages, behaviour_stats, decoupled_ppo_loss
from common.algorithm import Algorithm, accumulate, call_loss, check_loss
from common.batch import Batch
from common.config_check import above, at_least, between
from common.micro import micro_batches, packs_rows, rank_sum, rank_sum_stats
from common.ops import group_normalised_advantages, token_logp


_SETTINGS = ("eps_clip", "eps_clip_high", "behav_imp_weight_cap")  # config fields a loss may take by keyword


@dataclass
class AReaLConfig:
    eps_clip: float = 0.2             # PPO clip: u = pi/pi_prox kept in [1 - eps_clip, 1 + eps_clip_high]
    eps_clip_high: Optional[float] = None  # upper clip bound (asymmetric clipping); None = eps_clip
    behav_imp_weight_cap: Optional[float] = 5.0  # tokens with pi_prox/pi_behav above this are masked; None = no cap
    n_minibatches: int = 4            # optimizer steps per trainer step (the batch split by tokens)
    adv_norm: Literal["group", "batch"] = "group"  # normalise rewards over a prompt's n samples, or over the batch (paper)

    CHECKS = {"eps_clip": between(0, 1, open_lo=True, open_hi=True), "eps_clip_high": above(0),
              "behav_imp_weight_cap": at_least(1), "n_minibatches": at_least(1)}  # ranges (common/config_check.py)


def split_by_tokens(lengths: list[int], n: int) -> list[list[int]]:
    """Row indices in at most n parts of near-equal total length: longest first, each row to the
    part with the fewest tokens so far. Rows inside a part stay in ascending order."""
    parts: list[list[int]] = [[] for _ in range(min(n, len(lengths)))]
    load = [0] * len(parts)
    for r in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = load.index(min(load))
        parts[j].append(r)
        load[j] += lengths[r]
    return [sorted(p) for p in parts]


class AReaL(Algorithm):
    def __init__(self, cfg: AReaLConfig, prompts_per_step: int, n: int, temperature: float,
                 micro_batch_tokens: int, max_staleness: Optional[int], loss_fn: Callable = decoupled_ppo_loss):
        if max_staleness is None:
            raise ValueError("AReaL needs a staleness bound: set --train.max_staleness=ETA (paper: 4; 0 = sync)")
        if cfg.n_minibatches < 1:
            raise ValueError(f"areal.n_minibatches={cfg.n_minibatches}: need >= 1")
        if cfg.adv_norm not in ("group", "batch"):
            raise ValueError(f"areal.adv_norm={cfg.adv_norm!r}: expected 'group' or 'batch'")
        self.cfg, self.loss_fn = cfg, check_loss(loss_fn, 5, _SETTINGS)
        self.B, self.temperature, self.max_staleness = prompts_per_step * n, temperature, max_staleness
        self.micro_batch_tokens = micro_batch_tokens
        self._batch_stats: dict = {}

    def next_batch(self, buffer, step: int, version: int, sync: bool) -> Batch | None:
        eta = self.max_staleness
        if buffer.capacity < (eta + 2) * self.B:  # rows in flight must never lap unconsumed ones
            raise ValueError(f"train.buffer_capacity={buffer.capacity} is too small for AReaL: need at least "
                             f"(max_staleness + 2) x batch = {(eta + 2) * self.B} rows")
        return buffer.pop_oldest(self.B, max_staleness=eta, current_version=version)

    @torch.no_grad()
    def proximal_logp(self, model, batch: Batch) -> torch.Tensor:
        """(B, T) log-probs of the batch under the current weights (0 off the mask)."""
        prox = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
        for rows in micro_batches(batch, self.micro_batch_tokens, packed=packs_rows(model)):
            mb = batch.select(rows)
            prox[rows.to(prox.device), :mb.tokens.shape[1]] = token_logp(model, mb.tokens, self.temperature,
                                                                         mb.loss_mask, prompt_lens=mb.prompt_lens)
        return rank_sum(prox)  # other ranks' rows are 0 here

    def advantages(self, batch: Batch) -> torch.Tensor:
        if self.cfg.adv_norm == "group":
            return group_normalised_advantages(batch.reward, batch.group_id)
        return batch_normalised_advantages(batch.reward)

    def minibatches(self, model, batch: Batch, step: int) -> list[Batch]:
        batch.extra["prox_logp"] = self.proximal_logp(model, batch)
        batch.extra["advantages"] = adv = self.advantages(batch)  # (B,)
        self._batch_stats = {**behaviour_stats(batch.extra["prox_logp"], batch.behav_logp, batch.loss_mask,
                                               self.cfg.behav_imp_weight_cap),
                             "adv_abs": adv.abs().mean().item()}
        lengths = (batch.prompt_lens + batch.comp_lens).tolist()
        return [batch.select(rows) for rows in split_by_tokens(lengths, self.cfg.n_minibatches)]

    def backward(self, model, batch: Batch, step: int) -> dict:
        n_tok = batch.loss_mask.sum().clamp(min=1)
        settings = {k: getattr(self.cfg, k) for k in _SETTINGS}
        totals: dict[str, float] = {}
        for rows in micro_batches(batch, self.micro_batch_tokens, packed=packs_rows(model)):
            mb = batch.select(rows)
            lp = token_logp(model, mb.tokens, self.temperature, mb.loss_mask, prompt_lens=mb.prompt_lens)
            loss, st = call_loss(self.loss_fn, mb, lp, mb.extra["prox_logp"], mb.behav_logp, mb.extra["advantages"],
                                 mb.loss_mask, **settings)
            w = float(mb.loss_mask.sum() / n_tok)  # this micro-batch's share of the minibatch's tokens
            (loss * w).backward()
            accumulate(totals, w, loss, st)
        # the behaviour-weight stats describe the whole batch (prox and behav are fixed for the step):
        # they replace the loss's own per-micro-batch ones of the same names
        return {**rank_sum_stats(totals), **self._batch_stats}
