"""Generation sections of `bench/gpu.py`: our sampler against transformers `generate`, and one
decode step's wall time against its device time.

sampler  Our `Sampler` (eager, and with `cuda_graphs=True` when its constructor has that
         argument and the device is CUDA) on the workload: a full warm-up run of the same work
         (every batch size the timed run meets, so every CUDA graph is captured), then one timed
         `generate`, device synchronised around it. tok/s = generated tokens / wall seconds.
         transformers: `AutoModelForCausalLM` from the same checkpoint, same dtype and device,
         `generate(do_sample, T, top_k=0, top_p=1, min_new_tokens = max_new_tokens)` on
         left-padded batches of `--hf-batch` sequences (prompts x num_return_sequences), in three
         settings: dynamic cache; static cache (`disable_compile=True`: transformers would
         otherwise compile the decode step by itself on CUDA); static cache with
         `model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`.
         Warm-up: a 16-token run (eager settings), the full run (compiled: compile + CUDA graph
         capture, reported as `warmup_s`). Ratios: our best / each setting.
decode   A fresh sampler per variant gets all prompts x n (= max_batch rows), one step admits them
         all; after warm-up steps, `--decode-steps` steps are timed one by one on the host
         (synchronised; `wall_ms` = median), then `--decode-profile` steps run under the torch
         profiler: `gpu_ms` = the union of the CUDA kernel/memcpy/memset intervals per step (on CPU
         the summed self time of the aten ops instead, `gpu_ms_source` says which).
         Every measured step has all rows busy (asserted). launch_bound = wall / gpu > 1.5.
"""
from __future__ import annotations

import inspect
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench._gpu_util import Ctx, free_memory, median, sync
from common.engine.sampler import Sampler
from common.engine.sampling import SamplingParams

LAUNCH_BOUND = 1.5  # wall / device time above this: the host, not the GPU, sets the pace


def has_cuda_graphs() -> bool:
    """Whether this checkout's Sampler takes `cuda_graphs` (a captured decode step per batch bucket)."""
    return "cuda_graphs" in inspect.signature(Sampler.__init__).parameters


def _variants(ctx: Ctx) -> dict[str, dict | str]:
    """name -> Sampler kwargs, or the reason the variant is skipped."""
    graphs = {"cuda_graphs": True} if has_cuda_graphs() and ctx.cuda else (
        "Sampler has no cuda_graphs argument" if not has_cuda_graphs() else "not on CUDA")
    return {"ours_eager": {"cuda_graphs": False} if has_cuda_graphs() else {}, "ours_cuda_graphs": graphs}


def _new_sampler(ctx: Ctx, model, kw: dict) -> Sampler:
    a, P = ctx.args, max(map(len, ctx.prompts))
    return Sampler(model, max_batch=a.max_batch, max_seq_len=P + a.max_new, max_prompt_len=P, **kw)


def _params(ctx: Ctx, seed: int, max_new: int | None = None) -> SamplingParams:
    a = ctx.args  # no stop tokens: every sample runs max_new tokens, as transformers' min_new_tokens does
    return SamplingParams(max_new_tokens=max_new or a.max_new, temperature=a.temperature, n=a.n, seed=seed)


def run_ours(ctx: Ctx, model, kw: dict) -> dict:
    s = _new_sampler(ctx, model, kw)
    t = time.perf_counter()
    s.generate(ctx.prompts, _params(ctx, seed=1))  # warm-up: the same work, so every bucket is met
    sync(ctx.device)
    warm = time.perf_counter() - t
    before = dict(s.stats)
    sync(ctx.device)
    t = time.perf_counter()
    outs = s.generate(ctx.prompts, _params(ctx, seed=0))
    sync(ctx.device)
    dt = time.perf_counter() - t
    ntok = sum(len(c.tokens) for c in outs)
    st = {k: s.stats[k] - before[k] for k in ("prefill_tokens", "decode_steps", "decode_rows")}
    return {"tok_s": ntok / dt, "seconds": dt, "tokens": ntok, "sequences": len(outs), "warmup_s": warm,
            "all_full_length": all(len(c.tokens) == ctx.args.max_new for c in outs), "max_batch": ctx.args.max_batch,
            "dtype": str(model.dtype).replace("torch.", ""), "kv_dtype": str(s.cache.dtype).replace("torch.", ""),
            **st, **kw}


