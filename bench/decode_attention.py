"""Decode attention on CPU against the memory it reads: what a sampler step's attention costs, and why.

Single process, one thread, bf16. One decode step's attention at the shapes of `bench/sampler.py`'s
GSM8K workload on SmolLM2-135M (the mean live shape of its decode steps, `--workload`: 95 rows,
128 own columns, 29 prompt entries of n = 4 samples, 158 prompt columns; each a flag), computed as
the sampler computes it on CPU (`common/engine/decode_attention.attend`, dense path: PyTorch's CPU
flash kernel through `attention.attend_lse`, on strided views of caches laid out as the sampler's):
  own     rows x kv heads, the G query heads of a kv head as G query rows, against the row's columns
  prompt  entries x kv heads, n x G query rows, against the entry's prompt columns
each timed
  cold    every call reading another layer's cache, as a step does (`--layers` stores, more bytes
          than the CPU's caches keep between two reads of the same layer)
  warm    the same layer's cache again and again (its K/V in the CPU's caches)
  small   cold at `--small-cols` own columns: nearly all of it the kernel's fixed cost per
          (row, kv head) pair, reported per pair
  floor   the cold call's K/V bytes streamed by a contiguous fp32 sum (this PyTorch's plainest
          read), each call another buffer: bytes / this thread's streaming rate
  alt     the own part as plain PyTorch ops through torch.compile (inductor's C++: scores,
          softmax and the weighted sum fused, no per-pair calls), cold; `--no-alt` skips it
Reported: ms per call and per step (x layers), effective GB/s, and `stall_share` = 1 - warm / cold,
the part of a cold call spent waiting for memory the kernel does not overlap with its arithmetic.
Runs alternate `--rounds` times; medians.

`--workload` first runs `bench/sampler.py`'s workload itself (the default model at `auto`
precision, 32 GSM8K prompts x 4, <= 256 tokens) with every decode attention call timed, own and
prompt part apart: how much of the sampler's time is attention, and its mean live shape (rows, own
and prompt columns per step: the defaults above came from it).

    python bench/decode_attention.py             # ~15 s
    python bench/decode_attention.py --workload  # + the sampler workload (~1 min on an AMX Xeon)
    python bench/decode_attention.py --quick     # tiny shapes, no compile (seconds)
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.engine.model.attention import additive_mask, attend_lse  # noqa: E402
from common.engine.machine.precision import cpu_info  # noqa: E402


def plain_attention(q, k, v, mask):
    """`attend_lse` as plain ops (what `alt` compiles): q (B, Hkv, Tq, hd), k/v (B, Hkv, S, hd),
    mask (B, 1, 1, S) additive -> out (B, Hkv, Tq, hd) in q's dtype, lse (B, Hkv, Tq) fp32.
    Scores, softmax and sums in fp32; nothing rounded to bf16 before the output."""
    s = (q.float().unsqueeze(3) * k.float().unsqueeze(2)).sum(-1) * q.shape[-1] ** -0.5  # (B, Hkv, Tq, S)
    s = s + mask.float()
    m = s.amax(-1, keepdim=True)
    p = (s - m).exp()
    den = p.sum(-1, keepdim=True)                                                         # (B, Hkv, Tq, 1)
    out = (p.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2) / den                       # (B, Hkv, Tq, hd)
    return out.to(q.dtype), (m + den.log()).squeeze(-1)


class Part:
    """One part's queries, mask and `layers` (K, V) caches of shape (rows, Hkv, alloc_cols, hd),
    attended through views of the first `cols` columns, as the sampler's cache is."""

    def __init__(self, layers, rows, hkv, tq, hd, cols, alloc_cols, visible, gen):
        bf = dict(dtype=torch.bfloat16)
        self.q = torch.randn(rows, hkv, tq, hd, generator=gen).to(**bf)
        self.k = [torch.randn(rows, hkv, alloc_cols, hd, generator=gen).to(**bf) for _ in range(layers)]
        self.v = [torch.randn(rows, hkv, alloc_cols, hd, generator=gen).to(**bf) for _ in range(layers)]
        self.cols, self.layer = cols, 0
        self.mask = additive_mask(visible[:, None, None, :cols], torch.bfloat16)  # (rows, 1, 1, cols)
        self.bytes = 2 * rows * hkv * cols * hd * 2                               # K and V, bf16

    def call(self, fn=attend_lse, cold=True, cols=None):
        if cold:  # the next layer, as a step moves through its layers
            self.layer = (self.layer + 1) % len(self.k)
        c = cols or self.cols
        k, v = self.k[self.layer][:, :, :c], self.v[self.layer][:, :, :c]
        return fn(self.q, k, v, self.mask[..., :c])


