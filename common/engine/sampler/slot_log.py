"""What the sampler's in-flight samples have generated so far, kept per slot in host arrays.

Runs inside the sampler's process (`common/engine/sampler/sampler.py`, one per generator). Each decode
step hands back one token and one log-prob per busy slot; appending them, stamping the policy
version and deciding which samples are finished (a stop token, or the sample's length limit)
are a few vectorised numpy operations over all slots instead of a Python loop over them, so the
host's share of a step stays small next to the device's (`bench/sampler.py --host-only`). A
sample's tokens become Python lists only once, when it finishes or is handed out partial.
Shapes: max_batch slots, max_seq_len columns.
"""
from __future__ import annotations

import numpy as np


class SlotLog:
    def __init__(self, max_batch: int, max_seq_len: int):
        self.tok = np.zeros((max_batch, max_seq_len), dtype=np.int64)
        self.logp = np.zeros((max_batch, max_seq_len), dtype=np.float64)
        self.ver = np.zeros((max_batch, max_seq_len), dtype=np.int64)
        self.count = np.zeros(max_batch, dtype=np.int64)   # tokens generated so far
        self.limit = np.zeros(max_batch, dtype=np.int64)   # finished ("length") when count reaches it
        self.stops = np.full((max_batch, 1), -1, dtype=np.int64)  # stop ids per slot, -1 padded

    def start(self, slot: int, limit: int, stop_ids) -> None:
        """A new sample in `slot`: at most `limit` tokens, ends early on any of `stop_ids`."""
        stop_ids = list(stop_ids)
        if len(stop_ids) > self.stops.shape[1]:  # widen the table for a request with more stop ids
            pad = np.full((self.stops.shape[0], len(stop_ids) - self.stops.shape[1]), -1, dtype=np.int64)
            self.stops = np.concatenate((self.stops, pad), axis=1)
        self.stops[slot] = -1
        self.stops[slot, :len(stop_ids)] = stop_ids
        self.count[slot], self.limit[slot] = 0, limit

    def append(self, slots: np.ndarray, tok: np.ndarray, logp: np.ndarray, version: int) -> tuple[np.ndarray, np.ndarray]:
        """Record one token per slot in `slots` (k,); returns (finished (k,) bool, stopped (k,) bool):
        a finished sample drew a stop token (stopped) or reached its limit."""
        col = self.count[slots]
        self.tok[slots, col], self.logp[slots, col], self.ver[slots, col] = tok, logp, version
        self.count[slots] = col + 1
        stopped = (self.stops[slots] == tok[:, None]).any(1)
        return stopped | (col + 1 >= self.limit[slots]), stopped

    def tokens(self, slot: int) -> list[int]:
        return self.tok[slot, :self.count[slot]].tolist()

    def fill(self, slot: int, out) -> None:
        """Write the slot's tokens, log-probs and versions into its `Completion`."""
        n = self.count[slot]
        out.tokens, out.logp, out.versions = (self.tok[slot, :n].tolist(), self.logp[slot, :n].tolist(),
                                             self.ver[slot, :n].tolist())

    def save(self, slot: int) -> tuple:
        """A copy of the slot's sample (tokens, log-probs, versions so far, its limit and stop ids), to
        `restore` in another slot later (a preempted sample: `common/engine/sampler/preempt.py`)."""
        n = self.count[slot]
        return (self.tok[slot, :n].copy(), self.logp[slot, :n].copy(), self.ver[slot, :n].copy(), int(self.limit[slot]),
                [int(t) for t in self.stops[slot] if t >= 0])

    def restore(self, slot: int, saved: tuple) -> None:
        tok, logp, ver, limit, stops = saved
        self.start(slot, limit, stops)
        n = len(tok)
        self.tok[slot, :n], self.logp[slot, :n], self.ver[slot, :n], self.count[slot] = tok, logp, ver, n

    def move(self, src: list[int], dst: list[int]) -> None:
        """Samples move from slots src[i] to dst[i] (the sampler's compaction; disjoint sets)."""
        n = int(self.count[src].max())
        for a in (self.tok, self.logp, self.ver):
            a[dst, :n] = a[src, :n]
        for a in (self.count, self.limit, self.stops):
            a[dst] = a[src]
