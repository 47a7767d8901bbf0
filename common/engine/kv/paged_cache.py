"""Paged KV cache for the sampler (generator processes): memory follows the tokens that are live,
not `max_batch x max_seq_len`.

The K/V of every layer live in one pool of fixed-size pages (`kv_pages.PagePool` says which are
free and who holds them). The sampler keeps the static cache's two roles (`kv/static_cache.py`): prompt
entries, whose K/V all n samples of a request share, and slots, one per in-flight sample, holding
its generated tokens from column 0. Here both are page tables instead of tensor rows:
  prompt_table (max_prefixes, prompt_pages)  physical page of each ps-token block of a prompt;
  own_table    (max_batch, own_pages)        the same for a slot's own tokens;
a sample's host table is a `fork` of its prompt's (shared pages, refcount 1 + n while the prompt
is live) followed by pages of its own, taken as it generates. Physical page 0 is scratch, never
handed out: every unused table entry points at it, so padding written by a prefill and the rows a
step computes for idle slots land there and never in a page somebody holds.

Layout: per layer K and V as (tokens, Hkv, hd), token t of page p at p * ps + t (token-major).
Token i of a table's row is at table[i // ps] * ps + i % ps. A decode step (`decode_attention.py`)
turns the tables into flat indices once (`indices`), writes each row's new K/V at one of them
(`decode_model.attn_in`), and per layer gathers rows 0..B-1's first S own columns and entries
0..E-1's first P prompt columns (`own_kv`, `prompt_kv`): (B, Hkv, S, hd) views of one contiguous
gather, what the static cache's views give, so attention runs the same code on them. Everything a
step reads is a device tensor at a fixed address (tables, indices): a CUDA graph can capture it.

Host changes to the tables (pages taken, samples moved by compaction) are written to the device
rows in one copy by `flush`, which the sampler calls before each decode step and a prefill does
itself. Owned by one `Sampler` in one process: no locking.
"""
from __future__ import annotations

import numpy as np
import torch

from common.engine.model.attention import additive_mask, attend_lse, merge
from common.engine.kv.transfer import to_device
from common.engine.kv.pages import PagePool, PageTable


# admission leaves this share of the pages free while samples run: a higher one admits fewer rows but
# preempts (and re-prefills) less; under AReaL-like lengths 0.1 keeps 90% of the rows of 0.01 at a
# third of its re-prefill (BENCHMARKS.md, "Long outputs")
WATERMARK = 0.1


