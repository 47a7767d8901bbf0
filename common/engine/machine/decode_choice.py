"""The sampler's decode step eager vs through torch.compile on this machine: the measurement behind
`precision.decode`'s `auto` on CPU. Taken on request, once per machine, never at a run's start (it
compiles the decode pieces: tens of seconds cold): `take`, in a process of its own set up as a
generator's (`python -m common.runtime.measure_decode`).

`compile_ab` (also `bench/sampler.py --compile-ab`'s): two samplers on the same weights, one eager,
one compiled (`common/engine/sampler/decode_model.py`), both warmed up (the compiled one compiles there),
then timed `Sampler.generate` rounds alternating eager, compiled, ...; the result is the median of
the per-round tok/s ratios compiled / eager (> 1: compiled faster), alternating for the reason
`common/engine/machine/cpu.py` alternates GEMM backends (a shared host's speed drifts).

`measure_decode` runs it at a fixed shape: a random model of the default model's layers
(SmolLM2-135M: hidden 576, MLP 1536, 9 query / 3 kv heads of 64, its 49,152-token vocabulary), 2
layers deep (one compiled graph serves every layer: depth lengthens the timing, not the compile),
a full generator of the default config (32 slots: 8 prompts of 64 tokens x 4 samples, 32 new
tokens, no stop token). `take` measures it in fp32, and also in the machine's `auto` dtype with its
KV dtype where `resolve` picks bf16, and merges the figures into the machine's cache file
(`machine.record_decode`), where `resolve` reads them: per dtype
`decode_<dtype>_compiled_over_eager_tok_s` (the ratio), `_eager_tok_s` / `_compiled_tok_s`
(medians over the rounds), `_ratios` (each round's), `_compile_s` (what compiling costs: the compiled
warm-up less the eager one, at least 0: with inductor's cache already holding the graphs it is ~0,
and a shared host's noise could make the bare difference negative) and `_kv`, and `decode_shape`.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

from common.engine.machine.cpu import record_decode
from common.engine.machine.precision import Precision, PrecisionConfig, resolve
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.engine.checkpoints.tiny_model import build_tiny

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 49152}  # SmolLM2-135M's layers, 2 deep
ROUNDS = 5


def compile_ab(model, prompts: list[list[int]], params: SamplingParams, max_batch: int, rounds: int) -> dict:
    """The decode step's layer body eager vs compiled on `model`, same work (module docstring):
    tok/s of each round, the median per-round ratio compiled / eager, and the warm-up seconds."""
    P = max(len(p) for p in prompts)
    samplers = {c: Sampler(model, max_batch=max_batch, max_seq_len=P + params.max_new_tokens, max_prompt_len=P,
                           compile=c) for c in (False, True)}
    warm = {}
    for c, s in samplers.items():
        t = time.perf_counter()
        for k in (1, 2):  # one row, then several: every graph a run meets
            s.generate(prompts[:k], SamplingParams(max_new_tokens=4, temperature=0.7, n=k))
        warm[c] = time.perf_counter() - t
    rates = {False: [], True: []}
    for _ in range(rounds):
        for c, s in samplers.items():
            t = time.perf_counter()
            ntok = sum(len(o.tokens) for o in s.generate(prompts, params))
            rates[c].append(ntok / (time.perf_counter() - t))
    ratios = sorted(b / a for a, b in zip(rates[False], rates[True]))
    return {"eager_tok_s": rates[False], "compiled_tok_s": rates[True], "ratios": ratios,
            "compiled_over_eager": statistics.median(ratios), "warmup_s": {"eager": warm[False], "compiled": warm[True]},
            "rounds": rounds}


def measure_decode(dtype: str = "fp32", kv: str = "fp32", prompts: int = 8, prompt_len: int = 64, n: int = 4,
                   new_tokens: int = 32, rounds: int = ROUNDS, **shape: int | float) -> dict:
    """`compile_ab` on a random model of `SHAPE` (or `shape`'s sizes) with weights in `dtype` and the
    KV cache in `kv`, `prompts` x `n` rows: the cache entries for `dtype` (module docstring)."""
    shape = {**SHAPE, **shape}
    with tempfile.TemporaryDirectory() as d:
        build_tiny(d, **shape)
        model = Precision(dtype=dtype, kv=kv).load(d, tokenizer=False)[0]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, shape["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.7, n=n, seed=0)
    ab = compile_ab(model, ids, params, prompts * n, rounds)
    out = {"compiled_over_eager_tok_s": ab["compiled_over_eager"], "eager_tok_s": statistics.median(ab["eager_tok_s"]),
           "compiled_tok_s": statistics.median(ab["compiled_tok_s"]), "ratios": ab["ratios"], "kv": kv,
           "compile_s": max(0.0, ab["warmup_s"]["compiled"] - ab["warmup_s"]["eager"])}  # a cost: never < 0
    return {**{f"decode_{dtype}_{k}": v for k, v in out.items()},
            "decode_shape": {**shape, "prompts": prompts, "prompt_len": prompt_len, "n": n, "new_tokens": new_tokens,
                             "rounds": rounds}}


def take(rounds: int = ROUNDS, **kw: int | float) -> dict:
    """Measure what a run on this machine would decode with (fp32, and its `auto` dtype where that is
    bf16), record it in the machine's cache file: the entries, the file, and `resolve`'s choice now."""
    prec = resolve(PrecisionConfig(decode="eager")).apply()  # the GEMM backend and dtype a run picks here
    entries = measure_decode("fp32", "fp32", rounds=rounds, **kw)
    if prec.dtype != "fp32":
        entries |= measure_decode(prec.dtype, prec.kv, rounds=rounds, **kw)
    path = record_decode(prec.cpu, entries)  # under the key `resolve` reads
    now = resolve(PrecisionConfig())
    return {**entries, "cache": str(path), "decode": now.decode, "why": now.why}
