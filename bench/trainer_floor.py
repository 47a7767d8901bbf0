"""One trainer micro-batch on CPU against its FLOP floor and against transformers, with a profile.

Single process, one thread, fp32 (the precision of a CPU without bf16 units; `--dtype auto`
takes this machine's choice for ours). The work: `--rows` x `--tokens` random tokens of the
default model, loss on the last half of each row (completions after a prompt), forward +
backward, no optimizer step:
  ours          `common.contracts.ops.token_logp(model, tokens, T, mask).sum().backward()`, the trainer's call
  transformers  its own fp32 model (SDPA attention) with `logits_to_keep` = the scored span,
                log-softmax of logits / T, the targets' log-probs summed, backward: what a careful
                user of transformers writes
`--sdpa` adds ours with SDPA's CPU flash kernel for attention (the attention kernel's A/B).
`--no-fused`: ours (every variant) with fused.py off, the plain MLP and RMSNorm expressions;
compare two invocations, not both within one: alternated in one process, the two paths' different
memory peaks made the plain one's times swing widely (BENCHMARKS.md), the allocator's state, not the code.
`--group n`: rows in groups of n sharing their prompt (the first half of the row), as the trainer's
batches are (n samples per prompt); ours is then the trainer's call with `prompt_lens` (each prompt
run once: common/engine/model/prefix.py) and `ours_unshared` the same rows each in full. The floor stays
that of the rows in full: `frac_of_floor` is the unshared engine's, `shared_speedup` what running
each prompt once saves, `speedup_vs_transformers` ours (shared) against transformers on the same rows,
`shared_frac_of_own_floor` ours (shared) against the floor of the work it runs (the packed tokens).
`--compile` adds ours with `train.compile_blocks` (common/engine/model/transformer.py: compiled_block). The runs
alternate `--reps` times after one warm-up each (drift on a shared machine hits both
alike); medians. The floor (bench/_floor.py) is every GEMM of the step timed alone at its shape
on this machine, measured again before every rep; `frac_of_floor` is the median of each rep's
floor / ours, so a machine whose speed drifts between reps moves both alike (on a shared host one
floor for all reps misled by several points: BENCHMARKS.md, the AVX2 EPYC section).
`--other-gemm` adds ours on the fp32 GEMM backend `precision` did not pick (its choice's A/B on the whole step).
`--backend-ab`: the step's GEMMs in their own layouts (forward, dX, dW) on oneDNN and ATen alternating
call by call (bench/_floor.py: backend_ab): the floor times every GEMM in the forward layout only.
`--gemm-check`: one more step of ours with every GEMM also run again at once where it stands
(bench/_floor.py: gemms_in_place): whether the step's GEMMs run below their own rate in place.

`--beside-generator`: ours alone and with a generator process decoding on the other core (fp32
sampler, one thread), alternating: what memory bandwidth and caches shared with a generator cost.
`--beside-gemm`: the same with a process running fp32 GEMMs instead (compute-bound, like a
generator's prefill and reference passes): what sharing the arithmetic units costs, if any.

The profile (unless `--no-profile`): one more pass of ours under torch.profiler, each operator's own time by kind
(GEMM, attention kernel, elementwise, copies, allocation, other) and by model part (attention
block, MLP, norms, head, the rest: embedding, RoPE tables, loss glue), forward and backward
apart (bench/_profile.py).

    python bench/trainer_floor.py                  # 16 x 200 tokens, 3 reps, with the profile
    python bench/trainer_floor.py --quick          # 4 x 64 tokens, 1 rep
    python bench/trainer_floor.py --compile        # also with train.compile_blocks
    python bench/trainer_floor.py --beside-generator --no-hf --no-profile   # alone vs beside a generator
    python bench/trainer_floor.py --arch pythia-160m   # a random GPT-NeoX of Pythia-160M's shape (bench/_arch.py)
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench._arch import add_arch_arg, arch_dir  # noqa: E402
from bench._floor import backend_ab, frac_of_floor, gemm_floor, gemms_in_place, work_args  # noqa: E402
from bench._profile import profile  # noqa: E402
from common.engine.model.causal_attention import set_kernel  # noqa: E402
from common.engine.model.fused import set_fused  # noqa: E402
from common.engine.checkpoints.hf_io import resolve_checkpoint  # noqa: E402
from common.engine.machine.precision import Precision, PrecisionConfig, resolve  # noqa: E402
from common.engine.model.linear import linear, onednn_available, onednn_enabled, set_onednn  # noqa: E402
from common.engine.model.prefix import SharedPrefixes  # noqa: E402
from common.engine.sampler.sampler import Sampler  # noqa: E402
from common.engine.sampler.sampling import SamplingParams  # noqa: E402
from common.contracts.ops import token_logp  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402

def ours_step(model, tokens, mask, T, prompt_lens=None):
    token_logp(model, tokens, T, mask, prompt_lens=prompt_lens).sum().backward()
    model.zero_grad(set_to_none=True)


def ours_sdpa_step(model, tokens, mask, T):
    """ours with PyTorch's CPU flash kernel for attention (precision.attention=sdpa)."""
    old = set_kernel(False)
    try:
        ours_step(model, tokens, mask, T)
    finally:
        set_kernel(old)