def workload_split() -> dict:
    """`bench/sampler.py`'s workload with every decode attention call timed, by part (the dense
    path calls `attend_lse` twice per layer: the own part, then the prompt part), after the same
    warm-up; the mean live shape of its decode steps from the sampler's counters."""
    import bench.sampler as bs
    import common.engine.sampler.decode_attention as da
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    bs.keep_freed_memory()
    model, tok = bs.resolve(bs.PrecisionConfig()).apply().load(name)
    prompts, params = bs.workload(tok or bs.prompt_tokenizer(name), 32, 4, 256)
    s = bs.warm_sampler(model, prompts, params, max_batch=128)
    before = dict(s.stats)
    spent, calls, kernel = [0.0, 0.0], [0], da.attend_lse

    def timed(*args, **kw):
        t = time.perf_counter()
        out = kernel(*args, **kw)
        spent[calls[0] % 2] += time.perf_counter() - t
        calls[0] += 1
        return out

    da.attend_lse = timed
    try:
        t = time.perf_counter()
        outs = s.generate(prompts, params)
        wall = time.perf_counter() - t
    finally:
        da.attend_lse = kernel
    d = {k: s.stats[k] - before.get(k, 0) for k in ("decode_steps", "decode_rows", "live_own_cols", "live_prompt_cols",
                                                     "live_prompt_rows")}
    steps = d["decode_steps"]
    return {"seconds": round(wall, 2), "tok_s": round(sum(len(c.tokens) for c in outs) / wall, 1),
            "decode_steps": steps, "attention_s": {"own": round(spent[0], 2), "prompt": round(spent[1], 2)},
            "attention_share": round(sum(spent) / wall, 3), "compiled": s.dec.compile, "packed": s.dec.packed_gemm,
            "mean_step": {"rows": round(d["decode_rows"] / steps, 1), "own_cols": round(d["live_own_cols"] / steps, 1),
                          "prompt_rows": round(d["live_prompt_rows"] / steps, 1),
                          "prompt_cols": round(d["live_prompt_cols"] / steps, 1)}}


