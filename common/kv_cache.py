"""Slot-based static KV cache for the sampler (generator processes).

One K and one V tensor per layer, (max_batch, Hkv, max_seq_len, hd), allocated once; a slot
is one row. Owned by one `Sampler` in one process: no locking. Decode reads the prefix of
rows 0..B-1 as a view (no gather), which is why the sampler hands out the lowest free slot.
"""
from __future__ import annotations

import torch

from common.model import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_batch: int, max_seq_len: int, dtype, device):
        shape = (max_batch, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self._pos_range = torch.arange(max_seq_len, device=device)
        self.attend_len = 0  # set per decode step: columns 0..attend_len-1 are read
        self.mask = None     # (B, 1, 1, attend_len) bool: column j visible to row b iff j <= pos[b]

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Share a prefilled prompt: copy the first `length` positions of slot src into dst."""
        if not dst:
            return
        idx = torch.tensor(dst, device=self.k[0].device)
        for k, v in zip(self.k, self.v):
            k[idx, :, :length] = k[src, :, :length]
            v[idx, :, :length] = v[src, :, :length]

    def prepare_decode(self, input_pos: torch.Tensor) -> None:
        """Set the attention window and mask shared by every layer of one decode step."""
        S = int(input_pos.max()) + 1
        self.attend_len = S
        self.mask = (self._pos_range[:S].unsqueeze(0) <= input_pos.unsqueeze(1))[:, None, None, :]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
