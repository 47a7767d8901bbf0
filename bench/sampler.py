"""Sampler throughput: our KV-cache continuous-batching sampler vs transformers' `generate`.

Single process, default model, one thread (as every process of a run: docs/internals.md, "CPU threads"). Ours runs at the precision
the runtime picks for this machine (`common/engine/machine/precision.py`, `--dtype auto`; the choice is in the
JSON line) and, with `--vs-fp32`, also in fp32 (the previous default). transformers runs in fp32
(its default, as a user runs it) and in bf16; `speedup_tok_s` is against the faster of the two.
Workload: `--prompts` GSM8K test questions in the chat template, `--n` samples each,
temperature 0.7, up to `--max-new` tokens, stop at EOS; transformers runs the same prompts in
batches of `--hf-batch` sequences with its default cache, no top-k/top-p (same distribution),
each batch size of the list in each dtype; the fastest setting (dtype and batch) is the baseline:
transformers' best on this machine (which batch wins differs between machines).
Also: decode tokens/s at batch 1 against the memory-bandwidth limit (weight bytes / measured
bandwidth). Prints one JSON line.

    python bench/sampler.py --vs-fp32  # full benchmark (~40 min on 2 CPU cores: transformers at 4 batches x 2 dtypes)
    python bench/sampler.py --skip-hf-fp32 --pairs 3  # against transformers in bf16, three alternating pairs
    python bench/sampler.py --skip-hf-fp32 --hf-batch 128  # transformers in bf16 at one batch size
    python bench/sampler.py --quick    # smoke check (< 1 min)
    python bench/sampler.py --host-only  # host ms per decode step at 256 rows, tiny model (~10 s)
    python bench/sampler.py --compile-ab --skip-hf  # the decode step's layer body eager vs compiled
    python bench/sampler.py --decode-gemm-ab --skip-hf  # bf16 decode GEMMs on packed vs plain weights
    python bench/sampler.py --arch pythia-160m  # a random GPT-NeoX of Pythia-160M's shape (bench/_arch.py)

`--arch` runs another family on the same workload: a random model of that published shape built
locally (common/engine/checkpoints/shapes.py), the prompts tokenised with the default model's tokenizer.

Host work per decode step (`host_ms_per_step`, in every run): the time `Sampler.step` spends
outside the model (planning, bookkeeping, recording), measured as step time minus the time in
the decode step, the prefills and the first-token draws, at the GSM8K GPU preset's batch shape
(256 slots, 13 prompts x n = 20 in flight). On a GPU this is the work that must hide behind
the device's; on the CPU it is measured the same way, with a tiny model so that it dominates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import common.engine.sampler.live_batch as live_batch_mod  # noqa: E402
import common.engine.sampler.sampler as sampler_mod  # noqa: E402
from common.engine.checkpoints.hf_io import load_model  # noqa: E402
from common.engine.model.linear import onednn_enabled, set_onednn  # noqa: E402
from common.engine.machine.decode_choice import compile_ab  # noqa: E402
from common.engine.machine.precision import Precision, PrecisionConfig, resolve  # noqa: E402
from common.engine.sampler.sampler import Sampler  # noqa: E402
from common.engine.sampler.sampling import SamplingParams  # noqa: E402
from common.engine.checkpoints.tiny_model import build_tiny  # noqa: E402
from common.runtime.process import keep_freed_memory  # noqa: E402
from run_gsm8k import default_data_dir, format_prompt, load_split  # noqa: E402
from bench._arch import add_arch_arg, arch_dir, prompt_tokenizer  # noqa: E402


def bandwidths(nbytes=512 * 2**20, reps=5) -> tuple[float, float]:
    """(copy, read) bytes/s on one thread: bytes copied per second by a large tensor copy (the
    "copy bandwidth"; each byte is read once and written once), and bytes read per
    second by a sum (what a batch-1 decode needs: it only reads weights)."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    a.sum()
    copy = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
    read = min(_timed(lambda: a.sum()) for _ in range(reps))
    return nbytes / copy, nbytes / read


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def decode_tok_s_batch1(model, prompt, n_tokens=64) -> float:
    s = Sampler(model, max_batch=1, max_seq_len=len(prompt) + n_tokens + 1)
    p = SamplingParams(max_new_tokens=n_tokens, temperature=0.7, seed=0)
    s.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.7))  # warm-up
    s.submit(prompt, p)
    s.step()  # prefill (+ first token): excluded, this measures decode only
    t, n = time.perf_counter(), 0
    while s.has_work():
        s.step()
        n += 1
    return n / (time.perf_counter() - t)


