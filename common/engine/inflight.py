"""Host <-> device transfers that never make the sampler's host wait, and a decode step in flight.

Runs inside the sampler's process (`common/engine/sampler.py`). On a GPU a decode step (one CUDA
graph replay) runs while the host goes on; the host waits only where it reads the step's tokens.
Without overlap it reads them at once, so the device idles while the host records them and
plans and launches the next step. With `Sampler(overlap=True)` the host launches step t+1
before it reads step t's tokens, and records t while the device computes t+1 (one step of lag):

  launch t+1 (queued behind t)   | device: ... t | t+1 | ...
  read t, record t, plan t+2     | host:   ...   | record t, plan | launch t+2 | record t+1 ...

Why the lag changes no sample. A sample's tokens depend only on the weights, its prompt and
its own counter-based uniforms (`sampling.py`), not on which step or row computes them; rows
are independent. A sample that finished at step t (the host learns it when it records t) is
computed once more at t+1: its row writes its pending token into its own slot's next column
(in bounds: that column is < its length limit) and the token drawn is dropped, because by the
time t+1 is recorded its `Seq` no longer holds the slot (`LiveBatch._collect` matches rows to
samples by identity, not by slot). Every device write of the host (admission, compaction, the
plan, freeing a row) is queued on the one stream behind the step in flight, so it lands after
that step as it would without overlap. What changes: a freed slot is refilled a step later,
and compaction copies one more cache column (the one the step in flight writes).

Copies to the device go through pinned host memory, non-blocking: a pageable copy would make
the host wait for the device to finish everything queued, the step in flight included.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of `values` on `device` without waiting for the device: on CUDA from pinned
    memory, non-blocking (PyTorch's pinned allocator keeps the block until the copy has run)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class HostRing:
    """`n` host buffers (pinned on CUDA) taken in turn for non-blocking copies to or from the
    device. A buffer is handed out again only after the copy that last used it has run (its
    event), so a copy still queued behind a step in flight never sees its source rewritten."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device, n: int = 2):
        self.cuda = torch.device(device).type == "cuda"
        self.bufs = [torch.zeros(shape, dtype=dtype, pin_memory=self.cuda) for _ in range(n)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(n)]
        self.next = 0

    def take(self) -> int:
        """The index of a buffer free to write (waits for its last copy, normally long done)."""
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        self.wait(i)
        return i

    def mark(self, i: int) -> None:
        """Buffer i's copy has been queued: record the point the device passes when it has run."""
        if self.cuda:
            self.events[i].record()

    def wait(self, i: int) -> None:
        if self.cuda:
            self.events[i].synchronize()  # an event never recorded returns at once


@dataclass
class Launched:
    """A decode step queued on the device, waiting to be recorded: its rows' tokens and
    log-probs arrive in the first 2 x hi values of `ring.bufs[buf]` (flat: 2 x max_batch)."""
    ring: HostRing
    buf: int
    hi: int                # rows 0..hi-1 were computed
    busy_np: np.ndarray    # the busy slots at launch (numpy, for indexing the output)
    busy: list[int]
    seqs: list             # the `Seq` in each busy slot at launch, in order
    epoch: int             # the live batch's epoch at launch: unchanged = no sample started, ended or moved
    host: torch.Tensor | None = None  # on the CPU: the step's own output, already on the host

    @classmethod
    def send(cls, ring: HostRing, out: torch.Tensor, hi: int, **kw) -> "Launched":
        """Queue the copy of a step's output (2, >= hi) to the host (non-blocking on CUDA)."""
        if not ring.cuda:  # a CPU step returns a tensor of its own (never a graph's reused output)
            return cls(ring, -1, hi, host=out[:, :hi], **kw)
        i = ring.take()
        # into a contiguous prefix of the flat buffer: a copy into a strided host view would go
        # through a pageable temporary, which makes the host wait
        ring.bufs[i][:2 * hi].view(2, hi).copy_(out[:, :hi], non_blocking=True)
        ring.mark(i)
        return cls(ring, i, hi, **kw)

    def result(self) -> torch.Tensor:
        """(2, hi) host tensor: the step's tokens and log-probs (waits for the step on CUDA)."""
        if self.host is not None:
            return self.host
        self.ring.wait(self.buf)
        return self.ring.bufs[self.buf][:2 * self.hi].view(2, self.hi)