def _left_pad(prompts, pad_id, device):
    L = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _hf_generate(ctx: Ctx, hf, max_new: int, extra: dict) -> tuple[int, float]:
    """(generated tokens, wall s) of the whole workload in batches of --hf-batch sequences."""
    a = ctx.args
    per = max(1, a.hf_batch // a.n)  # prompts per call; each returns n sequences
    ntok = 0
    torch.manual_seed(0)
    sync(ctx.device)
    t = time.perf_counter()
    for i in range(0, len(ctx.prompts), per):
        ids, mask = _left_pad(ctx.prompts[i:i + per], 0, ctx.device)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=a.temperature, top_k=0,
                              top_p=1.0, max_new_tokens=max_new, min_new_tokens=max_new, num_return_sequences=a.n,
                              pad_token_id=0, **extra)
        ntok += out.shape[0] * (out.shape[1] - ids.shape[1])  # min_new_tokens: no row stops early
    sync(ctx.device)
    return ntok, time.perf_counter() - t


def _compiled_graphs() -> int | None:
    """Graphs dynamo has compiled in this process so far (None if this torch does not say)."""
    try:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    except (AttributeError, KeyError, TypeError):
        return None


def run_hf(ctx: Ctx, compile_forward: bool, static: bool) -> dict:
    import transformers  # lazy: slow import, only this section needs it
    hf = transformers.AutoModelForCausalLM.from_pretrained(ctx.ckpt, dtype=ctx.prec.torch_dtype).to(ctx.device).eval()
    extra = {"cache_implementation": "static"} if static else {}
    if hasattr(transformers.GenerationConfig(), "disable_compile"):
        extra["disable_compile"] = True  # no automatic compile: the settings below say exactly what is compiled
    if compile_forward:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    try:
        warm_new = ctx.args.max_new if compile_forward else min(16, ctx.args.max_new)
        _, warm = _hf_generate(ctx, hf, warm_new, extra)
        graphs = _compiled_graphs()
        ntok, dt = _hf_generate(ctx, hf, ctx.args.max_new, extra)
        recompiled = None if graphs is None else _compiled_graphs() - graphs  # must be 0: compile time not in dt
    finally:
        if compile_forward:
            torch._dynamo.reset()  # drop the compiled graphs and their CUDA graph memory pools
        del hf
        free_memory(ctx.device)
    return {"tok_s": ntok / dt, "seconds": dt, "tokens": ntok, "warmup_s": warm, "warmup_new_tokens": warm_new,
            "batch": min(ctx.args.hf_batch, len(ctx.prompts) * ctx.args.n), **extra,
            "compiled_forward": "reduce-overhead, fullgraph" if compile_forward else None,
            "graphs_compiled_in_warmup": graphs if compile_forward else None,
            "graphs_compiled_in_timed_run": recompiled if compile_forward else None}