def workload(tok, n_prompts: int, n: int, max_new: int) -> tuple[list[list[int]], SamplingParams]:
    """The benchmark's prompts (the first GSM8K test questions in the chat template, token ids) and
    sampling parameters (module docstring)."""
    data = load_split(str(default_data_dir()), "test", limit=n_prompts)
    prompts = [tok(format_prompt(ex.question, tok, "chat"), add_special_tokens=False)["input_ids"] for ex in data]
    return prompts, SamplingParams(max_new_tokens=max_new, temperature=0.7, n=n, stop_token_ids=(tok.eos_token_id,),
                                   seed=0)


def warm_sampler(model, prompts, params, max_batch) -> Sampler:
    """Our sampler sized for the workload, warmed up: one row, then several (a compiled layer body
    compiles for both here)."""
    P = max(len(p) for p in prompts)
    s = Sampler(model, max_batch=max_batch, max_seq_len=P + params.max_new_tokens, max_prompt_len=P)
    for k in (1, 2):
        s.generate(prompts[:k], SamplingParams(max_new_tokens=4, temperature=0.7, n=k))
    return s


def run_ours(model, prompts, params, max_batch) -> dict:
    t = time.perf_counter()
    s = warm_sampler(model, prompts, params, max_batch)
    warm = time.perf_counter() - t
    t = time.perf_counter()
    outs = s.generate(prompts, params, progress=True)
    dt = time.perf_counter() - t
    ntok = sum(len(c.tokens) for c in outs)
    return {"tokens": ntok, "seconds": dt, "tok_s": ntok / dt, "max_batch": max_batch, "onednn": onednn_enabled(),
            "dtype": str(model.dtype).replace("torch.", ""), "kv_dtype": str(s.cache.dtype).replace("torch.", ""),
            "prefill_tokens": s.stats["prefill_tokens"], "decode_steps": s.stats["decode_steps"],
            "decode_rows": s.stats["decode_rows"], "compiled": s.dec.compile, "packed": s.dec.packed_gemm,
            "warmup_s": warm}


def decode_gemm_ab(model, prompts, params, max_batch, rounds: int) -> dict:
    """Ours with the decode GEMMs on oneDNN-packed weights and on plain ones (`precision.decode_gemm`),
    the whole workload each, alternating `rounds` times: tok/s and the median per-round ratio."""
    keep, rates = getattr(model, "decode_packed", False), {True: [], False: []}
    try:
        for _ in range(rounds):
            for packed in (True, False):
                model.decode_packed = packed
                rates[packed].append(run_ours(model, prompts, params, max_batch)["tok_s"])
    finally:
        model.decode_packed = keep
    return {"packed_tok_s": rates[True], "plain_tok_s": rates[False], "rounds": rounds,
            "packed_over_plain": statistics.median(p / q for p, q in zip(rates[True], rates[False]))}


def host_ms_per_step(model, rows: int = 256, n: int = 20, max_new: int = 48, seed: int = 0, ragged: bool = True) -> dict:
    """Host ms per decode step: `Sampler.step` time minus the time inside the model calls it
    makes (decode step, prompt and continuation prefill, first-token draws), over a schedule of
    ceil(rows / n) + 1 prompts x n samples of random lengths (stop token 3 of a random model);
    `ragged=False`: rows / n prompts, no stop token, every row busy every step (steady decode,
    the GPU decode section's shape; the admitting first step is not counted)."""
    inside, ops = [0.0, 0], [0]
    names = ("decode_step", "prefill_prompts", "prefill_continuations", "sample")  # the first-token draw: live_batch
    saved = {(mod, k): getattr(mod, k) for mod in (sampler_mod, live_batch_mod) for k in names if hasattr(mod, k)}

    def timed(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            inside[1] += 1
            try:
                out = fn(*a, **kw)
            finally:
                inside[1] -= 1
            if torch.is_tensor(out[0]) and out[0].is_cuda:
                torch.cuda.synchronize()
            inside[0] += time.perf_counter() - t
            return out
        return run

    class CountOps(TorchDispatchMode):  # torch ops the sampler runs outside the model calls (launches, on a GPU)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += inside[1] == 0
            return func(*args, **(kwargs or {}))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, model.cfg.vocab_size, (int(L),), generator=g).tolist()
               for L in torch.randint(20, 120, (rows // n + 2 if ragged else rows // n,), generator=g)]
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, n=n, stop_token_ids=(3,) if ragged else (), seed=seed)
    # the layer body eager: the op counter's dispatch mode cannot run under torch.compile, and the
    # host's work (outside the model calls) is the same either way
    s = Sampler(model, max_batch=rows, max_seq_len=128 + max_new, max_prompt_len=128, compile=False)
    s.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=1.0, n=2))  # warm-up
    for (mod, k), fn in saved.items():
        setattr(mod, k, timed(fn))
    try:
        for q in prompts:
            s.submit(q, params)
        if not ragged:
            s.step()  # admits every prompt
            inside[0] = 0.0
        t, steps, peak = time.perf_counter(), 0, 0
        while s.has_work():
            peak = max(peak, s.num_active)
            s.step()
            steps += 1
        total = time.perf_counter() - t
        host = total - inside[0]
        s.generate(prompts, params)  # the same schedule again, counting torch ops (not timed: the mode slows it)
        with CountOps():
            s.generate(prompts, params)
    finally:
        for (mod, k), fn in saved.items():
            setattr(mod, k, fn)
    return {"host_ms_per_step": 1e3 * host / steps, "host_ops_per_step": ops[0] / steps,
            "step_ms": 1e3 * total / steps,
            "steps": steps, "peak_rows": peak, "rows": rows, "n": n}


