"""Trainer step: fp32 (the previous default) vs the precision picked for this machine, and the
train/inference log-prob mismatch each precision brings.

Single process, default model, one thread. A step here is what the trainer does per micro-batch
plus the update: `token_logp` over `--rows` x `--tokens` random tokens (loss on the second
half, as completions after a prompt), backward, AdamW step on fp32 master weights. The two
precisions alternate, `--reps` times each, after one warm-up each; medians are reported.

Mismatch: the sampler (generator dtype, KV dtype) samples `--mismatch-prompts` GSM8K prompts x 4
at T = 0.7; the trainer recomputes the same tokens' log-probs with its weights; we report the
mean and max |difference| per token and the mean exp(diff) - 1 (the importance weight's bias).
For fp32 both sides are fp32 and the difference is kernel rounding only. Prints one JSON line.

    python bench/trainer_step.py              # 16 x 200 tokens, 3 reps (~4 min on 2 cores)
    python bench/trainer_step.py --quick      # 4 x 64 tokens, 1 rep
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

from common.engine.precision import Precision, PrecisionConfig, resolve  # noqa: E402
from common.engine.sampler import Sampler  # noqa: E402
from common.engine.sampling import SamplingParams  # noqa: E402
from common.ops import token_logp  # noqa: E402


def step_times(model, opt, tokens, mask) -> tuple[float, float]:
    """(forward + backward s, optimizer s) of one step."""
    t = time.perf_counter()
    token_logp(model, tokens, 0.7, mask).sum().backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t, time.perf_counter() - t1


def mismatch(prec: Precision, model_name: str, trainer, prompts) -> dict:
    gen, _ = prec.load(model_name, tokenizer=False)
    P = max(map(len, prompts))
    outs = Sampler(gen, max_batch=len(prompts) * 4, max_seq_len=P + 64, max_prompt_len=P).generate(
        prompts, SamplingParams(max_new_tokens=64, temperature=0.7, n=4, seed=0))
    d = []
    with torch.no_grad():
        for c in outs:
            lp = token_logp(trainer, torch.tensor([c.prompt_tokens + c.tokens]), 0.7)[0, len(c.prompt_tokens):]
            d.append(c.logp_tensor() - lp)
    d = torch.cat(d)
    return {"tokens": d.numel(), "mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(),
            "ratio_bias": (d.exp() - 1).mean().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mismatch-prompts", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.rows, a.tokens, a.reps, a.mismatch_prompts = 4, 64, 1, 1
    torch.set_num_threads(1)
    auto = resolve(PrecisionConfig())
    print(f"[bench] precision: {auto.summary()}", file=sys.stderr)
    precs = {"fp32": Precision("fp32", auto.gemm, "fp32"), "auto": auto}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 49152, (a.rows, a.tokens), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, a.tokens // 2:] = True
    models = {}
    for name, p in precs.items():
        p.apply()
        m, tok = p.load(a.model, role="trainer")
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-7)
        step_times(m, opt, tokens, mask)  # warm-up (oneDNN kernel creation, AdamW state)
        models[name] = (m, opt)
    times = {n: {"fwd_bwd_s": [], "opt_s": []} for n in precs}
    for _ in range(a.reps):
        for name, p in precs.items():  # alternate, so drift on a shared machine hits both alike
            p.apply()
            fb, o = step_times(*models[name], tokens, mask)
            times[name]["fwd_bwd_s"].append(fb)
            times[name]["opt_s"].append(o)
    from run_gsm8k import default_data_dir, format_prompt, load_gsm8k
    ex = load_gsm8k(default_data_dir() / "test.jsonl", limit=a.mismatch_prompts)
    prompts = [tok(format_prompt(e.question, tok), add_special_tokens=False)["input_ids"] for e in ex]
    res = {"bench": "trainer_step", "model": a.model, "cpu": auto.cpu.get("model"), "threads": 1, "rows": a.rows,
           "tokens": a.tokens, "reps": a.reps, "precision": {k: v for k, v in auto.to_dict().items() if k != "cpu"}}
    for name, p in precs.items():
        p.apply()
        fb, o = statistics.median(times[name]["fwd_bwd_s"]), statistics.median(times[name]["opt_s"])
        res[name] = {"dtype": p.dtype, "kv": p.kv, "gemm": p.gemm, "fwd_bwd_s": fb, "opt_s": o, "step_s": fb + o,
                     "tok_s": int(mask.sum()) / (fb + o), "fwd_bwd_all": times[name]["fwd_bwd_s"],
                     "mismatch": mismatch(p, a.model, models[name][0], prompts)}
    res["speedup_step"] = res["fp32"]["step_s"] / res["auto"]["step_s"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