def ours_other_gemm_step(model, tokens, mask, T):
    """ours on the fp32 GEMM backend `precision` did not pick (oneDNN <-> ATen)."""
    old = set_onednn(not onednn_enabled())
    try:
        ours_step(model, tokens, mask, T)
    finally:
        set_onednn(old)


def hf_step(model, tokens, mask, T):
    keep = tokens.shape[1] - int(mask[0].nonzero()[0]) + 1  # logits of the position before each scored token
    logits = model(tokens, logits_to_keep=keep).logits[:, :-1].float()  # (B, keep-1, V)
    lp = F.log_softmax(logits / T, -1).gather(-1, tokens[:, -(keep - 1):, None]).squeeze(-1)
    lp.sum().backward()
    model.zero_grad(set_to_none=True)


def _decode_forever(model: str, gemm: str, ready) -> None:
    """--beside-generator: a generator's work on the other core (fp32 sampler, 16 samples of 4
    prompts, 96 new tokens, over and over) until killed."""
    set_process_defaults("cpu")
    prec = Precision("fp32", gemm, "fp32").apply()
    m, _ = prec.load(model, tokenizer=False)
    s = Sampler(m, max_batch=16, max_seq_len=300, max_prompt_len=100)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, m.cfg.vocab_size, (100,), generator=g).tolist() for _ in range(4)]
    ready.set()
    while True:
        s.generate(prompts, SamplingParams(max_new_tokens=96, temperature=0.7, n=4, seed=0))


def _gemm_forever(model: str, gemm: str, ready) -> None:
    """--beside-gemm: compute-bound work on the other core, as a generator's prompt prefill and
    reference passes are: one fp32 GEMM at a trainer MLP shape (3,200 x 576 x 1,536), over and over,
    on the same backend, until killed. Set beside decoding (bandwidth-bound), it tells whether the
    two cores share their arithmetic units (SMT siblings on the host) or only caches and memory."""
    set_process_defaults("cpu")
    Precision("fp32", gemm, "fp32").apply()
    x, w = torch.randn(3200, 576), torch.randn(1536, 576)
    ready.set()
    while True:
        linear(x, w)


def beside(a, prec, step, reps: int, neighbour=_decode_forever) -> dict:
    """Step seconds alone and with `neighbour` running in a process beside it, alternating."""
    ctx = mp.get_context("spawn")
    alone, beside = [], []
    for _ in range(reps):
        alone.append(step())
        ready = ctx.Event()
        gen = ctx.Process(target=neighbour, args=(a.model, prec.gemm, ready), daemon=True)
        gen.start()
        ready.wait(300)
        time.sleep(2)  # the neighbour at full speed
        beside.append(step())
        gen.kill()
        gen.join()
    return {"alone_s": round(statistics.median(alone), 3), "beside_s": round(statistics.median(beside), 3),
            "alone_all": [round(t, 3) for t in alone], "beside_all": [round(t, 3) for t in beside],
            "beside_over_alone": round(statistics.median(beside) / statistics.median(alone), 3)}


