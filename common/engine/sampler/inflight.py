"""Host <-> device transfers that never make the sampler's host wait, and sampled tokens in flight.

Runs inside the sampler's process (`common/engine/sampler/sampler.py`). On a GPU a decode step (one CUDA
graph replay) runs while the host goes on; the host waits only where it reads sampled tokens.
Without overlap it reads them at once, so the device idles while the host records them and
plans and launches the next step. With `Sampler(overlap=True)` the host launches step t+1
before it reads step t's tokens, and records t while the device computes t+1 (one step of lag):

  launch t+1 (queued behind t)   | device: ... t | t+1 | ...
  read t, record t, plan t+2     | host:   ...   | record t, plan | launch t+2 | record t+1 ...

Admission works the same way: the prompts' prefill and the new samples' first tokens are queued,
step t+1 (which already decodes those samples) is launched behind them, and only then does the
host read the first tokens. So the device never waits for the host's bookkeeping, whether
samples start, end or move.

Why the lag changes no sample. A sample's tokens depend only on the weights, its prompt and
its own counter-based uniforms (`sampling.py`), not on which step or row computes them; rows
are independent. A sample that finished at step t (the host learns it when it records t) is
computed once more at t+1: its row writes its pending token into its own slot's next column
(in bounds: that column is < its length limit) and the token drawn is dropped, because by the
time t+1 is recorded its `Seq` no longer holds the slot (`LiveBatch._collect` matches rows to
samples by identity, not by slot). Every device write of the host (admission, compaction, the
plan, freeing a row) is queued on the one stream behind the step in flight, so it lands after
that step as it would without overlap. What changes: a freed slot is refilled a step later,
and a step attends one more cache column, compaction copies one more (the one the step in
flight writes; a new sample's first token, recorded after the step that writes it).

Copies to the device go through pinned host memory, non-blocking (common/engine/kv/transfer.py:
`to_device`): a pageable copy would make the host wait for the device to finish everything
queued, the step in flight included.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class HostRing:
    """`n` host buffers (pinned on CUDA) taken in turn for non-blocking copies to or from the
    device. A buffer is handed out again only after the copy that last used it has run (its
    event), so a copy still queued behind a step in flight never sees its source rewritten; with
    `reads=True` (copies from the device) also only after the host has read it, checked: taking
    a buffer still unread is a bug of the caller's, not something to wait for."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device, n: int = 2, reads: bool = False):
        self.cuda = torch.device(device).type == "cuda"
        self.bufs = [torch.zeros(shape, dtype=dtype, pin_memory=self.cuda) for _ in range(n)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(n)]
        self.host = [b.numpy() for b in self.bufs]  # the same memory
        self.unread = [False] * n if reads else None
        self.next = 0

    def take(self) -> int:
        """The index of a buffer free to write (waits for its last copy, normally long done)."""
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.unread is not None:
            if self.unread[i]:
                raise RuntimeError(f"HostRing: buffer {i} of {len(self.bufs)} taken again before it was read")
            self.unread[i] = True
        self.wait(i)
        return i

    def mark(self, i: int) -> None:
        """Buffer i's copy has been queued: record the point the device passes when it has run."""
        if self.cuda:
            self.events[i].record()

    def wait(self, i: int) -> None:
        if self.cuda:
            self.events[i].synchronize()  # an event never recorded returns at once

    def read(self, i: int) -> np.ndarray:
        """Buffer i (as numpy: reading it runs no torch op) once its copy has run; it may be taken
        again after this."""
        self.wait(i)
        if self.unread is not None:
            self.unread[i] = False
        return self.host[i]


@dataclass
class Launched:
    """Sampled tokens queued on the device, waiting to be recorded on the host: a decode step's
    (one per busy slot) or the first tokens of newly admitted samples. Output column cols[j]
    holds slot slots[j]'s token and log-prob (sample seqs[j]'s, at launch)."""
    ring: HostRing
    buf: int
    n: int                 # output columns copied
    cols: np.ndarray       # the output column of each slot below
    slots: list[int]       # the slots at launch
    slots_np: np.ndarray
    seqs: list             # the `Seq` in each of those slots at launch
    epoch: int             # the live batch's epoch at launch: unchanged = no sample started, ended or moved

    @classmethod
    def send(cls, ring: HostRing, out: torch.Tensor, n: int, **kw) -> "Launched":
        """Queue the copy of `out[:, :n]` (2 rows: tokens, log-probs) to the host (non-blocking on CUDA)."""
        i = ring.take()
        # into a contiguous prefix of the flat buffer: a copy into a strided host view would go
        # through a pageable temporary, which makes the host wait
        ring.bufs[i][:2 * n].view(2, n).copy_(out[:, :n], non_blocking=ring.cuda)
        ring.mark(i)
        return cls(ring, i, n, **kw)

    def result(self) -> np.ndarray:
        """(2, n) float64: the tokens and log-probs (waits for them on CUDA). Read it once: the
        buffer may be taken again after, so index out of it (a copy) before anything is sent."""
        return self.ring.read(self.buf)[:2 * self.n].reshape(2, self.n)
