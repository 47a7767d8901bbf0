"""The sampler section of `bench/gpu.py`: our sampler against transformers `generate` (the decode
section, one decode step's wall time against its device time, is `bench/_gpu_decode.py`'s).

sampler  Our `Sampler` (eager, and with `cuda_graphs=True` when its constructor has that
         argument and the device is CUDA) on a workload: a full warm-up run of the same work
         (every bucket the timed run meets, so every CUDA graph is captured), then one timed
         `generate`, device synchronised around it. tok/s = generated tokens / wall seconds.
         transformers: `AutoModelForCausalLM` from the same checkpoint, same dtype and device,
         `generate(do_sample, T, top_k=0, top_p=1)` on left-padded batches of `--hf-batch`
         sequences (prompts x num_return_sequences), in three settings: dynamic cache; static
         cache (`disable_compile=True`); static cache compiled the way transformers compiles it
         for its users: its own automatic compile of the decoding forward with
         `compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")`, the cache created
         outside the compiled region (dynamo's CUDA-graph skips are reported: a skipped graph is
         an eager step). Warm-up: a 16-token run (eager settings), the full run (compiled).
         Two workloads:
           default  `--prompts` x `--n`, no stop tokens (every sample runs max_new tokens), as
                    measured before; all rows start and stop together (one bucket, no tail);
           gsm8k    the GSM8K GPU preset's shape: `--gsm8k-prompts` x n = 20, ragged prompt
                    lengths, `--gsm8k-stops` stop ids (random weights: samples end at random
                    times), so tails and bucket changes happen; length quantiles are reported.
         Ratios: `ours_over_hf_*` are *system* ratios: our sampler shares each prompt's prefill
         and K/V across its n samples and refills finished slots at once, transformers cannot
         (num_return_sequences copies the prompt; finished rows pad until the batch ends).
         `engine.ours_no_sharing_over_hf_*`: the default workload with every sample its own
         request (n = 1, prompts repeated): no sharing, every row the same length: decode engine
         against decode engine.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, replace

import torch
from bench._gpu_util import FIRST_ID, Ctx, free_memory, random_prompts, sync
from common.engine.sampler import decode_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams

LAUNCH_BOUND = 1.5  # wall / device time above this: the host, not the GPU, sets the pace


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list            # token ids per request
    n: int                   # samples per prompt
    max_new: int             # new tokens per sample at most
    stops: tuple = ()        # stop ids (none: every sample runs max_new tokens)


def workloads(ctx: Ctx) -> dict[str, Workload]:
    a = ctx.args
    g = random_prompts(a.gsm8k_prompts, a.gsm8k_prompt_min, a.gsm8k_prompt_max, ctx.shape["vocab_size"], a.seed + 1)
    return {"default": Workload("default", ctx.prompts, a.n, a.max_new),
            "gsm8k": Workload("gsm8k", g, a.gsm8k_n, a.max_new, tuple(range(FIRST_ID, FIRST_ID + a.gsm8k_stops)))}


def has_cuda_graphs() -> bool:
    """Whether this checkout's Sampler takes `cuda_graphs` (a captured decode step per batch bucket)."""
    return "cuda_graphs" in inspect.signature(Sampler.__init__).parameters


def has_overlap() -> bool:
    """Whether this checkout's Sampler takes `overlap` (a step launched before the last is recorded)."""
    return "overlap" in inspect.signature(Sampler.__init__).parameters


def has_fused_decode() -> bool:
    """Whether this checkout's Sampler takes `compile` / `flash` (the fused decode step)."""
    return {"compile", "flash"} <= set(inspect.signature(Sampler.__init__).parameters)


# The sampler settings a section runs (`--ours`): eager = each kernel launched from Python (the layer
# body compiled where the sampler compiles by default: CUDA); cuda_graphs = the default on CUDA;
# graphs_plain = captured, but the layer body uncompiled and attention dense (the step before fusion);
# overlap = captured, each step launched before the previous one is recorded (`Sampler(overlap=True)`).
VARIANTS = ("ours_eager", "ours_cuda_graphs", "ours_graphs_plain", "ours_overlap")


