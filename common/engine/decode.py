"""One decode step of the sampler as a function of device tensors, and its CUDA-graph capture.

Runs inside one process (a generator), called by `common/engine/sampler.py`. `decode_step`
advances rows 0..B-1 of the continuous batch by one token: the pending token of each row goes
through the model and the KV cache (`KVCache.begin_decode`), the last hidden state is scaled by
1 / T_eff before the head, a token is drawn with the row's counter-based uniform
(`common/engine/sampling.py`), and the rows' pending token and position advance in place. It
reads nothing back to the host, and its shapes are Python ints chosen by the caller:
  eager (CPU; CUDA without graphs): the live sizes, recomputed every step;
  captured (`GraphedDecode`, CUDA): one `torch.cuda.CUDAGraph` per bucket: B rounded up to a
    power of two, E = B + 1 prompt entries, n (query rows per entry) rounded up to a power of
    two, S and P the cache's capacity; replayed on the same buffers. Any larger shape gives the
    same result (masked columns and padded rows contribute exact zeros / are never read), so the
    captured step computes what the eager one does, and CPU tests check its numerics.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from common.engine.sampling import inv_temperature, sample, uniforms


@dataclass
class Rows:
    """Per-slot state the sampler keeps on the device, one row per slot, updated in place (a
    captured graph reads these exact tensors). The entry plan (q_rows, back, entry_plen) maps
    slots to their shared prompt entries (`KVCache.begin_decode`); the sampler rewrites it when
    a sample starts, ends or moves."""
    tok: torch.Tensor          # (max_batch,) long: pending token (sampled, not yet in the cache)
    pos: torch.Tensor          # (max_batch,) long: its absolute position
    plen: torch.Tensor         # (max_batch,) long: prompt length (pos - plen = the slot's column)
    active: torch.Tensor       # (max_batch,) bool: a live sample (idle rows compute at position 0)
    inv_t: torch.Tensor        # (max_batch,) float: 1 / T_eff, applied to the head's input
    greedy: torch.Tensor       # (max_batch,) bool: T = 0
    top_k: torch.Tensor        # (max_batch,) long, 0 = off
    top_p: torch.Tensor        # (max_batch,) float, 1 = off
    key: torch.Tensor          # (max_batch,) long: the sample's random-number key
    q_rows: torch.Tensor       # (max_prefixes * max_batch,) long: first E*n used
    back: torch.Tensor         # (max_batch,) long
    entry_plen: torch.Tensor   # (max_prefixes,) long

    PER_SLOT = ("tok", "pos", "plen", "active", "inv_t", "greedy", "top_k", "top_p", "key")

    @classmethod
    def allocate(cls, max_batch: int, max_prefixes: int, device) -> "Rows":
        long = dict(dtype=torch.long, device=device)
        return cls(tok=torch.zeros(max_batch, **long), pos=torch.zeros(max_batch, **long),
                   plen=torch.zeros(max_batch, **long), active=torch.zeros(max_batch, dtype=torch.bool, device=device),
                   inv_t=torch.ones(max_batch, device=device), greedy=torch.zeros(max_batch, dtype=torch.bool, device=device),
                   top_k=torch.zeros(max_batch, **long), top_p=torch.ones(max_batch, device=device),
                   key=torch.zeros(max_batch, **long), q_rows=torch.zeros(max_prefixes * max_batch, **long),
                   back=torch.zeros(max_batch, **long), entry_plen=torch.zeros(max_prefixes, **long))

    def per_slot(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if f.name in self.PER_SLOT]

    def start(self, slots: list[int], prompt_len: list[int], params: list, keys: torch.Tensor) -> torch.Tensor:
        """Set up `slots` for new samples (their prompts' lengths, SamplingParams, random keys);
        returns the slots as a device index tensor. The first token is the caller's to set."""
        dev = self.tok.device
        rows = torch.tensor(slots, device=dev)
        temp = torch.tensor([p.temperature for p in params], device=dev)
        self.pos[rows] = self.plen[rows] = torch.tensor(prompt_len, device=dev)
        self.inv_t[rows], self.greedy[rows] = inv_temperature(temp), temp <= 0
        self.top_k[rows] = torch.tensor([p.top_k for p in params], device=dev)
        self.top_p[rows] = torch.tensor([p.top_p for p in params], device=dev, dtype=self.top_p.dtype)
        self.key[rows] = keys
        self.active[rows] = True
        return rows

    def write_plan(self, entry_of_row: list[int], prompt_len: list[int], n: int) -> None:
        """The entry plan for rows 0..B-1 (B = len(entry_of_row); -1 = idle) and entries 0..E-1
        (E = len(prompt_len)) with n query rows each: query row e*n + i is the i-th live sample of
        entry e (padding: row 0), and row b reads its prompt part from query row back[b]."""
        B, E = len(entry_of_row), len(prompt_len)
        e = torch.tensor(entry_of_row)                            # built on the host, copied once
        rows = torch.nonzero(e >= 0).squeeze(1)
        ent, order = torch.sort(e[rows], stable=True)             # live rows grouped by entry, in row order
        rows = rows[order]
        counts = torch.bincount(ent, minlength=E)
        i = torch.arange(len(rows)) - (counts.cumsum(0) - counts)[ent]  # rank of the row within its entry
        slot = ent * n + i
        q_rows, back = torch.zeros(E * n, dtype=torch.long), torch.zeros(B, dtype=torch.long)
        q_rows[slot], back[rows] = rows, slot
        dev = self.back.device
        self.q_rows[:E * n] = q_rows.to(dev)
        self.back[:B] = back.to(dev)
        self.entry_plen[:E] = torch.tensor(prompt_len, device=dev)


def decode_step(model, cache, rows: Rows, B: int, E: int, n: int, S: int, P: int,
                any_filtered: bool, any_greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance rows 0..B-1 by one token; returns the new tokens (B,) and their log-probs (B,).
    E entries with n query rows each must match the entry plan in `rows`; S > every slot column
    of a live row, P >= every live prompt (module docstring)."""
    active = rows.active[:B]
    pos = torch.where(active, rows.pos[:B], 0)
    own = torch.where(active, pos - rows.plen[:B], 0)  # idle rows write garbage at their column 0
    cache.begin_decode(own, rows.entry_plen[:E], rows.q_rows[:E * n], rows.back[:B], S, P, n)
    h = model.hidden(rows.tok[:B, None], cache=cache, pos=pos[:, None], max_pos=cache.max_seq_len)[:, -1]  # (B, D)
    scaled = model.lm_head(h * rows.inv_t[:B].to(h.dtype).unsqueeze(1))  # (B, V) = logits / T_eff
    u = uniforms(rows.key[:B], own + 1)  # token own + 1 of the sample (token 0 came from the prefill)
    tok, logp = sample(scaled, rows.greedy[:B], rows.top_k[:B], rows.top_p[:B], u, any_filtered, any_greedy)
    rows.tok[:B] = torch.where(active, tok, rows.tok[:B])
    rows.pos[:B] += active
    return tok, logp


def bucket(x: int, cap: int) -> int:
    """x rounded up to a power of two, at most cap."""
    return min(cap, 1 << max(0, x - 1).bit_length())


def captured_shape(B: int, n: int, max_batch: int, max_prefixes: int) -> tuple[int, int, int]:
    """(rows, entries, query rows per entry) of the graph that runs a step over B live rows with
    groups of up to n: few distinct graphs, each valid for every schedule that fits it."""
    Bb = bucket(B, max_batch)
    return Bb, min(Bb + 1, max_prefixes), bucket(n, Bb)


class GraphedDecode:
    """`decode_step` captured as one CUDA graph per (rows, group width, filtered, greedy) bucket,
    as gpt-fast and nano-vllm do. The first step of a bucket runs eagerly on a side stream (it
    warms cuBLAS and the allocator, builds the RoPE table, and is a real step), then the graph is
    captured (capture runs nothing) and every later step of that bucket is one replay."""

    def __init__(self, model, cache, rows: Rows):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the sampler's cache is on {cache.device}")
        self.model, self.cache, self.rows = model, cache, rows
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool: buckets never run at once

    def __call__(self, B: int, E: int, n: int, any_filtered: bool, any_greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_step` at a `captured_shape` (B, E, n) and the cache's full S and P."""
        args = (self.model, self.cache, self.rows, B, E, n, self.cache.max_seq_len, self.cache.max_prompt_len,
                any_filtered, any_greedy)
        key = (B, E, n, any_filtered, any_greedy)
        if key in self.graphs:
            g, tok, logp = self.graphs[key]
            g.replay()
            return tok, logp
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tok, logp = decode_step(*args)  # the real step, eagerly: warm-up before capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):  # records kernels, runs none: the state stays as the step left it
            out = decode_step(*args)
        self.graphs[key] = (g, *out)
        return tok, logp