class PagedKVCache:
    paged = True

    def __init__(self, cfg, max_batch: int, max_seq_len: int, dtype, device, kv_tokens: int, page_size: int,
                 max_prompt_len: int | None = None, max_prefixes: int | None = None, watermark: float = WATERMARK):
        """kv_tokens: the pool's budget in tokens (whole pages); watermark: the fraction of pages that
        admission leaves free while samples run, so that those can grow without preempting at once."""
        Hkv, hd, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        self.max_batch, self.max_seq_len, self.ps = max_batch, max_seq_len, page_size
        self.max_prompt_len = max_prompt_len or max_seq_len
        self.max_prefixes = max_prefixes or max_batch + 1
        self.pool = PagePool.for_tokens(kv_tokens, page_size)
        self.watermark = int(watermark * self.pool.n_pages)
        n_tok = (self.pool.n_pages + 1) * page_size  # + the scratch page 0
        # K and V of a token side by side: one gather reads both (two per layer and step, not four)
        self.stores = [torch.zeros((L, n_tok, 2, Hkv, hd), dtype=dtype, device=device)]
        self.kv = [self.stores[0][i] for i in range(L)]                   # (tokens, 2, Hkv, hd) per layer
        self.k, self.v = [t[:, 0] for t in self.kv], [t[:, 1] for t in self.kv]  # (tokens, Hkv, hd) views
        long = dict(dtype=torch.long, device=device)
        # own columns go up to max_seq_len - 1, and one more under overlap (`inflight.py`)
        self.own_table = torch.zeros(max_batch, self.pool.pages_for(max_seq_len + 1), **long)
        self.prompt_table = torch.zeros(self.max_prefixes, self.pool.pages_for(self.max_prompt_len), **long)
        self.slot_pages: list[PageTable | None] = [None] * max_batch
        self.room = np.zeros(max_batch, dtype=np.int64)  # own tokens each slot's pages hold (host)
        self.entry_pages: list[PageTable | None] = [None] * self.max_prefixes
        self._dirty: tuple[set, set] = (set(), set())  # slots, entries whose device rows are stale
        self.dtype, self.device = dtype, torch.device(device)
        self.G = cfg.num_attention_heads // Hkv
        self.mode = None

    # ------------------------------------------------------------------ pages (host; the sampler calls these)
    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """ValueError with the numbers if one sample could never fit the pool (`kv_pages.sample_kv_tokens`)."""
        self.pool.check_fits(prompt_tokens, max_new_tokens)

    def cost(self, prompt_tokens: int, own_tokens: int) -> int:
        """Pages that opening a prompt of `prompt_tokens` (0: already open) and a slot of `own_tokens` take."""
        return self.pool.pages_for(prompt_tokens) + self.pool.pages_for(own_tokens)

    def has_room(self, pages: int, running: bool) -> bool:
        """Whether `pages` can be taken now, keeping the watermark back while samples run."""
        return self.pool.can_take(pages, self.watermark if running else 0)

    def open_entry(self, e: int, tokens: int) -> None:
        t = PageTable(self.pool)
        t.grow(tokens)
        self.entry_pages[e] = t
        self._dirty[1].add(e)

    def close_entry(self, e: int) -> None:
        """The request no longer needs its prompt entry: its own hold of the pages ends (samples
        still running keep theirs)."""
        if self.entry_pages[e] is not None:
            self.entry_pages[e].release()
            self.entry_pages[e] = None
            self._dirty[1].add(e)

    def open_slot(self, s: int, e: int, own_tokens: int) -> None:
        """A sample in slot s over entry e's prompt, with room for `own_tokens` own tokens."""
        t = self.entry_pages[e].fork()
        try:
            t.grow(own_tokens)
        except BaseException:
            t.release()
            raise
        self.slot_pages[s] = t
        self.room[s] = self._room(t)
        self._dirty[0].add(s)

    def grow_slot(self, s: int, own_tokens: int) -> int:
        """Room for `own_tokens` own tokens in slot s: the pages that takes (0 if it had room).
        PoolExhausted (nothing taken) if the pool cannot give them."""
        t = self.slot_pages[s]
        need = own_tokens - t.own_tokens()
        if need <= 0:
            return 0
        n = len(t.grow(need))
        if n:
            self.room[s] = self._room(t)
            self._dirty[0].add(s)
        return n

    def _room(self, t: PageTable) -> int:
        return (len(t.pages) - t.shared) * self.ps

    def close_slot(self, s: int) -> None:
        if self.slot_pages[s] is not None:
            self.slot_pages[s].release()
            self.slot_pages[s] = None
            self.room[s] = 0
            self._dirty[0].add(s)

    def occupancy(self) -> float:
        return self.pool.occupancy()

    def flush(self) -> None:
        """Write the stale device table rows (one copy per table; non-blocking: a step may be in flight)."""
        for table, pages, dirty in ((self.own_table, self.slot_pages, self._dirty[0]),
                                    (self.prompt_table, self.entry_pages, self._dirty[1])):
            if not dirty:
                continue
            rows = sorted(dirty)
            W = table.shape[1]
            vals = []
            for r in rows:
                t = pages[r]
                own = [] if t is None else [p + 1 for p in t.pages[t.shared:]]  # + 1: page 0 is scratch
                vals.append(own + [0] * (W - len(own)))
            table[to_device(rows, self.device)] = to_device(vals, self.device)
            dirty.clear()

    # ------------------------------------------------------------------ compaction (sampler)
    def move_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Samples move from slots src[i] to dst[i]: their page tables move, no K/V is copied."""
        for s, d in zip(src, dst):
            self.slot_pages[d], self.slot_pages[s] = self.slot_pages[s], None
            self.room[d], self.room[s] = self.room[s], 0
            self._dirty[0].update((s, d))

    def move_entries(self, src: list[int], dst: list[int], length: int) -> None:
        for s, d in zip(src, dst):
            self.entry_pages[d], self.entry_pages[s] = self.entry_pages[s], None
            self._dirty[1].update((s, d))

    # ------------------------------------------------------------------ flat token indices (device)
    def _flat(self, table: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """table (b, W) pages, cols (b, T) columns -> (b, T) flat token indices."""
        return table.gather(1, torch.div(cols, self.ps, rounding_mode="floor")) * self.ps + cols % self.ps

    def row_lengths(self, cols: np.ndarray) -> None:
        """Host, before a step: the own columns each of rows 0..hi-1 attends (the sampler's counts).
        On a CPU the own part then reads rows grouped by length (`own_groups`), each group up to its
        longest row instead of every row up to the batch's longest; not under CUDA graphs (a
        step's shapes must not depend on host values there)."""
        self._lens = cols if self.device.type == "cpu" else None

    def own_groups(self, B: int, S: int) -> list | None:
        """Rows 0..B-1 in groups of similar own length: [(rows (b,) device, gather indices (b*S_g,), S_g)],
        one group per power of two of the length (all up to 64 together), each within 2x of its rows'
        lengths; None where that would not read under 0.7x the columns of one (B, S) block."""
        lens = getattr(self, "_lens", None)
        if lens is None or len(lens) > B:
            return None
        lens = np.concatenate((lens, np.ones(B - len(lens), dtype=np.int64)))  # rows past the live ones: idle
        bucket = np.maximum(np.ceil(np.log2(np.maximum(lens, 1))), 6)
        parts = [np.nonzero(bucket == b)[0] for b in np.unique(bucket)]
        if len(parts) < 2 or sum(len(r) * int(lens[r].max()) for r in parts) > 0.7 * B * S:
            return None
        out = []
        for r in parts:
            S_g, rows = int(lens[r].max()), to_device(r.tolist(), self.device)
            cols = torch.arange(S_g, device=self.device).expand(len(r), S_g)
            out.append((rows, self._flat(self.own_table[rows], cols).reshape(-1), S_g))
        return out

    def indices(self, own: torch.Tensor, B: int, S: int, E: int, P: int, group: bool = True):
        """A decode step's indices, shared by its layers: where row b writes its new K/V (B,), and
        the gathers of rows 0..B-1's own columns 0..S-1 (B*S,) (or, on a CPU, of the rows grouped by
        length: `own_groups`, where `group`: the dense path) and entries 0..E-1's prompts (E*P,)."""
        dev = own.device
        write = self._flat(self.own_table[:B], own.unsqueeze(1)).squeeze(1)
        groups = self.own_groups(B, S) if group else None
        own_idx = None if groups else \
            self._flat(self.own_table[:B], torch.arange(S, device=dev).expand(B, S)).reshape(-1)
        prompt_idx = self._flat(self.prompt_table[:E], torch.arange(P, device=dev).expand(E, P)).reshape(-1)
        return write, (own_idx, prompt_idx, groups)

    def decode_stores(self, layer: int):
        """What a decode step writes its new K/V into (`decode_model.attn_in`): the layer's
        (tokens, 2, Hkv, hd) store, K and V together (one write; separate views of one storage
        would be two aliased inputs to a compiled graph), and None."""
        return self.kv[layer], None

    def row_tokens(self, S: int, P: int) -> tuple[int, int]:
        """Tokens between two rows' starts in `decode_attention._token_major`: a gather is contiguous."""
        return S, P

    def own_kv(self, layer: int, B: int, S: int, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..B-1's own K and V, columns 0..S-1: (B, Hkv, S, hd) views of one gather each."""
        return self._gather(layer, idx[0], B, S)

    def prompt_kv(self, layer: int, E: int, P: int, idx) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gather(layer, idx[1], E, P)

    def group_kv(self, layer: int, idx: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One `own_groups` group's K and V: (rows, Hkv, cols, hd) views of one gather."""
        return self._gather(layer, idx, rows, cols)

    def _gather(self, layer: int, idx: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens idx (rows*cols,) as (rows, Hkv, cols, hd) views of one contiguous gather."""
        kv = self.kv[layer].index_select(0, idx).unflatten(0, (rows, cols))  # (rows, cols, 2, Hkv, hd)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    # ------------------------------------------------------------------ prefill modes (as `KVCache`)
    def begin_prompts(self, entries: torch.Tensor) -> None:
        """entries (b,) long: the prefix entry of each row of the next forward (prompts right-padded)."""
        self.flush()
        self.mode, self.entries = "prompts", entries

    def begin_continuations(self, slots: torch.Tensor, entries: torch.Tensor, prompt_len: torch.Tensor, P: int) -> None:
        """Row i of the next forward holds tokens that follow entry entries[i]'s prompt of
        prompt_len[i] tokens (P >= every prompt_len), into slot slots[i] from column 0."""
        self.flush()
        self.mode, self.slots = "continuations", slots
        cols = torch.arange(P, device=self.device)
        self.cont_prompt = self._flat(self.prompt_table[entries], cols.expand(len(entries), P)).reshape(-1)
        self.cont_mask = additive_mask((cols < prompt_len.unsqueeze(1))[:, None, None, :], self.dtype)  # (b,1,1,P)

    def _write(self, layer: int, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v (b, Hkv, T, hd) of tokens 0..T-1 of each row into the pages of `table` (b, W) (padding
        past a row's pages goes to the scratch page)."""
        b, _, T, _ = k.shape
        idx = self._flat(table, torch.arange(T, device=self.device).expand(b, T)).reshape(-1)
        self.kv[layer][idx] = torch.stack((k, v), 2).transpose(1, 3).reshape(b * T, 2, *k.shape[1:2], k.shape[-1])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, hd), k/v (B, Hkv, T, hd) of the current tokens -> attention output (B, H, T, hd),
        in the cache's dtype (as `KVCache.attend`)."""
        if q.dtype != self.dtype:
            dt = q.dtype
            return self.attend(layer, q.to(self.dtype), k.to(self.dtype), v.to(self.dtype)).to(dt)
        if self.mode == "prompts":
            self._write(layer, self.prompt_table[self.entries], k, v)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                                                    enable_gqa=self.G > 1)
        if self.mode == "continuations":
            self._write(layer, self.own_table[self.slots], k, v)
            b, P = q.shape[0], self.cont_mask.shape[-1]
            pk, pv = self._gather(layer, self.cont_prompt, b, P)
            o_p, lse_p = attend_lse(q, pk, pv, self.cont_mask)
            o_s, lse_s = attend_lse(q, k, v, causal=True)
            return merge(o_p, lse_p, o_s, lse_s)
        raise RuntimeError("PagedKVCache.attend called without begin_prompts / begin_continuations")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stores)
