"""The trainer's AdamW step on CPU: torch's fused kernel vs its default CPU path (a loop over the
parameters, `single`) and its multi-tensor path (`foreach`).

Single process, one thread (as the trainer runs), fp32 parameters of the default model with
random gradients, the trainer's optimizer settings (`common.runtime.step.make_optimizer`: betas
0.9 / 0.95, weight decay). Both optimizers start from the same weights and state and take the
same steps on the same gradients, alternating `--reps` times after one warm-up each (drift on a
shared machine hits all alike); medians. `max_abs_diff`: how far the fused path's weights are
from the single path's after the last step (different rounding of the same update).

    python bench/adamw.py              # SmolLM2-135M, 5 reps
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

from common.engine.checkpoints.hf_io import load_model  # noqa: E402
from common.engine.machine.precision import cpu_info  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    set_process_defaults("cpu")  # one thread, freed memory kept: as the trainer runs
    model = load_model(a.model, tokenizer=False)[0]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in model.parameters()]
    params = {}
    for name, kw in (("single", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        params[name] = (ps, torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), **kw))
    del model
    times = {n: [] for n in params}
    for rep in range(a.reps + 1):
        for name, (ps, opt) in params.items():
            for p, gr in zip(ps, grads):
                p.grad = gr
            t = time.perf_counter()
            opt.step()
            if rep:  # the first is the warm-up (state allocation)
                times[name].append(time.perf_counter() - t)
    a_ps, b_ps = params["single"][0], params["fused"][0]
    diff = max((x - y).abs().max().item() for x, y in zip(a_ps, b_ps))
    med = {n: statistics.median(t) for n, t in times.items()}
    n_params = sum(p.numel() for p in a_ps)
    print(json.dumps({"bench": "adamw", "model": a.model, "cpu": cpu_info().get("model"), "threads": 1,
                      "params": n_params, "reps": a.reps, **{f"{n}_s": t for n, t in med.items()},
                      **{f"{n}_all": t for n, t in times.items()}, "speedup_fused_vs_single": med["single"] / med["fused"],
                      "speedup_fused_vs_foreach": med["foreach"] / med["fused"], "max_abs_diff": diff}))


if __name__ == "__main__":
    main()
