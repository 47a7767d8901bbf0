"""The sampler-trainer mismatch per precision path, on the default model: one JSON line.

For each path, one process loads the default model twice as a run does, the sampler's copy (a
generator's: weights in the path's dtype, its KV cache, the decode step the machine's `auto` picks)
and the trainer's (fp32 master weights, autocast to the path's dtype), samples `--prompts` GSM8K
questions x `--n` at temperature 1 (up to `--max-new` tokens) and scores the same tokens with the
trainer's full pass (`token_logp`, the loss's function). Reported per path: the stats of
common/contracts/mismatch.py over every sampled token (mean and max |d|, the k3 KL, the fraction
past 1e-3) and the fraction of tokens IcePop's band [1/2, 2] would mask. Paths: CPU fp32, CPU bf16
(the `auto` path where the CPU has bf16 units); a CUDA bf16 row with `--device cuda`.

    python bench/mismatch.py                   # both CPU paths, 16 x 4 samples, <= 128 tokens (~3 min)
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.contracts.mismatch import mismatch_stats  # noqa: E402
from common.contracts.ops import token_logp  # noqa: E402
from common.engine.checkpoints.hf_io import DEFAULT_MODEL  # noqa: E402
from common.engine.machine.precision import PrecisionConfig, cpu_info, resolve  # noqa: E402
from common.engine.sampler.sampler import Sampler  # noqa: E402
from common.engine.sampler.sampling import SamplingParams  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def questions(k: int) -> list[str]:
    with gzip.open(os.path.join(ROOT, "data", "gsm8k", "train.jsonl.gz"), "rt") as f:
        return [json.loads(line)["question"] for _, line in zip(range(k), f)]


def one_path(a, dtype: str) -> dict:
    prec = resolve(PrecisionConfig(dtype=dtype), a.device).apply()
    gen, tok = prec.load(a.model, device=a.device, role="generator")
    trainer = prec.load(a.model, device=a.device, role="trainer", tokenizer=False)[0]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions(a.prompts)]
    prompts = [list(p["input_ids"]) if not isinstance(p, list) else p for p in prompts]  # a BatchEncoding or ids
    t = time.perf_counter()
    outs = Sampler(gen, max_batch=a.prompts * a.n, max_seq_len=max(map(len, prompts)) + a.max_new).generate(
        prompts, SamplingParams(max_new_tokens=a.max_new, temperature=1.0, n=a.n, seed=0))
    sample_s = time.perf_counter() - t
    B, T = len(outs), max(len(o.prompt_tokens) + len(o.tokens) for o in outs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    behav = torch.zeros(B, T)
    for b, o in enumerate(outs):
        p, c = len(o.prompt_tokens), len(o.tokens)
        tokens[b, :p + c] = torch.tensor(o.prompt_tokens + o.tokens)
        mask[b, p:p + c] = True  # target-aligned: position t holds the log-prob of tokens[t]
        behav[b, p:p + c] = o.logp_tensor()
    with torch.no_grad():
        lp = torch.cat([token_logp(trainer, tokens[i:i + 8].to(a.device), 1.0, mask[i:i + 8].to(a.device)).cpu()
                        for i in range(0, B, 8)])
    st = mismatch_stats(lp, behav, mask)
    d = (lp - behav)[mask]
    st["icepop_masked_frac"] = (d.abs() > math.log(2.0)).float().mean().item()
    return {"dtype": prec.dtype, "kv": prec.kv, "decode": prec.decode, "gemm": prec.gemm, "rows": B,
            "sample_s": round(sample_s, 1), **st}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--paths", nargs="+", default=None, help="dtypes (default: fp32 bf16 on CPU, bf16 on CUDA)")
    a = ap.parse_args()
    set_process_defaults(a.device)
    paths = a.paths or (["bf16"] if a.device.startswith("cuda") else ["fp32", "bf16"])
    out = {"bench": "mismatch", "model": a.model, "device": a.device, "cpu": cpu_info()["model"],
           "date": time.strftime("%Y-%m-%d"), "prompts": a.prompts, "n": a.n, "max_new": a.max_new, "paths": {}}
    for dt in paths:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
            out["paths"][f"{a.device.split(':')[0]}_{dt}"] = r = one_path(a, dt)
        print(f"[mismatch] {dt}: {json.dumps(r)}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
