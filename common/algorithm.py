"""The trainer's hook: what an algorithm (tba/algo.py, areal/algo.py) gives the trainer each step.

The trainer (`common/runtime/trainer.py`, the trainer process) calls down into an `Algorithm`;
an algorithm never calls the runtime. It sees the replay buffer only through `BufferView`, the
reading side the trainer hands it:

    buffer.sample_tba_batch(...)  TBA: a batch of K responses for each of P prompt slots, mixed
                                  from the latest sync round and the whole buffer; not consumed
    buffer.pop_oldest(...)        AReaL / on-policy: the n oldest unconsumed rows within a
                                  staleness bound, consumed once (None until n are there)
    buffer.capacity               ring size in rows

One trainer step = next_batch, then for each of minibatches(...): zero_grad, backward, clip,
optimizer step; then the LR scheduler steps once and weights are published every k steps.
"""
from __future__ import annotations

from typing import Literal, Optional, Protocol

import torch

from common.batch import Batch


class BufferView(Protocol):
    """The replay buffer's members an algorithm may call (`common/runtime/buffer.py` implements them)."""
    capacity: int

    def sample_tba_batch(self, n_groups: int, k: int, m: float, latest_version: int,
                         mode: Literal["uniform", "reward"] = "uniform", inv_temp: float = 1.0,
                         generator: torch.Generator | None = None, max_per_group: int = 100) -> Batch: ...

    def pop_oldest(self, n: int, max_staleness: int | None, current_version: int) -> Batch | None: ...


class Algorithm:
    """What the trainer asks of an algorithm each step (subclassed by tba/algo.py, areal/algo.py)."""

    def next_batch(self, buffer: BufferView, step: int, version: int, sync: bool) -> Optional[Batch]:
        """Rows for this step, or None if the buffer cannot provide them yet."""
        raise NotImplementedError

    def minibatches(self, model, batch: Batch, step: int) -> list[Batch]:
        """The batches to make one optimizer step on each, in order; called once per step, before
        any update (AReaL computes its proximal log-probs here). Default: the whole batch once."""
        return [batch]

    def backward(self, model, batch: Batch, step: int) -> dict:
        """Accumulate gradients of one minibatch's loss into model; return scalar stats."""
        raise NotImplementedError
