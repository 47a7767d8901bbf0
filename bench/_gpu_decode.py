"""The decode section of `bench/gpu.py`: one decode step's wall time against its device time, per
sampler variant (`bench/_gpu_gen.py: VARIANTS`).

A fresh sampler per variant gets all prompts x n (= max_batch rows), one step admits them
all; after warm-up steps, `--decode-steps` steps are timed one by one on the host
(synchronised; `wall_ms` = median), then as many back to back, as a run takes them
(`wall_ms_back_to_back`: their total / count; with overlap the host records a step while
the device computes the next), then `--decode-profile` steps run under the torch
profiler: `gpu_ms` = the union of the CUDA kernel/memcpy/memset intervals per step (on CPU
the summed self time of the aten ops instead, `gpu_ms_source` says which). Last, the
last-used graph's bare replay, synchronised (`replay_wall_ms`: device time + the gaps
between its kernels + its launch; `wall_ms` minus it is the sampler's host work).
Every measured step has all rows busy (asserted). launch_bound = wall / gpu > 1.5.
`gsm8k_schedule` (CUDA): the gsm8k workload's whole generate under the profiler, eager at
the live shapes vs captured at the graph buckets (warm run first): device ms per step
each, their ratio (`captured_over_live_gpu`, target <= 1.3), and the sampler's padding
counters (rows, prompt query rows, cache columns run vs live).
"""
from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from bench._gpu_gen import (LAUNCH_BOUND, PADDING, Workload, eager_fallbacks, has_cuda_graphs, new_sampler,
                            sample_params, variants, workloads)
from bench._gpu_util import Ctx, device_ms, free_memory, kernel_counts, median, sync, top_kernels
from common.engine.sampler.decode import COL_GRAIN, bucket_grain
from common.engine.sampler.sampler import Sampler


def _captures(s: Sampler) -> int | None:
    return s.graphed.stats["captures"] if s.graphed is not None else None


def _replay_wall_ms(s: Sampler, ctx: Ctx, reps: int) -> float | None:
    """Median wall ms of the last-used graph's bare replay, synced before and after: the device
    time plus the gaps between the graph's kernels and its launch, without any host work of the
    sampler's (what wall - replay wall leaves is the host's). The rows' state is put back after."""
    if s.graphed is None or not s.graphed.graphs:
        return None
    g, _ = next(reversed(s.graphed.graphs.values()))
    saved = [t.clone() for t in (s.rows.tok, s.rows.pos)]
    walls = []
    for _ in range(reps):
        sync(ctx.device)
        t = time.perf_counter()
        g.replay()
        sync(ctx.device)
        walls.append(time.perf_counter() - t)
    s.rows.tok.copy_(saved[0])
    s.rows.pos.copy_(saved[1])
    return 1e3 * median(walls)


