"""Reader-side sampling strategies over a metadata snapshot of the replay buffer.

Used only by the trainer process. Everything here is a pure function of a `BufferMeta`
(copied out of the shared ring under the buffer's lock by `ReplayBuffer.snapshot_meta`), so
it runs without holding any lock and is unit-testable without processes. The functions
return ring row indices; `ReplayBuffer` re-checks them under the lock and copies them out.

- `sample_tba`: TBA batch composition (a recent-round group with probability m, otherwise any
  group; K responses per group, de-duplicated on identical completions).
- `take_oldest` / `stale_rows`: AReaL FIFO consumption (each row used once) with a staleness bound.

Shapes: N = number of valid rows in the snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch


@dataclass
class BufferMeta:
    """Metadata columns of the N valid ring rows; entry i describes ring row `rows[i]`."""
    rows: np.ndarray             # (N,) int64 ring row index
    insert_idx: np.ndarray       # (N,) int64 global insertion counter (larger = newer)
    group_id: np.ndarray         # (N,) int64 prompt id
    reward: np.ndarray           # (N,) float32
    trainer_version: np.ndarray  # (N,) int64 trainer version when the row was added
    min_version: np.ndarray      # (N,) int64 oldest policy version among the completion tokens
    max_version: np.ndarray      # (N,) int64 newest policy version among the completion tokens
    comp_hash: np.ndarray        # (N,) int64 hash of the completion tokens (de-duplication)
    consumed: np.ndarray         # (N,) bool, AReaL: already trained on (or dropped as stale)
    n_added: int = 0             # total rows ever added, read together with the columns

    def __len__(self) -> int:
        return self.rows.shape[0]


def _groups_newest_first(meta: BufferMeta, max_per_group: int) -> dict[int, np.ndarray]:
    """group_id -> positions into `meta`, newest first, one per distinct completion (the newest
    copy), at most `max_per_group` of them."""
    order = np.lexsort((-meta.insert_idx, meta.group_id))  # by group, newest first inside it
    gids = meta.group_id[order]
    starts = np.flatnonzero(np.r_[True, gids[1:] != gids[:-1]])
    ends = np.r_[starts[1:], len(order)]
    out = {}
    for s, e in zip(starts, ends):
        pos = order[s:e]
        # np.unique's return_index gives the first occurrence = the newest copy of each completion
        _, first = np.unique(meta.comp_hash[pos], return_index=True)
        out[int(gids[s])] = pos[np.sort(first)][:max_per_group]
    return out


def _pick_group(ids: list[int], picks: dict[int, int], generator) -> int:
    """Uniform among the least-picked groups of `ids`: cycles through groups before repeating one."""
    fewest = min(picks.get(g, 0) for g in ids)
    cand = [g for g in ids if picks.get(g, 0) == fewest]
    return cand[int(torch.randint(len(cand), (), generator=generator))]


def sample_tba(meta: BufferMeta, n_groups: int, k: int, m: float, latest_version: int,
               mode: Literal["uniform", "reward"] = "uniform", inv_temp: float = 1.0,
               generator: torch.Generator | None = None, max_per_group: int = 100) -> list[int]:
    """TBA batch composition: `n_groups` slots of `k` rows each; returns n_groups*k ring rows,
    each slot's k rows contiguous and from one group (prompt).

    A slot is "recent" with probability m: it takes a group that has rows added at
    `trainer_version == latest_version` (i.e. since the latest weight sync) and its k newest such
    rows. Otherwise (or when no recent row exists) it takes any group and k of its rows, uniformly
    or with probability softmax(inv_temp * reward). Groups are cycled (least-picked first) so a
    batch repeats a prompt only once all present prompts have been used. Within a group only
    the newest copy of each distinct completion and the newest `max_per_group` of those count;
    with fewer than k distinct rows the slot samples with replacement.
    """
    if len(meta) == 0:
        raise ValueError("sample_tba: the buffer has no rows")
    if mode not in ("uniform", "reward"):
        raise ValueError(f"sample_tba: mode={mode!r}, expected 'uniform' or 'reward'")
    if not 0.0 <= m <= 1.0 or n_groups < 1 or k < 1 or max_per_group < 1:
        raise ValueError(f"sample_tba: need 0<=m<=1, n_groups>=1, k>=1, max_per_group>=1 "
                         f"(got m={m}, n_groups={n_groups}, k={k}, max_per_group={max_per_group})")
    groups = _groups_newest_first(meta, max_per_group)
    recent = {g: p[meta.trainer_version[p] == latest_version] for g, p in groups.items()}
    recent = {g: p for g, p in recent.items() if len(p)}  # still newest first
    all_ids, recent_ids = sorted(groups), sorted(recent)
    picks: dict[int, int] = {}
    out: list[int] = []
    for _ in range(n_groups):
        # draw the coin even when no recent group exists so the RNG stream doesn't depend on it
        if float(torch.rand((), generator=generator)) < m and recent_ids:
            g = _pick_group(recent_ids, picks, generator)
            pos = recent[g][:k]
            if len(pos) < k:  # fewer distinct recent rows than k: fill uniformly with replacement
                fill = torch.randint(len(pos), (k - len(pos),), generator=generator).numpy()
                pos = np.r_[pos, pos[fill]]
        else:
            g = _pick_group(all_ids, picks, generator)
            cand = groups[g]
            if mode == "reward":  # float64: a large inv_temp must not overflow before softmax
                w = torch.softmax(inv_temp * torch.from_numpy(meta.reward[cand]).double(), 0)
            else:
                w = torch.ones(len(cand), dtype=torch.float64)
            idx = torch.multinomial(w, k, replacement=len(cand) < k, generator=generator).numpy()
            pos = cand[idx]
        picks[g] = picks.get(g, 0) + 1
        out.extend(meta.rows[pos].tolist())
    return out


def _stale(meta: BufferMeta, max_staleness: int | None, current_version: int) -> np.ndarray:
    """(N,) bool: rows whose oldest completion token is more than max_staleness versions old."""
    if max_staleness is None:
        return np.zeros(len(meta), dtype=bool)
    return meta.min_version < current_version - max_staleness


def off_success(meta: BufferMeta, group_size: int, lb: float, ub: float) -> np.ndarray:
    """(N,) bool: rows of groups whose mean reward is below lb or above ub (AReaL's success-rate
    filter: a prompt all of whose answers failed, or all passed, teaches nothing). A group is the
    `group_size` rows a generator added at once: consecutive insertion indices, insert_idx // n."""
    _, inv = np.unique(meta.insert_idx // group_size, return_inverse=True)
    mean = np.bincount(inv, weights=meta.reward.astype(np.float64)) / np.bincount(inv)
    return ((mean < lb) | (mean > ub))[inv]


def take_oldest(meta: BufferMeta, n: int, max_staleness: int | None, current_version: int,
                skip: np.ndarray | None = None) -> list[int]:
    """AReaL: up to n ring rows, oldest insertion first, that are not consumed, not stale and not
    in `skip` ((N,) bool). May return fewer than n; the caller decides whether that is enough."""
    ok = ~meta.consumed & ~_stale(meta, max_staleness, current_version)
    ok = np.flatnonzero(ok & ~skip if skip is not None else ok)
    ok = ok[np.argsort(meta.insert_idx[ok], kind="stable")][:n]
    return meta.rows[ok].tolist()


def stale_rows(meta: BufferMeta, max_staleness: int | None, current_version: int) -> list[int]:
    """Unconsumed rows that `take_oldest` skips as too stale: the caller marks them consumed
    so they are dropped for good (staleness only grows as the trainer version advances)."""
    return meta.rows[~meta.consumed & _stale(meta, max_staleness, current_version)].tolist()