def _packed_work(tokens, plens, length: int) -> tuple[int, int]:
    """(tokens, causal attention pairs) the packed pass runs for rows of `length` tokens (the last
    scored one's predictor ends each row) sharing prompts of `plens` (common/engine/model/prefix.py)."""
    L = SharedPrefixes.build(tokens, plens, torch.full_like(plens, length))
    pre = [int(n) for n in L.pre_valid.sum(1)]
    suf = [int(n) for n in L.suf_valid.sum(1)]
    pairs = sum(p * (p + 1) // 2 for p in pre) + sum(s * int(q) + s * (s + 1) // 2 for s, q in zip(suf, L.pre_len))
    return L.n_tokens, pairs


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    work_args(ap)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "auto"), help="ours: fp32, or this machine's choice")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--compile", action="store_true", help="also ours with train.compile_blocks (its warm-up compiles)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--sdpa", action="store_true",
                    help="also ours with SDPA's CPU flash kernel for attention instead of ours (precision.attention=sdpa)")
    ap.add_argument("--no-fused", action="store_true",
                    help="fused.py off: the plain MLP and RMSNorm expressions (compare two invocations)")
    ap.add_argument("--beside-gemm", action="store_true",
                    help="also time ours alone vs beside a process running fp32 GEMMs (compute-bound) on the other core")
    ap.add_argument("--beside-generator", action="store_true",
                    help="also ours alone vs with a decoding generator process on the other core")
    ap.add_argument("--gemm-check", action="store_true",
                    help="also time every GEMM of one step in place and again at once (are they below their rate?)")
    ap.add_argument("--other-gemm", action="store_true",
                    help="also ours on the other fp32 GEMM backend (precision.gemm's A/B on the whole step)")
    ap.add_argument("--backend-ab", action="store_true",
                    help="also the step's GEMMs in their own layouts on oneDNN vs ATen, alternating (which should it run?)")
    ap.add_argument("--group", type=int, default=1,
                    help="rows in groups of this many sharing their prompt (the first half); > 1 adds ours_unshared")
    ap.add_argument("--quick", action="store_true")
    add_arch_arg(ap)
    a = ap.parse_args()
    if a.quick:
        a.rows, a.tokens, a.reps = 4, 64, 1
    if a.arch:
        a.model = arch_dir(a.arch)
    set_process_defaults("cpu")  # one thread, freed memory kept: as the trainer runs
    set_fused(not a.no_fused)
    auto = resolve(PrecisionConfig())
    prec = Precision("fp32", auto.gemm, "fp32", auto.attention) if a.dtype == "fp32" else auto
    prec.apply()
    T = 0.7
    ours, _ = prec.load(a.model, role="trainer", tokenizer=False)
    ours.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ours.cfg.vocab_size, (a.rows, a.tokens), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, a.tokens // 2:] = True
    if a.group < 1 or a.rows % a.group:
        raise SystemExit(f"--group {a.group} must divide --rows {a.rows}")
    for r in range(a.rows):  # each row's prompt is its group's first row's
        tokens[r, :a.tokens // 2] = tokens[r - r % a.group, :a.tokens // 2]
    plens = torch.full((a.rows,), a.tokens // 2)
    packed = _packed_work(tokens, plens, a.tokens - 1) if a.group > 1 else None  # (tokens run, attention pairs)
    runs = {"ours": (functools.partial(ours_step, prompt_lens=plens), ours)}
    if a.group > 1:
        runs["ours_unshared"] = (ours_step, ours)
    if a.sdpa:
        runs["ours_sdpa"] = (ours_sdpa_step, ours)
    if a.other_gemm:
        if not onednn_available():
            raise SystemExit("--other-gemm: this PyTorch has no oneDNN linear (one backend only)")
        runs["ours_other_gemm"] = (ours_other_gemm_step, ours)
    if a.compile:
        compiled, _ = prec.load(a.model, role="trainer", tokenizer=False)
        compiled.train().compile_blocks = True
        runs["ours_compiled"] = (ours_step, compiled)
    if not a.no_hf:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_checkpoint(a.model), dtype=torch.float32,
                                                               attn_implementation="sdpa").train()
        runs["transformers"] = (hf_step, hf)
    times = {k: [] for k in runs}
    for fn, m in runs.values():
        fn(m, tokens, mask, T)  # warm-up
    scored = int(mask[:, 1:].sum())  # targets: token t+1 scored at position t
    floors, packed_floors = [], []
    for _ in range(a.reps):
        floors.append(gemm_floor(ours.cfg, a.rows, a.tokens, scored, reps=2))  # beside each rep: drift hits both
        if packed:
            packed_floors.append(gemm_floor(ours.cfg, a.rows, a.tokens, scored, reps=2, packed=packed))
        for k, (fn, m) in runs.items():
            times[k].append(_timed(fn, m, tokens, mask, T))
    floor = sorted(floors, key=lambda f: f["floor_s"])[len(floors) // 2]  # the median rep's floor

    def frac(k: str) -> float:
        return round(frac_of_floor(floors, times[k]), 3)
    res = {"bench": "trainer_floor", "model": a.model, "arch": a.arch, "cpu": auto.cpu.get("model"), "flags": auto.cpu.get("flags"),
           "threads": torch.get_num_threads(), "fused": not a.no_fused, "rows": a.rows, "tokens": a.tokens, "scored": scored, "reps": a.reps,
           "precision": prec.summary(), "tflop": round(floor["tflop"], 3),
           "floor_s": round(floor["floor_s"], 3), "floor_all": [round(f["floor_s"], 3) for f in floors], "floor_parts_s": {k: round(v, 3) for k, v in floor["parts_s"].items()},
           "floor_backend": floor["backend"], "gemm_gflops_best": round(floor["gemm_gflops_best"], 1)}
    for k, ts in times.items():
        res[f"{k}_s"] = round(statistics.median(ts), 3)
        res[f"{k}_all"] = [round(t, 3) for t in ts]
    res["group"] = a.group
    if a.group > 1:  # the floor is that of the rows in full: the unshared engine against it
        res["frac_of_floor"] = frac("ours_unshared")
        res["shared_speedup"] = round(statistics.median(u / t for u, t in zip(times["ours_unshared"], times["ours"])), 3)
        # ours against the floor of the work it runs: the packed tokens' GEMMs, the same head
        pf = sorted(packed_floors, key=lambda f: f["floor_s"])[len(packed_floors) // 2]
        res["packed_tokens"], res["packed_pairs"] = packed
        res["packed_floor_s"], res["packed_tflop"] = round(pf["floor_s"], 3), round(pf["tflop"], 3)
        res["shared_frac_of_own_floor"] = round(frac_of_floor(packed_floors, times["ours"]), 3)
    else:
        res["frac_of_floor"] = frac("ours")
    if a.compile:
        res["compiled_frac_of_floor"] = frac("ours_compiled")
        res["speedup_compiled_vs_eager"] = round(res["ours_s"] / res["ours_compiled_s"], 3)
        if "transformers" in times:
            res["speedup_compiled_vs_transformers"] = round(res["transformers_s"] / res["ours_compiled_s"], 3)
    if a.other_gemm:
        res["other_gemm"] = "aten" if prec.gemm == "onednn" else "onednn"
        res["other_gemm_over_ours"] = round(statistics.median(o / t for o, t in zip(times["ours_other_gemm"], times["ours"])), 3)
    if a.sdpa:
        res["speedup_kernel_vs_sdpa"] = round(res["ours_sdpa_s"] / res["ours_s"], 3)
    if "transformers" in times:
        res["transformers_frac_of_floor"] = frac("transformers")
        res["speedup_vs_transformers"] = round(res["transformers_s"] / res["ours_s"], 3)
        if a.group > 1:
            res["unshared_speedup_vs_transformers"] = round(res["transformers_s"] / res["ours_unshared_s"], 3)
    if a.beside_generator:
        res["beside_generator"] = beside(a, prec, lambda: _timed(ours_step, ours, tokens, mask, T), a.reps)
    if a.beside_gemm:
        res["beside_gemm"] = beside(a, prec, lambda: _timed(ours_step, ours, tokens, mask, T), a.reps, _gemm_forever)
    if a.gemm_check:
        res["gemms_in_place"] = gemms_in_place(lambda: ours_step(ours, tokens, mask, T))
    if a.backend_ab:
        res["backend_ab"] = backend_ab(ours.cfg, a.rows, a.tokens, scored)
    if not a.no_profile:
        res["profile_s"] = {k: round(v, 3) for k, v in profile(ours, tokens, mask, T).items() if v >= 0.005}
        if a.compile:  # by kind only: blocks are "rest", their fused kernels "other" (inductor's names)
            res["profile_compiled_s"] = {k: round(v, 3) for k, v in profile(runs["ours_compiled"][1], tokens, mask, T).items()
                                         if v >= 0.005}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
