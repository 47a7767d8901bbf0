"""Dynamic micro-batching under a token budget, and how micro-batches are shared among the
trainer's ranks (trainer processes).

First-fit-decreasing (AReaL): sort items by length, longest first; put each into the
micro-batch with the fewest rows that still fits the budget, opening a new one when none
fits. An item is a single row, or a whole group of rows (TBA's per-prompt log Z needs every
response of its group in one micro-batch; see tba/algo.py). The cost of a micro-batch is
what the model runs: rows x longest row for right-padded rows, the sum of the rows' lengths when
the model packs them end to end (`packs_rows`: `train.pack_rows`, common/engine/model/packing.py).

Ranks (`--train.trainer_devices=N`): every rank runs the algorithm's code on the whole batch,
so every weight an algorithm derives from the batch (a micro-batch's share of rows or tokens)
is already global; `micro_batches` keeps only this rank's share of the micro-batches. The
runtime (`common/runtime/ranks/share.py`) installs a `Ranks` that does so in every trainer rank and
pads the ranks with fewer micro-batches with zero-loss passes, because every rank of a
sharded model must run the same number of forward/backward passes. What an algorithm adds up
over its micro-batches is then this rank's part of the total: `rank_sum` / `rank_sum_stats`
complete it (with one rank they return their argument).
"""
from __future__ import annotations

import torch

from common.contracts.batch import Batch


class Ranks:
    """One rank: every micro-batch is this rank's, sums are the values themselves. The runtime
    installs a subclass in each trainer rank while N > 1 (`common/runtime/ranks/share.py`)."""

    def share(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's micro-batches out of `parts` (every rank's list is the same)."""
        return parts

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks (called by every rank at the same point of the same code)."""
        return x

    def sum_stats(self, stats: dict) -> dict:
        """{key: float} summed over ranks, key by key (a key a rank lacks counts 0 there)."""
        return stats

    def end_backward(self) -> None:
        """After an optimizer update's backward, before its gradient norm: what the other ranks
        still need from this one (nothing with one rank)."""


_ranks = Ranks()


def set_ranks(ranks: Ranks) -> Ranks:
    """Install `ranks` for this process (the runtime does); returns the previous one."""
    global _ranks
    prev, _ranks = _ranks, ranks
    return prev


def rank_sum(x: torch.Tensor) -> torch.Tensor:
    """Complete a per-micro-batch result over the trainer's ranks: e.g. AReaL's proximal
    log-probs, each row filled by the one rank that ran its micro-batch (zeros elsewhere)."""
    return _ranks.sum(x)


def rank_sum_stats(stats: dict) -> dict:
    """Complete stats accumulated over this rank's micro-batches (weighted by their global
    shares) into the batch's stats."""
    return _ranks.sum_stats(stats)


def packs_rows(model) -> bool:
    """Whether `model` runs a micro-batch's rows packed end to end (its `pack_rows`): the cost
    `micro_batches(packed=)` counts."""
    return bool(getattr(model, "pack_rows", False))


def pack_ffd(items: list[tuple[int, ...]], token_budget: int, packed: bool = False) -> list[list[int]]:
    """items[i] = (rows, max_len) or (rows, max_len, tokens). Returns lists of item indices, one
    list per micro-batch, each costing at most `token_budget`: rows x longest row, or with
    `packed` the sum of its items' tokens (item i's tokens: rows x max_len when not given). An
    item larger than the budget on its own gets a micro-batch of its own."""
    order = sorted(range(len(items)), key=lambda i: -items[i][1])
    bins: list[tuple[list[int], int, int, int]] = []  # (item ids, rows, max_len, tokens)
    for i in order:
        rows, length, *n = items[i]
        n = n[0] if n else rows * length
        best = None
        for b, (_, r, L, N) in enumerate(bins):
            cost = N + n if packed else (r + rows) * max(L, length)
            if cost <= token_budget and (best is None or r < bins[best][1]):
                best = b
        if best is None:
            bins.append(([i], rows, length, n))
        else:
            ids, r, L, N = bins[best]
            bins[best] = (ids + [i], r + rows, max(L, length), N + n)
    return [ids for ids, _, _, _ in bins]


def micro_batches(batch: Batch, token_budget: int, group_aligned: bool = False,
                  packed: bool = False) -> list[torch.Tensor]:
    """Row-index tensors partitioning `batch` into micro-batches, this rank's share of them (see
    the module docstring); `packed`: the model packs rows (`packs_rows`), a micro-batch costs its
    real tokens."""
    lengths = (batch.prompt_lens + batch.comp_lens).tolist()
    if group_aligned:
        groups: dict[int, list[int]] = {}
        for r, g in enumerate(batch.group_id.tolist()):
            groups.setdefault(g, []).append(r)
        members = list(groups.values())
    else:
        members = [[r] for r in range(len(batch))]
    items = [(len(m), max(lengths[r] for r in m), sum(lengths[r] for r in m)) for m in members]
    parts = [torch.tensor(sorted(r for i in ids for r in members[i])) for ids in pack_ffd(items, token_budget, packed)]
    return _ranks.share(parts)