def variants(ctx: Ctx) -> dict[str, dict | str]:
    """name -> Sampler kwargs, or the reason the variant is skipped."""
    why = "Sampler has no cuda_graphs argument" if not has_cuda_graphs() else None if ctx.cuda else "not on CUDA"
    out = {"ours_eager": {"cuda_graphs": False} if has_cuda_graphs() else {},
           "ours_cuda_graphs": why or {"cuda_graphs": True},
           "ours_graphs_plain": why or ({"cuda_graphs": True, "compile": False, "flash": False} if has_fused_decode()
                                        else "Sampler has no compile / flash arguments"),
           "ours_overlap": why or ({"cuda_graphs": True, "overlap": True} if has_overlap()
                                   else "Sampler has no overlap argument")}
    return {k: v for k, v in out.items() if k in ctx.args.ours}


def new_sampler(ctx: Ctx, model, kw: dict, wl: Workload | None = None) -> Sampler:
    wl = wl or workloads(ctx)["default"]
    P = max(map(len, wl.prompts))
    return Sampler(model, max_batch=ctx.args.max_batch, max_seq_len=P + wl.max_new, max_prompt_len=P, **kw)


def sample_params(ctx: Ctx, seed: int, wl: Workload | None = None, max_new: int | None = None) -> SamplingParams:
    wl = wl or workloads(ctx)["default"]
    return SamplingParams(max_new_tokens=max_new or wl.max_new, temperature=ctx.args.temperature, n=wl.n,
                          stop_token_ids=wl.stops, seed=seed)


