"""AReaL's trainer hooks (Fu et al. 2025), called by `common/runtime/trainer.py` in the trainer process.

Per trainer step (the AReaL paper's algorithm):
  batch       the oldest B = prompts_per_step x n unconsumed trajectories whose oldest token is
              at most eta = max_staleness versions behind the current weights, each used once
              (`ReplayBuffer.pop_oldest`; rows past the bound are dropped and counted, and with
              success_rate_lb / _ub so are the groups whose mean reward is outside them: AReaL's
              coding run drops prompts all of whose answers failed or passed). Sync mode
              (eta = 0, settled by the run's config check) takes exactly the batch the current
              weights generated.
  prox pass   one no-grad pass of the current weights over the batch, at the sampling
              temperature, through the one log-prob function (`common.contracts.ops.token_logp`):
              prox_logp, fixed for every minibatch of the step. With several trainer ranks
              each computes its micro-batches' rows and `rank_sum` completes the tensor.
  advantages  no critic, no reference: the sequence reward, shaped as AReaL's code shapes it
              ((r - reward_bias) x reward_scaling, clipped at max_reward_clip), normalised over
              the n samples of its prompt ("group", default), over the batch's sequences
              ("batch") or over its valid tokens ("batch_tokens", the paper's code), the same
              for every token of the response (gamma = lambda = 1, reward on the last token).
              With mask_too_long, rows cut at gen.max_new_tokens leave the loss and the
              normalisation (AReaL's mask_too_long).
  updates     the batch split into `n_minibatches` minibatches of about equal token counts,
              one optimizer step each (the trainer loops, see `common.contracts.algorithm.Algorithm.minibatches`).
  loss        `loss_fn` (areal/loss.py, default decoupled_ppo_loss): a token mean over the
              whole minibatch; micro-batches (token-budget first-fit-decreasing packing) are
              weighted by their share of its tokens, so micro-batching never changes the gradient.
              Any loss that takes (logp, prox_logp, behav_logp, advantages, mask) fits, with
              eps_clip / eps_clip_high / behav_imp_weight_cap and micro-batch fields by keyword
              if it names them; every stat it returns is logged (common/contracts/algorithm.py: the loss
              contract), the behaviour-weight stats computed here over the whole batch. With
              early_stop_imp_ratio r, a micro-batch whose mean u = pi_theta/pi_prox over its
              valid tokens exceeds r contributes no gradient (AReaL's "abandon this minibatch");
              its share of the token mean stays in the denominator.
Staleness is bounded twice: by admission in the generators (`common.runtime.generator.Control`,
started < (eta + v + 1) x prompts per version) and by the filter here, which makes the bound
exact whatever order groups finish in.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from areal.loss import (LOSSES, batch_normalised_advantages, behaviour_stats, shaped_reward,
                        token_normalised_advantages)
from common.contracts.algorithm import Algorithm, accumulate, call_loss, check_loss
from common.contracts.batch import FINISH_REASONS, Batch
from common.contracts.config_check import above, any_finite, at_least, between
from common.contracts.micro import micro_batches, packs_rows, rank_sum, rank_sum_stats
from common.contracts.mismatch import mismatch_stats
from common.contracts.ops import group_normalised_advantages, token_logp


log = logging.getLogger("asyncrl.areal")
_SETTINGS = ("eps_clip", "eps_clip_high", "behav_imp_weight_cap", "mask_bound")  # config fields a loss may take by keyword


@dataclass
class AReaLConfig:
    eps_clip: float = 0.2             # PPO clip: u = pi/pi_prox kept in [1 - eps_clip, 1 + eps_clip_high]
    eps_clip_high: Optional[float] = None  # upper clip bound (asymmetric clipping); None = eps_clip
    behav_imp_weight_cap: Optional[float] = 5.0  # tokens with pi_prox/pi_behav above this are masked; None = no cap (the paper's run)
    n_minibatches: int = 4            # optimizer steps per trainer step (the batch split by tokens)
    adv_norm: Literal["group", "batch", "batch_tokens"] = "group"  # normalise rewards over a prompt's n samples, the batch's sequences, or its valid tokens (the paper's code)
    early_stop_imp_ratio: Optional[float] = None  # a micro-batch whose mean pi_theta/pi_prox exceeds this adds no gradient (the paper's code: 5); None = off
    mask_too_long: bool = False       # rows cut at gen.max_new_tokens leave the loss and the advantages' statistics
    reward_bias: float = 0.0          # reward shaping: (r - bias) x scaling (the paper's code on 0/1 success: bias 0.5, scaling 10: +-5)
    reward_scaling: float = 1.0       # see reward_bias
    max_reward_clip: Optional[float] = None  # the shaped reward clipped to [-clip, clip] (the paper's code: 20); None = off
    success_rate_lb: Optional[float] = None  # groups whose mean reward is below this are dropped, not trained (the coding run: 0.05); None = off
    success_rate_ub: Optional[float] = None  # and those above this (the coding run: 0.95); None = off
    loss: Literal["decoupled", "truncated_is", "ppo", "icepop", "geo_seq_mask"] = "decoupled"  # areal/loss.py's LOSSES (a loss passed to main() wins)
    mask_bound: float = 2.0           # icepop, geo_seq_mask: tokens / responses whose behaviour ratio leaves [1/b, b] leave the loss

    CHECKS = {"eps_clip": between(0, 1, open_lo=True, open_hi=True), "eps_clip_high": above(0),
              "behav_imp_weight_cap": at_least(1), "n_minibatches": at_least(1), "early_stop_imp_ratio": above(1),
              "reward_bias": any_finite(), "reward_scaling": above(0),
              "max_reward_clip": above(0), "success_rate_lb": between(0, 1),
              "success_rate_ub": between(0, 1), "mask_bound": at_least(1)}  # ranges (common/contracts/config_check.py)


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
                 micro_batch_tokens: int, max_staleness: Optional[int], loss_fn: Optional[Callable] = None):
        if max_staleness is None:
            raise ValueError("AReaL needs a staleness bound: set --train.max_staleness=ETA (paper: 4; 0 = sync)")
        if cfg.n_minibatches < 1:
            raise ValueError(f"areal.n_minibatches={cfg.n_minibatches}: need >= 1")
        if cfg.adv_norm not in ("group", "batch", "batch_tokens"):
            raise ValueError(f"areal.adv_norm={cfg.adv_norm!r}: expected 'group', 'batch' or 'batch_tokens'")
        if loss_fn is None and cfg.loss not in LOSSES:
            raise ValueError(f"areal.loss={cfg.loss!r}: expected one of {', '.join(LOSSES)}")
        self.cfg, self.loss_fn = cfg, check_loss(loss_fn or LOSSES[cfg.loss], 5, _SETTINGS)
        self.B, self.n, self.temperature, self.max_staleness = prompts_per_step * n, n, temperature, max_staleness
        self.micro_batch_tokens = micro_batch_tokens
        self._batch_stats: dict = {}
        self._filtered_at_batch, self._warned_filter = 0, False  # the success-rate filter's warning (next_batch)

    def next_batch(self, buffer, step: int, version: int, sync: bool) -> Batch | None:
        eta = self.max_staleness
        if buffer.capacity < (eta + 2) * self.B:  # rows in flight must never lap unconsumed ones
            raise ValueError(f"train.buffer_capacity={buffer.capacity} is too small for AReaL: need at least "
                             f"(max_staleness + 2) x batch = {(eta + 2) * self.B} rows")
        c = self.cfg
        success = None if c.success_rate_lb is None and c.success_rate_ub is None else (
            -math.inf if c.success_rate_lb is None else c.success_rate_lb,
            math.inf if c.success_rate_ub is None else c.success_rate_ub)
        batch = buffer.pop_oldest(self.B, max_staleness=eta, current_version=version, success=success,
                                  group_size=self.n)
        filtered = getattr(buffer, "n_filtered", 0)
        if batch is not None:
            self._filtered_at_batch = filtered
        elif filtered - self._filtered_at_batch >= 4 * self.B and not self._warned_filter:
            self._warned_filter = True  # the run is not stuck: it waits for a group the filter keeps
            log.warning("areal.success_rate_lb/ub: the last %d answers were dropped by their group's success rate "
                        "(every answer of the prompt failed, or every one passed) and no batch was made since: the "
                        "run waits for groups whose mean reward is in [%s, %s]; widen the bounds or set them to "
                        "none if the task is too hard or too easy for the model", filtered - self._filtered_at_batch,
                        c.success_rate_lb, c.success_rate_ub)
        return batch

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
        c = self.cfg
        r = shaped_reward(batch.reward, c.reward_bias, c.reward_scaling, c.max_reward_clip)
        n_tok = batch.loss_mask.sum(1)
        if c.adv_norm == "batch_tokens":
            return token_normalised_advantages(r, n_tok)
        keep = n_tok > 0  # rows mask_too_long took out of the loss take no part in the statistics
        adv = torch.zeros_like(r)
        if keep.any():
            adv[keep] = (group_normalised_advantages(r[keep], batch.group_id[keep]) if c.adv_norm == "group"
                         else batch_normalised_advantages(r[keep]))
        return adv

    def minibatches(self, model, batch: Batch, step: int) -> list[Batch]:
        if self.cfg.mask_too_long and "finish" in batch.extra:  # cut at the token limit: out of the loss
            cut = batch.extra["finish"] == FINISH_REASONS.index("length")
            batch.loss_mask = batch.loss_mask & ~cut[:, None].to(batch.loss_mask.device)
            self._cut = int(cut.sum())
        batch.extra["prox_logp"] = self.proximal_logp(model, batch)
        batch.extra["advantages"] = adv = self.advantages(batch)  # (B,)
        self._batch_stats = {**behaviour_stats(batch.extra["prox_logp"], batch.behav_logp, batch.loss_mask,
                                               self.cfg.behav_imp_weight_cap),
                             "adv_abs": adv.abs().mean().item()}
        if "same_weights" in batch.extra:  # the proximal pass runs the weights that sampled those tokens
            self._batch_stats.update(mismatch_stats(batch.extra["prox_logp"], batch.behav_logp,
                                                    batch.extra["same_weights"] & batch.loss_mask))
        if self.cfg.mask_too_long:
            self._batch_stats["masked_too_long"] = getattr(self, "_cut", 0)
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
            stop = self._early_stop(lp, mb)
            if not stop:
                (loss * w).backward()
            accumulate(totals, w, loss, {**st, "early_stopped": float(stop)} if self.cfg.early_stop_imp_ratio else st)
        # the behaviour-weight stats describe the whole batch (prox and behav are fixed for the step):
        # they replace the loss's own per-micro-batch ones of the same names
        return {**rank_sum_stats(totals), **self._batch_stats}

    @torch.no_grad()
    def _early_stop(self, lp: torch.Tensor, mb: Batch) -> bool:
        """Whether the micro-batch's mean u = pi_theta/pi_prox over its valid tokens exceeds
        `early_stop_imp_ratio` (AReaL: its loss times 0, the step's other micro-batches go on)."""
        r = self.cfg.early_stop_imp_ratio
        if r is None:
            return False
        m = mb.loss_mask.bool()
        u = torch.where(m, lp.detach() - mb.extra["prox_logp"], torch.zeros_like(lp)).exp()
        return bool((u * m).sum() / m.sum().clamp(min=1) > r)
