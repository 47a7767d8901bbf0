"""Static KV cache with shared prompts for the sampler (generator processes), and the attention
of its prefill passes.

Two stores per layer, allocated once (Hkv key/value heads, hd head dim):
  prefix  (max_prefixes, Hkv, max_prompt_len, hd): one entry per request, its prompt's K/V,
          shared by all n samples of that request (RL samples n per prompt);
  slots   (max_batch, Hkv, max_seq_len, hd): one row per in-flight sample, the K/V of its
          generated tokens only, stored from column 0.
A sample at absolute position P + t (P prompt tokens, t generated) keeps its own key t in its
slot; RoPE uses the absolute position. Decode attention (`common/engine/sampler/decode_attention.py`) is
the exact merge (`common/engine/model/attention.py`) of
  - the prompt part: the live samples of each entry, with their query heads, attend together
    as n*(H/Hkv) query rows against the entry's prompt, so a shared prompt is read once per
    step instead of n times (BENCHMARKS.md, "Sampler"), and
  - the own part: each sample against its slot's generated tokens.
Memory: ((max_batch + 1) x max_prompt_len + max_batch x max_seq_len) positions per layer, each
2 x Hkv x hd values (K and V); pass the longest prompt as max_prompt_len (the generators, the
eval and the benchmark do), else it defaults to max_seq_len - 1 and the prompt store is as big
as the slots. Owned by one `Sampler` in one process: no locking. The sampler keeps live slots
and entries at the lowest indices (`LiveBatch._compact`, common/engine/sampler/live_batch.py), so decode reads rows 0..B-1 and
entries 0..E-1 as views (no gather of K/V).

Prefill runs `Transformer.hidden(..., cache=self)` after the sampler sets a mode, and every
layer's attention calls `attend`:
  begin_prompts(entries)           prefill b prompts (right-padded, causal) into prefix entries;
  begin_continuations(slots, ...)  prefill tokens that follow each slot's prompt into the slots
                                   (re-prefill after a weight update), b slots at once.
A decode step writes and reads the stores itself (`common/engine/sampler/decode_model.py`).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from common.engine.model.attention import additive_mask, attend_lse, merge
from common.engine.kv.transfer import to_device


def _move(stores: list[torch.Tensor], src: list[int], dst: list[int], length: int) -> None:
    """Copy rows src[i]'s first `length` columns to rows dst[i] in every (L, rows, Hkv, cols, hd)
    store: one gather and one scatter per store for all moves and layers (src and dst disjoint)."""
    if not src:
        return
    dev = stores[0].device
    s, d = to_device(src, dev), to_device(dst, dev)  # non-blocking: a step may be in flight (inflight.py)
    for t in stores:
        t[:, d, :, :length] = t[:, s, :, :length]


class KVCache:
    def __init__(self, cfg, max_batch: int, max_seq_len: int, dtype, device, max_prompt_len: int | None = None,
                 max_prefixes: int | None = None):
        Hkv, hd, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.max_prompt_len = max_prompt_len or max_seq_len
        # a request waiting for free slots can hold an entry with no live sample: +1
        self.max_prefixes = max_prefixes or max_batch + 1
        pshape = (L, self.max_prefixes, Hkv, self.max_prompt_len, hd)
        sshape = (L, max_batch, Hkv, max_seq_len, hd)
        # one tensor per store, all layers: compaction moves rows of every layer with one copy;
        # each layer's attention works on its view
        self.stores = [torch.zeros(shape, dtype=dtype, device=device) for shape in (pshape, pshape, sshape, sshape)]
        self.pk, self.pv, self.k, self.v = ([t[i] for i in range(L)] for t in self.stores)
        self.dtype, self.device = dtype, device
        self.G = cfg.num_attention_heads // Hkv  # query heads per key/value head
        self.mode = None
        self.room = np.full(max_batch, max_seq_len + 1, dtype=np.int64)  # own tokens a slot holds: all, always

    # ------------------------------------------------------------------ modes (set by the sampler)
    def begin_prompts(self, entries: torch.Tensor) -> None:
        """entries (b,) long: the prefix entry of each row of the next forward (prompts right-padded)."""
        self.mode, self.entries = "prompts", entries

    def begin_continuations(self, slots: torch.Tensor, entries: torch.Tensor, prompt_len: torch.Tensor, P: int) -> None:
        """slots, entries, prompt_len (b,) long: row i of the next forward holds tokens that follow
        entry entries[i]'s prompt of prompt_len[i] tokens (P >= every prompt_len), into slot slots[i]."""
        self.mode, self.slots, self.entries = "continuations", slots, entries
        cols = torch.arange(P, device=self.device)
        self.cont_mask = additive_mask((cols < prompt_len.unsqueeze(1))[:, None, None, :], self.dtype)  # (b,1,1,P)

    # ------------------------------------------------------------------ attention (called by every layer)
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, hd), k/v (B, Hkv, T, hd) of the current tokens -> attention output (B, H, T, hd).
        Attention runs in the cache's dtype (fp32 with bf16 weights where that is faster, see
        `common/engine/machine/precision.py`); the output goes back in q's dtype."""
        if q.dtype != self.dtype:
            dt = q.dtype
            return self.attend(layer, q.to(self.dtype), k.to(self.dtype), v.to(self.dtype)).to(dt)
        T = q.shape[2]
        if self.mode == "prompts":
            self.pk[layer][self.entries, :, :T] = k
            self.pv[layer][self.entries, :, :T] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.G > 1)
        if self.mode == "continuations":
            self.k[layer][self.slots, :, :T] = k
            self.v[layer][self.slots, :, :T] = v
            P = self.cont_mask.shape[-1]
            o_p, lse_p = attend_lse(q, self.pk[layer][self.entries, :, :P], self.pv[layer][self.entries, :, :P],
                                    self.cont_mask)  # a gather of each row's prompt: interrupts only
            o_s, lse_s = attend_lse(q, k, v, causal=True)
            return merge(o_p, lse_p, o_s, lse_s)
        raise RuntimeError("KVCache.attend called without begin_prompts / begin_continuations")

    # ------------------------------------------------------------------ compaction (sampler)
    def move_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Move samples' own K/V (their first `length` columns) from slots src[i] to dst[i]."""
        _move(self.stores[2:], src, dst, length)

    def move_entries(self, src: list[int], dst: list[int], length: int) -> None:
        """Move prompts' K/V (`length` columns) from prefix entries src[i] to dst[i]."""
        _move(self.stores[:2], src, dst, length)

    # ------------------------------------------------------------------ the paged cache's calls (`kv/paged_cache.py`)
    # Static slots hold every sample at full length from the start: nothing to take, nothing to give
    # back, never short, so the sampler's paging calls cost nothing here and never preempt.
    paged = False

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        pass

    def cost(self, prompt_tokens: int, own_tokens: int) -> int:
        return 0

    def has_room(self, pages: int, running: bool) -> bool:
        return True

    def open_entry(self, e: int, tokens: int) -> None:
        pass

    def close_entry(self, e: int) -> None:
        pass

    def close_slot(self, s: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def open_slot(self, s: int, e: int, own_tokens: int) -> None:
        pass

    def grow_slot(self, s: int, own_tokens: int) -> int:
        return 0

    def occupancy(self) -> float:
        return 1.0  # every slot's memory is committed up front

    # ------------------------------------------------------------------ a decode step's reads (`decode_attention.py`)
    def indices(self, own: torch.Tensor, B: int, S: int, E: int, P: int, group: bool = True):
        """(where row b writes its new K/V: its own column, no gather indices)."""
        return own, None

    def row_lengths(self, cols) -> None:
        pass  # the static cache's own part is a view of rows 0..B-1: nothing to group

    def decode_stores(self, layer: int):
        """What a decode step writes its new K/V into (`decode_model.attn_in`): the layer's K and V."""
        return self.k[layer], self.v[layer]

    def row_tokens(self, S: int, P: int) -> tuple[int, int]:
        """Tokens between two rows' starts in `decode_attention._token_major` (own, prompt)."""
        Hkv = self.k[0].shape[1]
        return Hkv * self.max_seq_len, Hkv * self.max_prompt_len

    def own_kv(self, layer: int, B: int, S: int, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..B-1's own K and V, columns 0..S-1: (B, Hkv, S, hd) views."""
        return self.k[layer][:B, :, :S], self.v[layer][:B, :, :S]

    def prompt_kv(self, layer: int, E: int, P: int, idx) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pk[layer][:E, :, :P], self.pv[layer][:E, :, :P]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stores)
