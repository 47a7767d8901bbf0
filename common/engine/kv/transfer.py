"""Small host-to-device copies that never make the host wait: the index lists a KV cache's page
tables, slot moves and row masks are written from (their device copies belong to the cache that
holds them), and the sampler's rows alike (common/engine/sampler/inflight.py: a decode step may be in
flight on the device while the host plans the next). Runs in the sampler's process.
"""
from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `values` (a list, or a list of equal-length lists) on `device` without waiting for
    the device: on CUDA from pinned memory, non-blocking (PyTorch's pinned allocator keeps the
    block until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
