"""Shared-memory ring replay buffer: generator processes write trajectories, the trainer reads.

Processes: the launcher builds one `ReplayBuffer` and passes it as an argument to its
`torch.multiprocessing` (spawn) children. Pickling at spawn time carries the shared-memory
tensors by handle (not copies) and a spawn-context Lock, so every process sees the same ring.
Many writers (generators: `add`) and ONE reader (trainer: `get`, `snapshot_meta`,
`sample_tba_batch`, `pop_oldest`, `save`, `stats`).

Memory: every column is allocated once in `__init__` (C = capacity rows, L = max_seq_len) and
never reallocated, so the handles held by children stay valid. Row r of every column describes
the same trajectory; per-token columns are target-aligned like `common.contracts.batch.Batch`. Rows fill
0, 1, ..., C-1 and then wrap, overwriting the oldest; `insert_idx == -1` marks a never-written row.

Concurrency rules:
- ONE lock guards all columns and the `n_added` counter. A writer holds it for a whole `add`
  (reserve rows by bumping n_added + copy pre-built staging rows in); the reader holds it while
  copying rows / metadata out or marking rows consumed. Each critical section is a few memcpys
  of at most (n, L) elements, so a single coarse lock costs little and makes torn rows
  impossible by construction (no per-row seqlocks needed).
- Nothing slow runs under the lock: validation, hashing, staging, `Batch` building, sampling
  decisions and disk I/O all happen outside it.
- The reader chooses rows on an unlocked snapshot, so a writer may overwrite a chosen row before
  the copy; the copy re-checks `insert_idx` under the lock and re-samples on a mismatch.
- `n_added` / `len` read without the lock are a single aligned int64 load: fine as a hint.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Callable, Literal

import numpy as np
import torch
import torch.multiprocessing as mp  # importing it registers the shared-tensor pickling reducers

from common.contracts.batch import FINISH_REASONS, Batch, Trajectory
from common.runtime.shared.buffer_file import read_buffer_file
from common.runtime.shared.buffer_sampling import BufferMeta, off_success, sample_tba, stale_rows, take_oldest

# the saved format's name, from before common/runtime/: kept so that old buffers load
_FORMAT = "common.buffer.ReplayBuffer/v1"
_INT32_MAX = 2**31 - 1
# name -> (per-token column?, dtype, value of an empty row; None = pad_id)
_COLUMNS = {
    "tokens": (True, torch.int32, None),         # (C, L) prompt + completion, pad_id after
    "behav_logp": (True, torch.float32, 0.0),    # (C, L) sampler log-prob of tokens[r, t]
    "versions": (True, torch.int32, -1),         # (C, L) version that sampled tokens[r, t]
    "prompt_len": (False, torch.int64, 0),
    "comp_len": (False, torch.int64, 0),
    "reward": (False, torch.float32, 0.0),
    "group_id": (False, torch.int64, 0),
    "ref_seq_logp": (False, torch.float32, math.nan),
    "finish": (False, torch.int8, 0),            # index into FINISH_REASONS
    "min_version": (False, torch.int64, -1),     # of the completion tokens
    "max_version": (False, torch.int64, -1),
    "trainer_version": (False, torch.int64, -1),  # version passed to add: generators pass the oldest weights version that sampled the group
    "insert_idx": (False, torch.int64, -1),      # global insertion counter, -1 = empty row
    "comp_hash": (False, torch.int64, 0),
    "consumed": (False, torch.bool, False),      # AReaL: used (or dropped) once
}
_META = ("insert_idx", "group_id", "reward", "trainer_version", "min_version", "max_version",
         "comp_hash", "consumed")
_BATCH = ("prompt_len", "comp_len", "reward", "group_id", "ref_seq_logp", "finish", "insert_idx")


def completion_hash(tokens: torch.Tensor) -> int:
    """Deterministic (unsalted, same in every process) signed 64-bit hash of a token sequence."""
    data = tokens.detach().cpu().numpy().astype("<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _empty_columns(n: int, L: int, pad_id: int) -> dict[str, torch.Tensor]:
    return {name: torch.full((n, L) if per_tok else (n,), pad_id if fill is None else fill, dtype=dt)
            for name, (per_tok, dt, fill) in _COLUMNS.items()}


class ReplayBuffer:
    """Fixed-capacity shared-memory ring of trajectories (see the module doc for the rules)."""

    def __init__(self, capacity: int, max_seq_len: int, pad_id: int = 0):
        if capacity < 1 or max_seq_len < 1:
            raise ValueError(f"ReplayBuffer: capacity={capacity} and max_seq_len={max_seq_len} must be >= 1")
        self.capacity, self.max_seq_len, self.pad_id = int(capacity), int(max_seq_len), int(pad_id)
        self.cols = {k: v.share_memory_() for k, v in _empty_columns(self.capacity, self.max_seq_len, self.pad_id).items()}
        self._n_added = torch.zeros(1, dtype=torch.int64).share_memory_()  # (1,) total ever added
        self._lock = mp.get_context("spawn").Lock()
        self.n_dropped_stale = 0  # reader-side count of rows `pop_oldest` dropped as too stale (this process)
        self.n_filtered = 0  # and of rows it dropped by their group's success rate (AReaL's filter)

    # ---------------------------------------------------------------- writers
    def _stage(self, trajs: list[Trajectory], trainer_version: int) -> dict[str, torch.Tensor]:
        """Validate every trajectory and build its full row (padding included, so an overwritten
        row keeps no leftovers). Raises before anything touches the shared ring."""
        L = self.max_seq_len
        st = _empty_columns(len(trajs), L, self.pad_id)
        scal = {k: [] for k in ("prompt_len", "comp_len", "reward", "group_id", "ref_seq_logp", "finish",
                                "min_version", "max_version", "comp_hash")}
        for i, t in enumerate(trajs):
            where = f"ReplayBuffer.add: trajectory {i} (group_id {t.group_id})"
            p, c = t.prompt.numel(), t.completion.numel()
            if p == 0:
                raise ValueError(f"{where}: empty prompt (prompt must have at least 1 token)")
            if p + c > L:
                raise ValueError(f"{where}: prompt+completion length {p + c} > max_seq_len {L}")
            if not math.isfinite(float(t.reward)):
                raise ValueError(f"{where}: reward is {float(t.reward)}, must be finite")
            if c and not torch.isfinite(t.logp).all():
                raise ValueError(f"{where}: logp contains NaN/inf")
            seq = torch.cat([t.prompt.reshape(-1), t.completion.reshape(-1)])
            if seq.min() < 0 or seq.max() > _INT32_MAX:
                raise ValueError(f"{where}: token ids must lie in [0, {_INT32_MAX}]")
            if c and (t.versions.min() < 0 or t.versions.max() > _INT32_MAX):
                raise ValueError(f"{where}: versions must lie in [0, {_INT32_MAX}]")
            st["tokens"][i, :p + c] = seq
            st["behav_logp"][i, p:p + c] = t.logp.reshape(-1).float()
            st["versions"][i, p:p + c] = t.versions.reshape(-1).to(torch.int32)
            for k, v in (("prompt_len", p), ("comp_len", c), ("reward", float(t.reward)),
                         ("group_id", int(t.group_id)), ("ref_seq_logp", float(t.ref_seq_logp)),
                         ("finish", FINISH_REASONS.index(t.finish_reason)),
                         # an empty completion has no token versions: date it by the trainer's
                         ("min_version", int(t.versions.min()) if c else trainer_version),
                         ("max_version", int(t.versions.max()) if c else trainer_version),
                         ("comp_hash", completion_hash(t.completion))):
                scal[k].append(v)
        for k, v in scal.items():
            st[k] = torch.tensor(v, dtype=st[k].dtype)
        st["trainer_version"].fill_(trainer_version)
        del st["insert_idx"]  # assigned under the lock, when rows are reserved
        return st

    def add(self, trajs: list[Trajectory], trainer_version: int = 0) -> None:
        """Append trajectories (all or nothing), overwriting the oldest rows when full."""
        if not trajs:
            return
        st, n = self._stage(trajs, int(trainer_version)), len(trajs)
        skip = max(0, n - self.capacity)  # more rows than the ring holds: only the last C survive
        st = {k: v[skip:] for k, v in st.items()}
        with self._lock:
            start = int(self._n_added[0])
            idx = torch.arange(start + skip, start + n)  # (n - skip,) insertion counters
            rows = idx % self.capacity
            for k, v in st.items():
                self.cols[k][rows] = v
            self.cols["insert_idx"][rows] = idx
            self._n_added[0] = start + n

    def add_rows(self, cols: dict[str, torch.Tensor]) -> None:
        """Append whole rows another buffer gave out with `take_rows` (a generator node's groups,
        common/runtime/nodes/trajectories.py), in their order, as `add` would have (all or nothing)."""
        n = len(cols["reward"])
        T = cols["tokens"].shape[1]
        if T > self.max_seq_len or set(cols) != set(_COLUMNS) - {"insert_idx", "consumed"}:
            raise ValueError(f"ReplayBuffer.add_rows: columns {sorted(cols)} of {T} tokens do not fit this buffer")
        st = _empty_columns(n, self.max_seq_len, self.pad_id)
        for k, v in cols.items():
            (st[k][:, :T] if v.dim() == 2 else st[k]).copy_(v)
        with self._lock:
            start = int(self._n_added[0])
            idx = torch.arange(start, start + n)[-self.capacity:]
            rows = idx % self.capacity
            for k in cols:
                self.cols[k][rows] = st[k][-len(rows):]
            self.cols["insert_idx"][rows] = idx
            self.cols["consumed"][rows] = False
            self._n_added[0] = start + n

    def take_rows(self, start: int) -> tuple[dict[str, torch.Tensor], int]:
        """The rows added since insertion counter `start`, oldest first, trimmed to the longest
        (every column but insert_idx and consumed), and the counter after them."""
        with self._lock:
            end = int(self._n_added[0])
            if end - start > self.capacity:
                raise RuntimeError(f"ReplayBuffer.take_rows: {end - start} rows since {start} but the ring holds "
                                   f"{self.capacity}: they were overwritten before they were taken")
            rows = torch.arange(start, end) % self.capacity
            T = int((self.cols["prompt_len"][rows] + self.cols["comp_len"][rows]).max()) if end > start else 0
            out = {k: (v[rows, :T] if v.dim() == 2 else v[rows]) for k, v in self.cols.items()
                   if k not in ("insert_idx", "consumed")}
        return out, end

    # ---------------------------------------------------------------- reader
    @property
    def n_added(self) -> int:
        return int(self._n_added[0])

    def __len__(self) -> int:
        return min(self.n_added, self.capacity)  # rows fill in order and are never freed

    def _meta_locked(self) -> BufferMeta:
        n_added = int(self._n_added[0])
        n = min(n_added, self.capacity)  # valid rows are exactly 0..n-1
        return BufferMeta(rows=np.arange(n, dtype=np.int64), n_added=n_added,
                          **{k: self.cols[k][:n].clone().numpy() for k in _META})

    def snapshot_meta(self) -> BufferMeta:
        """Metadata of all valid rows, copied under the lock."""
        with self._lock:
            return self._meta_locked()

    def _copy_locked(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy rows out (trimmed to the longest selected row). Caller holds the lock."""
        T = int((self.cols["prompt_len"][rows] + self.cols["comp_len"][rows]).max())
        out = {k: self.cols[k][rows, :T] for k in ("tokens", "behav_logp", "versions")}
        out.update({k: self.cols[k][rows] for k in _BATCH})  # advanced indexing => copies
        return out

    def _to_batch(self, c: dict[str, torch.Tensor]) -> Batch:
        empty = (c["insert_idx"] < 0).nonzero().flatten()
        if len(empty):
            raise ValueError(f"ReplayBuffer.get: {len(empty)} selected row(s) are empty (never written)")
        t = torch.arange(c["tokens"].shape[1])  # (T,)
        p, n = c["prompt_len"][:, None], c["comp_len"][:, None]  # (B, 1)
        return Batch(tokens=c["tokens"].long(), loss_mask=(t >= p) & (t < p + n),
                     behav_logp=c["behav_logp"], versions=c["versions"].long(), reward=c["reward"],
                     group_id=c["group_id"], prompt_lens=c["prompt_len"], comp_lens=c["comp_len"],
                     ref_seq_logp=c["ref_seq_logp"], extra={"finish": c["finish"].long()})

    def _rows(self, rows) -> torch.Tensor:
        r = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if len(r) == 0:
            raise ValueError("ReplayBuffer: empty selection of rows")
        if r.min() < 0 or r.max() >= self.capacity:
            raise IndexError(f"ReplayBuffer: row index out of range [0, {self.capacity})")
        return r

    def get(self, rows) -> Batch:
        """The given ring rows as a `Batch` (equal to `collate` of the stored trajectories)."""
        r = self._rows(rows)
        with self._lock:
            c = self._copy_locked(r)
        return self._to_batch(c)

    def _read(self, choose: Callable[[BufferMeta], tuple[list[int], list[int]]], consume: bool,
              retries: int = 4) -> Batch | None:
        """choose(meta) -> (rows to copy out, rows to only mark consumed). Decides on an unlocked
        snapshot, then (under the lock, if none of the chosen rows was overwritten meanwhile)
        copies `take` out and, when `consume`, marks both lists consumed. After `retries` misses
        it decides under the lock: slower for writers, but progress is guaranteed even when
        writers lap a tiny ring. Returns None when `take` is empty."""
        for attempt in range(retries + 1):
            locked = attempt == retries
            if not locked:
                meta = self.snapshot_meta()
                take, drop = choose(meta)
                seen = np.full(self.capacity, -1, dtype=np.int64)  # ring row -> insert_idx we chose
                seen[meta.rows] = meta.insert_idx
                chosen = torch.tensor(take + drop, dtype=torch.long)
                expect = torch.from_numpy(seen[chosen.numpy()])
            with self._lock:
                if locked:
                    take, drop = choose(self._meta_locked())
                    chosen = torch.tensor(take + drop, dtype=torch.long)
                elif not torch.equal(self.cols["insert_idx"][chosen], expect):
                    continue  # a writer overwrote a chosen row: decide again on a fresh snapshot
                if consume:
                    self.cols["consumed"][chosen] = True
                c = self._copy_locked(torch.tensor(take, dtype=torch.long)) if take else None
            return None if c is None else self._to_batch(c)

    def sample_tba_batch(self, n_groups: int, k: int, m: float, latest_version: int,
                         mode: Literal["uniform", "reward"] = "uniform", inv_temp: float = 1.0,
                         generator: torch.Generator | None = None, max_per_group: int = 100) -> Batch:
        """TBA: a `Batch` of n_groups*k rows composed by `sample_tba` (rows are not consumed)."""
        choose = lambda meta: (sample_tba(meta, n_groups, k, m, latest_version, mode, inv_temp,
                                          generator, max_per_group), [])
        return self._read(choose, consume=False)

    def pop_oldest(self, n: int, max_staleness: int | None, current_version: int,
                   success: tuple[float, float] | None = None, group_size: int = 1) -> Batch | None:
        """AReaL: the n oldest unconsumed, fresh-enough rows in insertion order, marked consumed;
        None when fewer than n are available. Rows too stale are marked consumed (dropped), and with
        `success` = (lb, ub) so are the groups (of `group_size` rows) whose mean reward is outside
        [lb, ub] (`off_success`, counted in `n_filtered`)."""
        dropped: list[int] = []
        filtered: list[int] = []
        def choose(meta):  # the last decision is the one applied
            off = off_success(meta, group_size, *success) if success else None
            take = take_oldest(meta, n, max_staleness, current_version, skip=off)
            dropped[:] = stale_rows(meta, max_staleness, current_version)
            # a stale row is counted once, as stale
            filtered[:] = [] if off is None else sorted(set(meta.rows[~meta.consumed & off].tolist()) - set(dropped))
            return (take if len(take) == n else []), dropped + filtered
        batch = self._read(choose, consume=True)
        self.n_dropped_stale += len(dropped)
        self.n_filtered += len(filtered)
        return batch

    # ---------------------------------------------------------------- persistence / monitoring
    def save(self, path) -> None:
        """One `torch.save` file: constructor args, counters and all columns (a consistent copy)."""
        with self._lock:  # clone under the lock, write to disk outside it
            state = {"format": _FORMAT, "capacity": self.capacity, "max_seq_len": self.max_seq_len,
                     "pad_id": self.pad_id, "n_added": int(self._n_added[0]),
                     "cols": {k: v.clone() for k, v in self.cols.items()}}
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a crash mid-save never leaves a truncated checkpoint

    @classmethod
    def load(cls, path, capacity: int | None = None, max_seq_len: int | None = None) -> "ReplayBuffer":
        """A fresh shared buffer with the saved contents (and the saved capacity / max_seq_len), the
        file checked before the ring is allocated (common/runtime/shared/buffer_file.py: a `BufferFileError`
        naming it); `capacity`, `max_seq_len`: the sizes it must have (None: any)."""
        state = read_buffer_file(path, _FORMAT, _COLUMNS, capacity, max_seq_len)
        buf = cls(state["capacity"], state["max_seq_len"], state["pad_id"])
        for k, col in buf.cols.items():
            col.copy_(state["cols"][k])
        buf._n_added[0] = state["n_added"]
        return buf

    def stats(self) -> dict:
        """Fill, counters, mean reward and trainer-version histogram of the valid rows."""
        meta = self.snapshot_meta()
        vers, counts = np.unique(meta.trainer_version, return_counts=True)
        return {"fill": len(meta) / self.capacity, "size": len(meta), "n_added": meta.n_added,
                "n_unconsumed": int((~meta.consumed).sum()),
                "mean_reward": float(meta.reward.mean()) if len(meta) else math.nan,
                "version_hist": {int(v): int(c) for v, c in zip(vers, counts)}}