def run_hf(hf, prompts, params, batch, pad_id, eos_id) -> dict:
    per = max(1, batch // params.n)  # prompts per generate call; each returns n sequences
    t, ntok = time.perf_counter(), 0
    torch.manual_seed(0)
    for i in range(0, len(prompts), per):
        chunk = prompts[i:i + per]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature,
                              top_k=0, top_p=1.0, max_new_tokens=params.max_new_tokens,
                              num_return_sequences=params.n, eos_token_id=eos_id, pad_token_id=pad_id)
        gen = out[:, L:]
        for row in gen.tolist():  # count up to and including the first EOS
            ntok += row.index(eos_id) + 1 if eos_id in row else len(row)
    dt = time.perf_counter() - t
    return {"tokens": ntok, "seconds": dt, "tok_s": ntok / dt, "batch": batch}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=128, help="our sampler's slots (128 beat 64 here: 137 vs 119 tok/s)")
    ap.add_argument("--hf-batch", default="16,32,64,128",
                    help="transformers' batches (sequences per generate call) to run; the fastest counts")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 2 samples x 32 tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="our precision (auto: measured)")
    ap.add_argument("--vs-fp32", action="store_true", help="also run ours in fp32 (the pre-auto default)")
    ap.add_argument("--skip-hf-bf16", action="store_true", help="run transformers in fp32 only")
    ap.add_argument("--skip-hf-fp32", action="store_true", help="run transformers in bf16 only")
    ap.add_argument("--pairs", type=int, default=1,
                    help="ours and transformers' best, alternating this many times: speedup_tok_s the median ratio")
    ap.add_argument("--host-only", action="store_true", help="only host ms per decode step, on a tiny random model")
    ap.add_argument("--compile-ab", action="store_true",
                    help="also run ours with the decode step's layer body compiled (inductor's C++ backend on CPU)")
    ap.add_argument("--ab-rounds", type=int, default=3, help="--compile-ab, --decode-gemm-ab: alternating timed rounds")
    ap.add_argument("--decode-gemm-ab", action="store_true",
                    help="also ours with the decode GEMMs on packed and plain weights, alternating (bf16 on CPU)")
    ap.add_argument("--ablate-onednn", action="store_true",
                    help="also run ours with F.linear (MKL) GEMMs, to separate the GEMM backend from the engine")
    add_arch_arg(ap)
    a = ap.parse_args()
    if a.skip_hf_fp32 and a.skip_hf_bf16:
        ap.error("--skip-hf-fp32 with --skip-hf-bf16 leaves no transformers run (use --skip-hf)")
    try:
        hf_batches = [int(b) for b in a.hf_batch.split(",")]
    except ValueError:
        ap.error(f"--hf-batch {a.hf_batch!r}: give a batch size or a comma list of them")
    if min(hf_batches) < 1:
        ap.error("--hf-batch: batch sizes are >= 1")
    if a.quick:
        a.prompts, a.n, a.max_new = 4, 2, 32
    if a.arch:
        a.model = arch_dir(a.arch)
    torch.set_num_threads(a.threads)
    keep_freed_memory()  # as a generator process does (ASYNCRL_MALLOC=system: glibc's defaults)
    if a.host_only:
        with tempfile.TemporaryDirectory() as d:
            build_tiny(d, vocab_size=97, hidden_size=32, intermediate_size=64, head_dim=8)
            tiny = load_model(d, tokenizer=False)[0]
            print(json.dumps({"bench": "sampler_host", "device": "cpu", "model": "tiny llama",
                              **host_ms_per_step(tiny), "steady": host_ms_per_step(tiny, n=4, ragged=False)}))
        return
    prec = resolve(PrecisionConfig(dtype=a.dtype)).apply()
    print(f"[bench] precision: {prec.summary()}", file=sys.stderr)
    model, tok = prec.load(a.model)
    tok = tok or prompt_tokenizer(a.model)
    prompts, params = workload(tok, a.prompts, a.n, a.max_new)
    eos = tok.eos_token_id

    res = {"bench": "sampler", "model": a.model, "arch": a.arch, "device": "cpu", "threads": a.threads, "prompts": a.prompts,
           "n": a.n, "max_new_tokens": a.max_new, "quick": a.quick, "cpu": prec.cpu.get("model"),
           "precision": {k: v for k, v in prec.to_dict().items() if k != "cpu"}}
    bw, rbw = bandwidths()
    wb = weight_bytes(model)
    b1 = decode_tok_s_batch1(model, prompts[0], n_tokens=16 if a.quick else 64)
    res.update(weight_bytes=wb, copy_bw_gb_s=bw / 1e9, bw_limit_tok_s=bw / wb, batch1_tok_s=b1,
               batch1_frac_of_bw=b1 * wb / bw, read_bw_gb_s=rbw / 1e9, read_bw_limit_tok_s=rbw / wb,
               batch1_frac_of_read_bw=b1 * wb / rbw)
    res["ours"] = run_ours(model, prompts, params, a.max_batch)
    res["host"] = host_ms_per_step(model, max_new=8 if a.quick else 48)
    if a.compile_ab:
        res["compile_ab"] = compile_ab(model, prompts, params, a.max_batch, a.ab_rounds)
    if a.decode_gemm_ab:
        res["decode_gemm_ab"] = decode_gemm_ab(model, prompts, params, a.max_batch, a.ab_rounds)
    if a.ablate_onednn:
        old = set_onednn(False)
        res["ours_mkl_gemm"] = run_ours(model, prompts, params, a.max_batch)
        set_onednn(old)
    if a.vs_fp32 and prec.dtype != "fp32":
        fp32 = Precision("fp32", prec.gemm, "fp32")  # same GEMM backend: the dtype is the only change
        res["ours_fp32"] = run_ours(fp32.load(a.model, tokenizer=False)[0], prompts, params, a.max_batch)
        res["auto_vs_fp32_tok_s"] = res["ours"]["tok_s"] / res["ours_fp32"]["tok_s"]
    if not a.skip_hf:
        import transformers
        from common.engine.checkpoints.hf_io import resolve_checkpoint
        hf = transformers.AutoModelForCausalLM.from_pretrained(  # same weights, transformers' model
            str(resolve_checkpoint(a.model)), dtype=torch.float32).eval()
        pad = tok.pad_token_id or eos
        # batch sizes that put the same prompts in each generate call run once (prompts per call: batch // n)
        distinct = {min(len(prompts), max(1, b // a.n)): b for b in sorted(hf_batches, reverse=True)}
        hf_batches = sorted(distinct.values())
        settings = [(dt, b) for dt in (["fp32"] if not a.skip_hf_fp32 else []) + (["bf16"] if not a.skip_hf_bf16 else [])
                    for b in hf_batches]
        runs = {}
        for dt, b in settings:  # fp32 first: `hf` is cast in place once, to bf16
            name = "hf_generate" + ("_bf16" if dt == "bf16" else "") + (f"_b{b}" if len(hf_batches) > 1 else "")
            runs[name] = run_hf(hf.to(torch.bfloat16 if dt == "bf16" else torch.float32), prompts, params, b, pad, eos)
            runs[name]["dtype"] = dt
        res.update(runs)
        best = max(runs, key=lambda k: runs[k]["tok_s"])
        res["hf_best"] = best
        res["speedup_tok_s"] = res["ours"]["tok_s"] / runs[best]["tok_s"]
        res["speedup_wall"] = runs[best]["seconds"] / res["ours"]["seconds"]
        if a.pairs > 1:  # ours and transformers' best again, alternating: the host's drift hits both alike
            # (fp32 after a bf16 run: weights rounded to bf16 and back, the same speed)
            hf_best = hf.to(torch.bfloat16 if runs[best]["dtype"] == "bf16" else torch.float32)
            ratios = [res["speedup_tok_s"]]
            for _ in range(a.pairs - 1):
                o = run_ours(model, prompts, params, a.max_batch)["tok_s"]
                ratios.append(o / run_hf(hf_best, prompts, params, runs[best]["batch"], pad, eos)["tok_s"])
            res["speedup_tok_s_pairs"] = ratios
            res["speedup_tok_s"] = statistics.median(ratios)
        if a.ablate_onednn:
            res["speedup_tok_s_mkl_gemm"] = res["ours_mkl_gemm"]["tok_s"] / runs[best]["tok_s"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
