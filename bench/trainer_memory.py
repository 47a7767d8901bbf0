"""Trainer memory: peak memory of one training micro-batch with the head unchunked (the full
(tokens x vocab) logits, as before `common/engine/model/head.py`), chunked, and chunked with per-block
activation checkpointing, on the same work in one run; and `chunked_plain`, chunked with the
model's MLP, RMSNorm and attention as plain PyTorch operations (no `common/engine/model/fused.py`,
SDPA's attention): what those two files save in fp32 on CPU (with bf16 autocast they are not used).

One micro-batch of `--rows` x `--tokens` random tokens (loss on the tokens after `--prompt`,
as completions), forward + backward + AdamW step on fp32 master weights, at the precision the
runtime picks for this machine (`--dtype`). Each variant runs in a fresh process (on CPU the
peak resident set is per process; on CUDA `max_memory_allocated`), reporting its peak and the
step time. The GPU figure at the GPU preset's shape (40 x 760) is `bench/gpu.py`'s. Prints one
JSON line.

    python bench/trainer_memory.py                      # 8 x 760 tokens on the default model
    python bench/trainer_memory.py --rows 2 --tokens 128 --model <dir>   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.engine.model.causal_attention import set_kernel  # noqa: E402
from common.engine.model.fused import set_fused  # noqa: E402
from common.engine.machine.precision import PrecisionConfig, cpu_info, resolve  # noqa: E402
from common.contracts.ops import logp_from_logits, token_logp  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402

VARIANTS = ("full_logits", "chunked", "chunked_checkpointed", "chunked_plain")


def full_logits_token_logp(model, tokens, temperature, mask):
    """token_logp as it was before the chunked head: the loss positions' (n, V) logits at once."""
    sel = mask[:, 1:]
    with model.autocast():
        logits = model.lm_head(model.hidden(tokens)[:, :-1][sel])  # (n, V)
    lp = torch.zeros(sel.shape).masked_scatter(sel, logp_from_logits(logits, tokens[:, 1:][sel], temperature))
    return F.pad(lp, (1, 0))


def one(args) -> dict:
    """Run one variant in this process; returns its peak memory and step time."""
    set_process_defaults(args.device)  # as the trainer: one CPU thread, freed memory kept
    dev = torch.device(args.device)
    prec = resolve(PrecisionConfig(dtype=args.dtype), args.device).apply()
    if args.variant == "chunked_plain":
        set_fused(False)
        set_kernel(False)
    model, _ = prec.load(args.model, device=dev, role="trainer", tokenizer=False)
    model.train()
    model.checkpoint_layers = args.variant == "chunked_checkpointed"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.type == "cuda")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.cfg.vocab_size, (args.rows, args.tokens), generator=g).to(dev)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, args.prompt:] = True
    fn = full_logits_token_logp if args.variant == "full_logits" else token_logp
    times = []
    for _ in range(args.reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lp = fn(model, tokens, 0.7, mask)
        (-(lp * mask).sum() / mask.sum()).backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    return {"variant": args.variant, "peak_gib": peak / 2**30, "step_s": min(times),
            "dtype": prec.dtype, "what": "max_memory_allocated" if dev.type == "cuda" else "peak RSS of the process"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=760)
    ap.add_argument("--prompt", type=int, default=250, help="tokens before the loss positions")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's job
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    out = {"bench": "trainer_memory", "model": args.model, "rows": args.rows, "tokens": args.tokens,
           "loss_tokens": args.rows * (args.tokens - args.prompt), "device": args.device,
           "cpu": cpu_info()["model"], "date": time.strftime("%Y-%m-%d")}
    for v in VARIANTS:  # a fresh process each: peaks do not mix
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--model", args.model, "--rows", str(args.rows),
               "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--reps", str(args.reps),
               "--dtype", args.dtype, "--device", args.device]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"variant {v} failed:\n{r.stderr[-3000:]}")
        out[v] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"[trainer_memory] {v}: {out[v]['peak_gib']:.2f} GiB, {out[v]['step_s']:.1f} s", file=sys.stderr)
    base = out["full_logits"]
    for v in VARIANTS[1:]:
        out[v]["peak_vs_full"] = out[v]["peak_gib"] / base["peak_gib"]
        out[v]["time_vs_full"] = out[v]["step_s"] / base["step_s"]
    out["chunked"]["peak_vs_plain"] = out["chunked"]["peak_gib"] / out["chunked_plain"]["peak_gib"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