def per_call_ms(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=95, help="live rows (own part)")
    ap.add_argument("--own-cols", type=int, default=128, help="own columns attended")
    ap.add_argument("--entries", type=int, default=29, help="prompt entries")
    ap.add_argument("--n", type=int, default=4, help="samples per entry")
    ap.add_argument("--prompt-cols", type=int, default=158, help="prompt columns attended")
    ap.add_argument("--alloc-cols", type=int, default=414, help="own columns allocated per row (prompt + max new)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3, help="query heads per kv head (G)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--small-cols", type=int, default=8, help="own columns of the fixed-cost run")
    ap.add_argument("--reps", type=int, default=60, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-alt", action="store_true", help="skip the compiled plain-ops alternative")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 layers, no alt")
    ap.add_argument("--workload", action="store_true", help="first, the sampler workload with attention timed by part")
    a = ap.parse_args()
    if a.quick:
        a.rows, a.own_cols, a.entries, a.n, a.prompt_cols, a.alloc_cols = 4, 16, 2, 2, 12, 24
        a.layers, a.reps, a.rounds, a.no_alt, a.small_cols = 2, 3, 1, True, 4
    if not (0 < a.small_cols <= a.own_cols <= a.alloc_cols and a.prompt_cols > 0 and a.layers >= 2):
        ap.error("need 0 < --small-cols <= --own-cols <= --alloc-cols, --prompt-cols > 0, --layers >= 2")
    torch.set_num_threads(1)
    split = workload_split() if a.workload else None
    gen = torch.Generator().manual_seed(0)
    G, hd, hkv = a.groups, a.head_dim, a.kv_heads
    own = Part(a.layers, a.rows, hkv, G, hd, a.own_cols, a.alloc_cols,
               torch.ones(a.rows, a.own_cols, dtype=torch.bool), gen)
    plen = torch.randint(a.prompt_cols // 2, a.prompt_cols + 1, (a.entries,), generator=gen)
    plen[0] = a.prompt_cols  # the longest prompt sets the columns, as in a step
    prompt = Part(a.layers, a.entries, hkv, a.n * G, hd, a.prompt_cols, a.prompt_cols,
                  torch.arange(a.prompt_cols)[None] < plen[:, None], gen)
    # the streaming floor: the own part's cold bytes as contiguous fp32 buffers, one per layer
    streams = [torch.randn(own.bytes // 4, generator=gen) for _ in range(a.layers)]
    at = [0]

    def stream():
        at[0] = (at[0] + 1) % len(streams)
        return streams[at[0]].sum()

    runs = {
        "own_cold": lambda: own.call(),
        "own_warm": lambda: own.call(cold=False),
        "own_small": lambda: own.call(cols=a.small_cols),
        "prompt_cold": lambda: prompt.call(),
        "prompt_warm": lambda: prompt.call(cold=False),
        "floor": stream,
    }
    check = None
    if not a.no_alt:
        alt = torch.compile(plain_attention, dynamic=False, fullgraph=True)
        ref, got = own.call(cold=False), own.call(alt, cold=False)
        check = max((ref[0].float() - got[0].float()).abs().max().item(), (ref[1] - got[1]).abs().max().item())
        runs["own_alt_cold"] = lambda: own.call(alt)
    times = {name: [] for name in runs}
    for _ in range(a.rounds):  # alternate, so drift on a shared host hits every variant alike
        for name, fn in runs.items():
            times[name].append(per_call_ms(fn, a.reps))
    ms = {name: statistics.median(t) for name, t in times.items()}
    gbs = lambda nbytes, t: round(nbytes / t / 1e6, 2)  # noqa: E731  (bytes per ms -> GB/s)
    res = {"bench": "decode_attention", "cpu": cpu_info()["model"], "threads": 1, "dtype": "bf16",
           "layers": a.layers, "own": {"rows": a.rows, "cols": a.own_cols, "queries_per_pair": G, "pairs": a.rows * hkv},
           "prompt": {"entries": a.entries, "cols": a.prompt_cols, "queries_per_pair": a.n * G, "pairs": a.entries * hkv},
           "ms": {k: round(v, 4) for k, v in ms.items()}, "ms_all": {k: [round(x, 4) for x in v] for k, v in times.items()},
           "own_gb_s": {"cold": gbs(own.bytes, ms["own_cold"]), "warm": gbs(own.bytes, ms["own_warm"]),
                        "floor": gbs(own.bytes, ms["floor"])},
           "prompt_gb_s_cold": gbs(prompt.bytes, ms["prompt_cold"]),
           "own_stall_share": round(1 - ms["own_warm"] / ms["own_cold"], 3),
           "prompt_stall_share": round(1 - ms["prompt_warm"] / ms["prompt_cold"], 3),
           "own_cold_over_floor": round(ms["own_cold"] / ms["floor"], 2),
           "fixed_us_per_pair": round(ms["own_small"] * 1e3 / (a.rows * hkv), 2),
           "step_ms": round(a.layers * (ms["own_cold"] + ms["prompt_cold"]), 1)}
    if split is not None:
        res["workload"] = split
    if check is not None:
        res["alt_max_abs_diff"] = check
        res["alt_over_kernel"] = round(ms["own_alt_cold"] / ms["own_cold"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
