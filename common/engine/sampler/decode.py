"""One decode step of the sampler as a function of device tensors, and its CUDA-graph capture.

Runs inside one process (a generator), called by `common/engine/sampler/sampler.py`. `decode_step`
advances rows 0..B-1 of the continuous batch by one token: the pending token of each row goes
through the decode model (`common/engine/sampler/decode_model.py`: merged projections, the layer body
compiled or eager, attention against the KV cache by `decode_attention.py`), the head's logits
are upcast and divided by T_eff in fp32 (as the trainer does), a token is drawn with the row's
counter-based uniform (`common/engine/sampler/sampling.py`), and the rows' pending token and position
advance in place. It reads nothing back to the host, and its shapes are Python ints chosen by
the caller (`Shape`):
  eager (CPU; CUDA without graphs): the live sizes, recomputed every step;
  captured (`GraphedDecode`, CUDA): one `torch.cuda.CUDAGraph` per bucket (`captured_shape`),
    replayed on the same buffers. Every dimension is bucketed on its own, from the live batch:
    rows B and entries E to a power of two, query rows per entry n and the cache columns S and
    P geometrically up to a grain, then in steps of it, so each stays within 2x its live size
    (a larger n or column count than needed only adds masked work). Any larger shape gives the
    same result (masked columns and padded rows contribute exact zeros / are never read), so
    the captured step computes what the eager one does, and CPU tests check its numerics.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from common.engine.kv.transfer import to_device
from common.engine.sampler.inflight import HostRing
from common.engine.sampler.sampling import effective_temperature


class Shape(NamedTuple):
    """The Python-int sizes of one decode step (`decode_step`, `KVCache.begin_decode`)."""
    B: int   # slot rows 0..B-1
    E: int   # prompt entries 0..E-1
    n: int   # query rows per entry
    S: int   # slot columns attended (> every live row's own column)
    P: int   # prompt columns attended (>= every live prompt)


@dataclass
class Rows:
    """Per-slot state the sampler keeps on the device, one row per slot, updated in place (a
    captured graph reads these exact tensors). The entry plan (q_rows, back, entry_plen: views
    of one device tensor, written by one copy) maps slots to their shared prompt entries
    (`KVCache.begin_decode`); the sampler rewrites it when a sample starts, ends or moves."""
    tok: torch.Tensor          # (max_batch,) long: pending token (sampled, not yet in the cache)
    pos: torch.Tensor          # (max_batch,) long: its absolute position
    plen: torch.Tensor         # (max_batch,) long: prompt length (pos - plen = the slot's column)
    active: torch.Tensor       # (max_batch,) bool: a live sample (idle rows compute at position 0)
    temp: torch.Tensor         # (max_batch,) fp32: T_eff (T, or 1 for greedy) dividing the fp32 logits
    greedy: torch.Tensor       # (max_batch,) bool: T = 0
    top_k: torch.Tensor        # (max_batch,) long, 0 = off
    top_p: torch.Tensor        # (max_batch,) float, 1 = off
    key: torch.Tensor          # (max_batch,) long: the sample's random-number key
    plan: torch.Tensor         # (max_batch + max_prefixes + max_prefixes * max_batch,) long: the three below
    back: torch.Tensor         # view of plan: (max_batch,)
    entry_plen: torch.Tensor   # view of plan: (max_prefixes,)
    q_rows: torch.Tensor       # view of plan: (max_prefixes * max_batch,), first E*n used (last: the used
                               # part of the plan is one prefix, and only that prefix is copied)
    staging: HostRing          # host copies of plan, pinned on CUDA: the plan is built in one and copied in one go
    plan_key: tuple | None = None  # what `write_plan` last wrote (unchanged plans are not rewritten)

    PER_SLOT = ("tok", "pos", "plen", "active", "temp", "greedy", "top_k", "top_p", "key")

    @classmethod
    def allocate(cls, max_batch: int, max_prefixes: int, device) -> "Rows":
        device = torch.device(device)
        long = dict(dtype=torch.long, device=device)
        head = max_batch + max_prefixes
        plan = torch.zeros(head + max_prefixes * max_batch, **long)
        staging = HostRing(plan.shape, torch.long, device)
        return cls(tok=torch.zeros(max_batch, **long), pos=torch.zeros(max_batch, **long),
                   plen=torch.zeros(max_batch, **long), active=torch.zeros(max_batch, dtype=torch.bool, device=device),
                   temp=torch.ones(max_batch, device=device), greedy=torch.zeros(max_batch, dtype=torch.bool, device=device),
                   top_k=torch.zeros(max_batch, **long), top_p=torch.ones(max_batch, device=device),
                   key=torch.zeros(max_batch, **long), plan=plan, back=plan[:max_batch],
                   entry_plen=plan[max_batch:head], q_rows=plan[head:], staging=staging)

    def per_slot(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if f.name in self.PER_SLOT]

    def start(self, slots: list[int], prompt_len: list[int], params: list, keys: torch.Tensor,
              own: list[int] | None = None) -> torch.Tensor:
        """Set up `slots` for new samples (their prompts' lengths, SamplingParams, random keys), or
        for resumed ones whose pending token is own column own[i]; returns the slots as a device
        index tensor. The pending token is the caller's to set."""
        dev = self.tok.device  # copies non-blocking: a step may be in flight (inflight.py)
        rows = to_device(slots, dev)
        temp = to_device([p.temperature for p in params], dev, torch.float32)
        self.pos[rows] = self.plen[rows] = to_device(prompt_len, dev)
        if own is not None:
            self.pos[rows] += to_device(own, dev)
        self.temp[rows], self.greedy[rows] = effective_temperature(temp), temp <= 0
        self.top_k[rows] = to_device([p.top_k for p in params], dev)
        self.top_p[rows] = to_device([p.top_p for p in params], dev, self.top_p.dtype)
        self.key[rows] = keys
        self.active.index_fill_(0, rows, True)  # a Scalar: `active[rows] = True` copies a host tensor (a sync)
        return rows

    def write_plan(self, entry_of_row: list[int], prompt_len: list[int], n: int) -> None:
        """The entry plan for rows 0..B-1 (B = len(entry_of_row); -1 = idle) and entries 0..E-1
        (E = len(prompt_len)) with n query rows each: query row e*n + i is the i-th live sample of
        entry e (padding: row 0), and row b reads its prompt part from query row back[b].
        Built in Python in a host staging buffer and sent with one copy, only when it changed
        (non_blocking from pinned memory on CUDA; the buffers alternate, and one is written again
        only once its last copy has run: with a step in flight that copy may still be queued)."""
        key = (tuple(entry_of_row), tuple(prompt_len), n)
        if key == self.plan_key:
            return
        B, E = len(entry_of_row), len(prompt_len)
        q_rows, back, seen = [0] * (E * n), [0] * B, [0] * E
        for b, e in enumerate(entry_of_row):  # live rows in row order: the i-th of entry e -> query row e*n + i
            if e >= 0:
                back[b] = e * n + seen[e]
                q_rows[back[b]] = b
                seen[e] += 1
        mb, head = self.back.numel(), self.back.numel() + self.entry_plen.numel()
        i = self.staging.take()
        st = self.staging.bufs[i]
        st[:B] = torch.tensor(back, dtype=torch.long)
        st[mb:mb + E] = torch.tensor(prompt_len, dtype=torch.long)
        st[head:head + E * n] = torch.tensor(q_rows, dtype=torch.long)
        used = head + E * n  # back, entry_plen, then q_rows[:E*n]: one prefix of the plan
        self.plan[:used].copy_(st[:used], non_blocking=True)
        self.staging.mark(i)
        self.plan_key = key


def decode_step(dec, cache, rows: Rows, shape: Shape, any_filtered: bool, any_greedy: bool) -> torch.Tensor:
    """Advance rows 0..B-1 by one token through `dec` (a `DecodeModel`); returns (2, B) float64:
    the new tokens (exact in float64) and their log-probs, packed for the host's one copy. E entries
    with n query rows each must match the entry plan in `rows`; S > every slot column of a live
    row, P >= every live prompt (module docstring)."""
    B, E, n = shape.B, shape.E, shape.n
    active = rows.active[:B]
    pos = torch.where(active, rows.pos[:B], 0)
    own = torch.where(active, pos - rows.plen[:B], 0)  # idle rows write garbage at their column 0
    tok, logp = dec.step(cache, rows.tok[:B], pos, own, rows.q_rows[:E * n], rows.back[:B], rows.entry_plen[:E],
                         shape, rows.temp[:B], rows.greedy[:B], rows.top_k[:B], rows.top_p[:B], rows.key[:B],
                         any_filtered, any_greedy)
    rows.tok[:B] = torch.where(active, tok, rows.tok[:B])
    rows.pos[:B] += active
    return torch.stack((tok.double(), logp.double()))


def bucket(x: int, cap: int) -> int:
    """x rounded up to a power of two, at most cap."""
    return min(cap, 1 << max(0, x - 1).bit_length())


def bucket_grain(x: int, grain: int, cap: int) -> int:
    """x rounded up to a power of two below `grain`, to a multiple of `grain` above; at most cap.
    Within 2x of x everywhere, and a handful of values over a whole range."""
    return min(cap, bucket(x, grain) if x <= grain else -(-x // grain) * grain)


N_GRAIN = 4      # query rows per entry: 1, 2, 4, then multiples of 4 (n = 20 stays 20)
COL_GRAIN = 128  # cache columns: 1, 2, ..., 128, then multiples of 128


def captured_shape(live: Shape, max_batch: int, max_prefixes: int, max_seq_len: int, max_prompt_len: int) -> Shape:
    """The bucket whose graph runs a step of `live` shape: each dimension on its own, so few
    distinct graphs cover a run and each is within ~2x of the live work (module docstring)."""
    B = bucket(live.B, max_batch)
    return Shape(B, bucket(live.E, max_prefixes), bucket_grain(live.n, N_GRAIN, B),
                 bucket_grain(live.S, COL_GRAIN, max_seq_len), bucket_grain(live.P, COL_GRAIN, max_prompt_len))


class GraphedDecode:
    """`decode_step` captured as one CUDA graph per (shape, filtered, greedy) bucket, as gpt-fast
    and nano-vllm do. The first step of a bucket runs eagerly on a side stream (it warms cuBLAS
    and the allocator, and is a real step), then the graph is captured (capture runs nothing) and
    every later step of that bucket is one replay.

    Memory: every graph allocates from one shared pool. A graph's intermediates are freed at the
    end of its capture and reused by the next capture, so the pool holds about the largest
    bucket's intermediates; what each graph keeps is its two small outputs plus the graph itself.
    Sharing is safe because buckets never run at once and the sampler queues the copy of a replay's
    outputs to the host right behind it, before any later replay (a later capture may reuse an
    earlier graph's scratch).
    At most `max_graphs` graphs are kept; past that the least recently used one is dropped.
    The graphs read the model's RoPE table and the decode model's weights by address: if the model
    rebuilds the table (a longer position than it was built for) or a weight moves
    (`DecodeModel.generation`), every graph is dropped and captured again."""

    def __init__(self, dec, cache, rows: Rows, max_graphs: int = 64):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the sampler's cache is on {cache.device}")
        self.dec, self.cache, self.rows, self.max_graphs = dec, cache, rows, max_graphs
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.stats = {"captures": 0, "replays": 0, "evictions": 0, "invalidations": 0}
        self._tables = None  # the RoPE tables the graphs were captured against
        self._generation = None  # the decode model's weight addresses they were captured against

    def __call__(self, shape: Shape, any_filtered: bool, any_greedy: bool) -> torch.Tensor:
        """`decode_step` at a `captured_shape`."""
        args = (self.dec, self.cache, self.rows, shape, any_filtered, any_greedy)
        key = (*shape, any_filtered, any_greedy)
        if self.graphs and (self.dec.model._rope_cache is not self._tables or self.dec.generation != self._generation):
            self.graphs.clear()
            self.stats["invalidations"] += 1
        if key in self.graphs:
            self.graphs.move_to_end(key)
            g, out = self.graphs[key]
            g.replay()
            self.stats["replays"] += 1
            return out
        dev = self.cache.device
        with torch.cuda.device(dev):
            main = torch.cuda.current_stream(dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                first = decode_step(*args)  # the real step, eagerly: warm-up (compile, RoPE table) before capture
            main.wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):  # records kernels, runs none: the state stays as the step left it
                out = decode_step(*args)
        self._tables, self._generation = self.dec.model._rope_cache, self.dec.generation
        self.graphs[key] = (g, out)
        self.stats["captures"] += 1
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats["evictions"] += 1
        return first