def sampler_section(ctx: Ctx) -> dict:
    a = ctx.args
    model = ctx.prec.load(ctx.ckpt, device=ctx.device, role="generator", tokenizer=False)[0]
    out = {"workload": {"prompts": len(ctx.prompts), "n": a.n, "prompt_len": [a.prompt_min, a.prompt_max],
                        "max_new_tokens": a.max_new, "temperature": a.temperature, "stop_tokens": None},
           "sampler_has_cuda_graphs": has_cuda_graphs()}
    for name, kw in _variants(ctx).items():
        out[name] = run_ours(ctx, model, kw) if isinstance(kw, dict) else {"skipped": kw}
        free_memory(ctx.device)
    del model
    free_memory(ctx.device)
    ours = max((v["tok_s"], k) for k, v in out.items() if k.startswith("ours_") and "tok_s" in v)
    out["ours_best"] = ours[1]
    hf_settings = {"hf_dynamic": (False, False), "hf_static": (False, True), "hf_static_compiled": (True, True)}
    for name, (comp, static) in hf_settings.items():
        if a.skip_hf:
            out[name] = {"skipped": "--skip-hf"}
        elif comp and not a.hf_compile:
            out[name] = {"skipped": "no torch.compile (--no-hf-compile, the --smoke default)"}
        else:
            out[name] = run_hf(ctx, comp, static)
        if "tok_s" in out[name]:
            out[f"ours_over_{name}"] = ours[0] / out[name]["tok_s"]
            for k in ("ours_eager", "ours_cuda_graphs"):
                if "tok_s" in out[k] and k != ours[1]:
                    out[f"{k}_over_{name}"] = out[k]["tok_s"] / out[name]["tok_s"]
    return out


def _device_ms(prof, cuda: bool) -> tuple[float, int]:
    """(busy ms, events): union of device intervals (CUDA), or summed aten self time (CPU)."""
    ev = prof.events()
    if not cuda:
        ops = [e for e in ev if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        return sum(e.self_cpu_time_total for e in ops) / 1e3, len(ops)
    # kernels, memcpy, memset; not user-annotation spans (they cover the gaps between kernels)
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union: overlapping kernels (several streams) count once
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e3, len(spans)


def decode_one(ctx: Ctx, model, kw: dict) -> dict:
    a = ctx.args
    s = _new_sampler(ctx, model, kw)
    for p in ctx.prompts:
        s.submit(p, _params(ctx, seed=0))
    rows = len(ctx.prompts) * a.n
    need = 1 + a.decode_warmup + a.decode_steps + a.decode_profile
    if rows > a.max_batch or need >= a.max_new:
        raise ValueError(f"decode: {rows} rows must fit max_batch={a.max_batch} and {need} steps < max_new={a.max_new}")
    s.step()  # admits every prompt (prefill), then the first decode
    for _ in range(a.decode_warmup):
        s.step()
    walls = []
    for _ in range(a.decode_steps):
        assert s.num_active == rows, (s.num_active, rows)
        sync(ctx.device)
        t = time.perf_counter()
        s.step()
        sync(ctx.device)
        walls.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(a.decode_profile):
            assert s.num_active == rows, (s.num_active, rows)
            s.step()
        sync(ctx.device)
    dev_ms, n_ev = _device_ms(prof, ctx.cuda)
    wall, gpu = 1e3 * median(walls), dev_ms / a.decode_profile
    res = {"rows": rows, "wall_ms": wall, "wall_ms_all": [round(1e3 * w, 3) for w in walls],
           "gpu_ms": gpu if n_ev else None,
           "gpu_ms_source": "union of CUDA kernel/memcpy intervals (torch profiler)" if ctx.cuda else
           "CPU: summed self time of aten ops (torch profiler)", "device_events_per_step": n_ev / a.decode_profile,
           "steps_timed": a.decode_steps, "steps_profiled": a.decode_profile, **kw}
    res["wall_over_gpu"] = wall / gpu if n_ev and gpu > 0 else None
    res["launch_bound"] = None if res["wall_over_gpu"] is None else res["wall_over_gpu"] > LAUNCH_BOUND
    s.abort_all()
    return res


def decode_section(ctx: Ctx) -> dict:
    model = ctx.prec.load(ctx.ckpt, device=ctx.device, role="generator", tokenizer=False)[0]
    out = {"launch_bound_if_over": LAUNCH_BOUND}
    for name, kw in _variants(ctx).items():
        out[name] = decode_one(ctx, model, kw) if isinstance(kw, dict) else {"skipped": kw}
        free_memory(ctx.device)
    return out

