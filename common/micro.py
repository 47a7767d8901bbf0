"""Dynamic micro-batching under a padded-token budget (trainer process).

First-fit-decreasing (AReaL): sort items by length, longest first; put each into the
micro-batch with the fewest rows that still fits the budget, opening a new one when none
fits. An item is a single row, or a whole group of rows (TBA's per-prompt log Z needs every
response of its group in one micro-batch; see tba/algo.py). The cost of a micro-batch is
what a right-padded tensor costs: rows x longest row.
"""
from __future__ import annotations

import torch

from common.batch import Batch


def pack_ffd(items: list[tuple[int, int]], token_budget: int) -> list[list[int]]:
    """items[i] = (rows, max_len). Returns lists of item indices, one list per micro-batch.
    An item larger than the budget on its own gets a micro-batch of its own."""
    order = sorted(range(len(items)), key=lambda i: -items[i][1])
    bins: list[tuple[list[int], int, int]] = []  # (item ids, rows, max_len)
    for i in order:
        rows, length = items[i]
        best = None
        for b, (_, r, L) in enumerate(bins):
            if (r + rows) * max(L, length) <= token_budget and (best is None or r < bins[best][1]):
                best = b
        if best is None:
            bins.append(([i], rows, length))
        else:
            ids, r, L = bins[best]
            bins[best] = (ids + [i], r + rows, max(L, length))
    return [ids for ids, _, _ in bins]


def micro_batches(batch: Batch, token_budget: int, group_aligned: bool = False) -> list[torch.Tensor]:
    """Row-index tensors partitioning `batch` into micro-batches (see module docstring)."""
    lengths = (batch.prompt_lens + batch.comp_lens).tolist()
    if group_aligned:
        groups: dict[int, list[int]] = {}
        for r, g in enumerate(batch.group_id.tolist()):
            groups.setdefault(g, []).append(r)
        members = list(groups.values())
    else:
        members = [[r] for r in range(len(batch))]
    items = [(len(m), max(lengths[r] for r in m)) for m in members]
    return [torch.tensor(sorted(r for i in ids for r in members[i])) for ids in pack_ffd(items, token_budget)]