def decode_one(ctx: Ctx, model, kw: dict) -> dict:
    a = ctx.args
    s = new_sampler(ctx, model, kw)
    for p in ctx.prompts:
        s.submit(p, sample_params(ctx, seed=0))
    rows = len(ctx.prompts) * a.n
    need = 1 + a.decode_warmup + 2 * a.decode_steps + a.decode_profile + 1  # + back to back, + overlap's lag
    if rows > a.max_batch or need >= a.max_new:
        raise ValueError(f"decode: {rows} rows must fit max_batch={a.max_batch} and {need} steps < max_new={a.max_new}")
    s.step()  # admits every prompt (prefill), then the first decode
    for _ in range(a.decode_warmup):
        s.step()
    # every timed step replays one graph: the own columns (one per step, give or take the first
    # token and overlap's lag: a margin of 2) stay inside one bucket, where
    # max_new leaves room (--smoke does not), else a capture (~20x a replay) lands in a timed window
    # (the back-to-back mean keeps it; `captures_in_*` say so)
    done, timed = 1 + a.decode_warmup, need - a.decode_warmup
    col = lambda k: bucket_grain(k, COL_GRAIN, a.max_new)  # noqa: E731
    extra = next((e for e in range(a.max_new - done - timed) if col(done + e - 2) == col(done + e + timed + 2)), 0)
    for _ in range(extra):
        s.step()
    walls, caps0 = [], _captures(s)
    for _ in range(a.decode_steps):
        assert s.num_active == rows, (s.num_active, rows)
        sync(ctx.device)
        t = time.perf_counter()
        s.step()
        sync(ctx.device)
        walls.append(time.perf_counter() - t)
    # back to back, as a run steps: no sync between steps (with overlap, the host records step t
    # while the device computes t + 1); over the same number of steps, after one untimed step
    s.step()
    sync(ctx.device)
    caps1 = _captures(s)
    t = time.perf_counter()
    for _ in range(a.decode_steps):
        s.step()
    sync(ctx.device)
    b2b = 1e3 * (time.perf_counter() - t) / a.decode_steps
    acts = [ProfilerActivity.CUDA] if ctx.cuda else [ProfilerActivity.CPU]  # CUDA: device events only (cheap to collect)
    own0 = s.stats["live_own_cols"]
    with profile(activities=acts) as prof:
        for _ in range(a.decode_profile):
            assert s.num_active == rows, (s.num_active, rows)
            s.step()
        sync(ctx.device)
    dev_ms, n_ev = device_ms(prof, ctx.cuda)
    wall, gpu = 1e3 * median(walls), dev_ms / a.decode_profile
    res = {"rows": rows, "wall_ms": wall, "wall_ms_all": [round(1e3 * w, 3) for w in walls],
           "wall_ms_back_to_back": b2b, "replay_wall_ms": _replay_wall_ms(s, ctx, a.decode_steps),
           "gpu_ms": gpu if n_ev else None,
           "gpu_ms_source": "union of CUDA kernel/memcpy intervals (torch profiler)" if ctx.cuda else
           "CPU: summed self time of aten ops (torch profiler)", "device_events_per_step": n_ev / a.decode_profile,
           "steps_timed": a.decode_steps, "steps_profiled": a.decode_profile,
           # the live K/V the profiled steps read: each prompt once (shared by its samples), each row's own columns
           "prompt_tokens_live": sum(map(len, ctx.prompts)),
           "own_cols_profiled": (s.stats["live_own_cols"] - own0) / a.decode_profile,
           # a timed step whose cache columns crossed into a new bucket captured a graph (~20x a replay)
           "captures_in_timed_steps": None if caps0 is None else caps1 - caps0,
           "captures_in_back_to_back_steps": None if caps1 is None else _captures(s) - caps1,
           "eager_fallbacks": eager_fallbacks(),  # compiled pieces run eagerly at some shape (empty: none)
           **(kernel_counts(prof, a.decode_profile, ctx.shape["num_hidden_layers"]) if ctx.cuda else {}), **kw}
    # where a step's device time goes (CUDA; empty on CPU): a few µs per kernel add up at thousands per step
    res["top_kernels_ms_launches"] = top_kernels(prof, 12, a.decode_profile)
    res["wall_over_gpu"] = wall / gpu if n_ev and gpu > 0 else None
    res["back_to_back_over_gpu"] = b2b / gpu if n_ev and gpu > 0 else None
    res["launch_bound"] = None if res["wall_over_gpu"] is None else res["wall_over_gpu"] > LAUNCH_BOUND
    s.abort_all()
    return res


def schedule_gpu(ctx: Ctx, model, kw: dict, wl: Workload) -> dict:
    """Device ms per decode step over the whole `wl` generate (after a warm run of the same work,
    so every graph is captured before the profiled one) and the sampler's padding counters."""
    s = new_sampler(ctx, model, kw, wl)
    s.generate(wl.prompts, sample_params(ctx, 0, wl))
    before = dict(s.stats)
    acts = [ProfilerActivity.CUDA] if ctx.cuda else [ProfilerActivity.CPU]  # CUDA: device events only (cheap to collect)
    with profile(activities=acts) as prof:
        s.generate(wl.prompts, sample_params(ctx, 0, wl))
        sync(ctx.device)
    dev_ms, _ = device_ms(prof, ctx.cuda)
    st = {k: s.stats[k] - before[k] for k in ("decode_steps", *PADDING)}
    return {"device_ms_per_step": dev_ms / st["decode_steps"], **st, **kw}


def decode_section(ctx: Ctx) -> dict:
    model = ctx.prec.load(ctx.ckpt, device=ctx.device, role="generator", tokenizer=False)[0]
    out = {"launch_bound_if_over": LAUNCH_BOUND}
    for name, kw in variants(ctx).items():
        out[name] = decode_one(ctx, model, kw) if isinstance(kw, dict) else {"skipped": kw}
        free_memory(ctx.device)
        ctx.progress(name, out)
    if not ctx.args.decode_schedule:
        return out
    # the captured step's shapes vs the live ones over a ragged schedule (on CPU: the bucket shapes
    # run eagerly, the same kernels a graph replays)
    wl = workloads(ctx)["gsm8k"]
    captured = {"cuda_graphs": True} if ctx.cuda and has_cuda_graphs() else {"static_shapes": True}
    live = schedule_gpu(ctx, model, {"cuda_graphs": False} if has_cuda_graphs() else {}, wl)
    ctx.progress("gsm8k_schedule live", {**out, "gsm8k_schedule": {"live": live}})
    cap = schedule_gpu(ctx, model, captured, wl)
    out["gsm8k_schedule"] = {"live": live, "captured": cap,
                             "captured_over_live_gpu": cap["device_ms_per_step"] / live["device_ms_per_step"]}
    return out