def _lengths(lens: list[int]) -> dict:
    q = sorted(lens)
    return {"mean": sum(q) / len(q), "p10": q[len(q) // 10], "p50": q[len(q) // 2], "p90": q[9 * len(q) // 10]}


PADDING = ("decode_rows", "decode_tokens", "run_prompt_rows", "live_prompt_rows", "run_own_cols", "live_own_cols",
           "run_prompt_cols", "live_prompt_cols")


def eager_fallbacks() -> dict:
    """Compiled decode pieces that fell back to eager, with how many shapes (empty: none; a figure
    measured with a fallback is not the compiled step's)."""
    return {k: len(v) for k, v in getattr(decode_model, "EAGER_SHAPES", {}).items() if v}


def run_ours(ctx: Ctx, model, kw: dict, wl: Workload) -> dict:
    s = new_sampler(ctx, model, kw, wl)
    t = time.perf_counter()
    s.generate(wl.prompts, sample_params(ctx, 1, wl))  # warm-up: the same work, so every bucket is met
    sync(ctx.device)
    warm = time.perf_counter() - t
    before = dict(s.stats)
    sync(ctx.device)
    t = time.perf_counter()
    outs = s.generate(wl.prompts, sample_params(ctx, 0, wl))
    sync(ctx.device)
    dt = time.perf_counter() - t
    ntok = sum(len(c.tokens) for c in outs)
    st = {k: s.stats[k] - before[k] for k in ("prefill_tokens", "decode_steps", *PADDING)}
    graphs = dict(s.graphed.stats, graphs=len(s.graphed.graphs)) if s.graphed is not None else None
    dec = getattr(s, "dec", None)
    fused = {"compiled": dec.compile, "flash": dec.flash, "packed_weights": len(dec.packed),
             "eager_fallbacks": eager_fallbacks()} if dec is not None else None
    return {"tok_s": ntok / dt, "seconds": dt, "tokens": ntok, "sequences": len(outs), "warmup_s": warm, "fused": fused,
            "all_full_length": all(len(c.tokens) == wl.max_new for c in outs), "lengths": _lengths([len(c.tokens) for c in outs]),
            "max_batch": ctx.args.max_batch, "dtype": str(model.dtype).replace("torch.", ""),
            "kv_dtype": str(s.cache.dtype).replace("torch.", ""), "graphs": graphs, **st, **kw}


def _left_pad(prompts, pad_id, device):
    L = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _hf_generate(ctx: Ctx, hf, wl: Workload, max_new: int, extra: dict) -> tuple[int, float]:
    """(generated tokens, wall s) of the whole workload in batches of --hf-batch sequences; with
    stop ids, a row's tokens count up to and including its first stop (the rest is padding)."""
    a = ctx.args
    per = max(1, a.hf_batch // wl.n)  # prompts per call; each returns n sequences
    stop = {"eos_token_id": list(wl.stops)} if wl.stops else {"min_new_tokens": max_new}
    ntok = 0
    torch.manual_seed(0)
    sync(ctx.device)
    t = time.perf_counter()
    for i in range(0, len(wl.prompts), per):
        ids, mask = _left_pad(wl.prompts[i:i + per], 0, ctx.device)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=a.temperature, top_k=0,
                              top_p=1.0, max_new_tokens=max_new, num_return_sequences=wl.n, pad_token_id=0,
                              **stop, **extra)
        gen = out[:, ids.shape[1]:]
        if wl.stops:
            hit = torch.isin(gen, torch.tensor(wl.stops, device=gen.device))
            first = torch.where(hit.any(1), hit.float().argmax(1) + 1, gen.shape[1])
            ntok += int(first.sum())
        else:
            ntok += gen.numel()  # min_new_tokens: no row stops early
    sync(ctx.device)
    return ntok, time.perf_counter() - t


def _dynamo_counts() -> dict:
    """Graphs dynamo compiled and CUDA-graph skips inductor logged in this process so far."""
    c = torch._dynamo.utils.counters
    return {"graphs": int(c["stats"].get("unique_graphs", 0)),
            "cudagraph_skips": int(sum(v for k, v in c["inductor"].items() if "cudagraph_skip" in k))}


def run_hf(ctx: Ctx, compiled: bool, static: bool, wl: Workload) -> dict:
    import transformers  # lazy: slow import, only this section needs it
    hf = transformers.AutoModelForCausalLM.from_pretrained(ctx.ckpt, dtype=ctx.prec.torch_dtype).to(ctx.device).eval()
    extra = {"cache_implementation": "static"} if static else {}
    if compiled:  # transformers' own automatic compile of the decoding step (its users' setting)
        extra["compile_config"] = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
        extra["disable_compile"] = False
    else:
        extra["disable_compile"] = True
    try:
        warm_new = wl.max_new if compiled else min(16, wl.max_new)
        c0 = _dynamo_counts()
        _, warm = _hf_generate(ctx, hf, wl, warm_new, extra)
        c1 = _dynamo_counts()
        ntok, dt = _hf_generate(ctx, hf, wl, wl.max_new, extra)
        c2 = _dynamo_counts()
    finally:
        if compiled:
            torch._dynamo.reset()  # drop the compiled graphs and their CUDA graph memory pools
        del hf
        free_memory(ctx.device)
    extra["compile_config"] = "CompileConfig(fullgraph=True, mode='reduce-overhead')" if compiled else None
    return {"tok_s": ntok / dt, "seconds": dt, "tokens": ntok, "warmup_s": warm, "warmup_new_tokens": warm_new,
            "batch": min(ctx.args.hf_batch, len(wl.prompts) * wl.n), **extra,
            "graphs_compiled_in_warmup": c1["graphs"] - c0["graphs"] if compiled else None,
            "graphs_compiled_in_timed_run": c2["graphs"] - c1["graphs"] if compiled else None,  # must be 0
            "cudagraph_skips": c2["cudagraph_skips"] - c0["cudagraph_skips"] if compiled else None}


HF_SETTINGS = {"hf_dynamic": (False, False), "hf_static": (False, True), "hf_static_compiled": (True, True)}


def _hf_runs(ctx: Ctx, wl: Workload, names) -> dict:
    out = {}
    for name in names:
        comp, static = HF_SETTINGS[name]
        if ctx.args.skip_hf:
            out[name] = {"skipped": "--skip-hf"}
        elif comp and not ctx.args.hf_compile:
            out[name] = {"skipped": "no torch.compile (--no-hf-compile, the --smoke default)"}
        else:
            out[name] = run_hf(ctx, comp, static, wl)
            ctx.progress(f"{wl.name} {name}", {wl.name: out})
    return out


def _ours(ctx: Ctx, model, wl: Workload) -> dict:
    out = {}
    for name, kw in variants(ctx).items():
        c0 = _dynamo_counts()
        out[name] = run_ours(ctx, model, kw, wl) if isinstance(kw, dict) else {"skipped": kw}
        if isinstance(kw, dict):
            out[name]["graphs_compiled"] = _dynamo_counts()["graphs"] - c0["graphs"]  # the layer body's pieces
        free_memory(ctx.device)
        ctx.progress(f"{wl.name} {name}", {wl.name: out})
    out["ours_best"] = max((v["tok_s"], k) for k, v in out.items() if "tok_s" in v)[1]
    return out


def _ratios(out: dict, prefix: str = "ours") -> None:
    """ours_over_<hf setting> (the best of ours) and <variant>_over_<setting> for the other variant."""
    best = out["ours_best"]
    for name in HF_SETTINGS:
        if "tok_s" in out.get(name, {}):
            out[f"{prefix}_over_{name}"] = out[best]["tok_s"] / out[name]["tok_s"]
            for k in VARIANTS:
                if "tok_s" in out.get(k, {}) and k != best:
                    out[f"{k}_over_{name}"] = out[k]["tok_s"] / out[name]["tok_s"]


# the section's parts (`--sampler-parts`): the default workload, then the same with every sample its
# own request (engine against engine), then the GSM8K-shaped one
SAMPLER_PARTS = ("default", "engine", "gsm8k")


def sampler_section(ctx: Ctx) -> dict:
    a = ctx.args
    wls = workloads(ctx)
    model = ctx.prec.load(ctx.ckpt, device=ctx.device, role="generator", tokenizer=False)[0]
    d, g = wls["default"], wls["gsm8k"]
    out = {"workload": {"prompts": len(d.prompts), "n": d.n, "prompt_len": [a.prompt_min, a.prompt_max],
                        "max_new_tokens": d.max_new, "temperature": a.temperature, "stop_tokens": None},
           "sampler_has_cuda_graphs": has_cuda_graphs(), **_ours(ctx, model, d)}
    # engine against engine: every sample its own request (no prompt sharing), same rows and lengths
    parts = getattr(a, "sampler_parts", SAMPLER_PARTS)
    distinct = replace(d, name="default_no_sharing", prompts=[p for p in d.prompts for _ in range(d.n)], n=1)
    eng = {"ours_no_sharing": run_ours(ctx, model, variants(ctx)[out["ours_best"]], distinct),
           "variant": out["ours_best"]} if "engine" in parts else None
    gsm = {"workload": {"prompts": len(g.prompts), "n": g.n, "prompt_len": [a.gsm8k_prompt_min, a.gsm8k_prompt_max],
                        "max_new_tokens": g.max_new, "stop_ids": len(g.stops)}, **_ours(ctx, model, g)} \
        if "gsm8k" in parts else None
    del model
    free_memory(ctx.device)
    out.update(_hf_runs(ctx, d, a.hf_settings))
    _ratios(out)
    if eng is not None:
        for name in HF_SETTINGS:
            if "tok_s" in out.get(name, {}):
                eng[f"ours_no_sharing_over_{name}"] = eng["ours_no_sharing"]["tok_s"] / out[name]["tok_s"]
        out["engine"] = eng
    if gsm is not None:
        gsm.update(_hf_runs(ctx, g, [h for h in ("hf_static", "hf_static_compiled") if h in a.hf_settings]))
        _ratios(gsm)
        out["gsm8k"] = gsm
    out["ratios"] = {"ours_over_hf_*": "system (prompt sharing and slot refill included)",
                     "engine.ours_no_sharing_over_hf_*": "engine (no sharing, equal rows and lengths)"}
    return out
