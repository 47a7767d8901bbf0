"""Host memory policy: a trainer's micro-batches with freed memory kept in the process
(`common/runtime/process.py: keep_freed_memory`, the default) against glibc's malloc defaults
(`ASYNCRL_MALLOC=system`), on the same work in one run.

Each policy runs in a fresh process (malloc settings and peaks are per process), one thread:
`--steps` micro-batches of varying shape (rows of `--min-len`..`--max-len` tokens drawn from a
fixed seed, ~`--tokens-per-step` tokens each, loss on the last two thirds), forward + backward
+ AdamW on fp32 master weights at the precision `auto` picks. Reported per policy: wall and system seconds of the steps, minor page
faults, the peak RSS, and the RSS after every step (does the kept heap keep growing?). Prints one
JSON line.

    python bench/host_memory.py               # 12 steps of ~2,400 tokens (~13 min on 2 cores)
    python bench/host_memory.py --steps 3 --tokens-per-step 400 --max-len 200 --model <dir>   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.engine.machine.precision import PrecisionConfig, cpu_info, resolve  # noqa: E402
from common.contracts.ops import token_logp  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402

POLICIES = ("keep", "system")


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_gib() -> float:
    return rss_bytes() / 2**30


def one(args) -> dict:
    """The steps in this process, under the policy ASYNCRL_MALLOC names (set by the parent)."""
    set_process_defaults("cpu")
    prec = resolve(PrecisionConfig()).apply()
    model, _ = prec.load(args.model, role="trainer", tokenizer=False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    rnd, g = random.Random(0), torch.Generator().manual_seed(0)
    shapes, rss = [], []
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.steps):
        T = rnd.randint(args.min_len, args.max_len)
        rows = max(1, args.tokens_per_step // T)
        tokens = torch.randint(3, model.cfg.vocab_size, (rows, T), generator=g)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        mask[:, :T // 3] = False
        opt.zero_grad(set_to_none=True)
        (-(token_logp(model, tokens, 0.7, mask) * mask).sum() / mask.sum()).backward()
        opt.step()
        shapes.append(f"{rows}x{T}")
        rss.append(round(_rss_gib(), 3))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"policy": os.environ["ASYNCRL_MALLOC"], "dtype": prec.dtype, "wall_s": time.perf_counter() - t0,
            "sys_s": r1.ru_stime - r0.ru_stime, "user_s": r1.ru_utime - r0.ru_utime,
            "minor_faults": r1.ru_minflt - r0.ru_minflt, "peak_rss_gib": r1.ru_maxrss / 2**20,  # Linux: KiB
            "rss_after_step_gib": rss, "shapes": shapes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tokens-per-step", type=int, default=2400)
    ap.add_argument("--min-len", type=int, default=100, help="shortest row, tokens")
    ap.add_argument("--max-len", type=int, default=700, help="longest row, tokens")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run one policy here
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args)))
        return
    out = {"bench": "host_memory", "model": args.model, "steps": args.steps, "tokens_per_step": args.tokens_per_step,
           "cpu": cpu_info()["model"], "date": time.strftime("%Y-%m-%d")}
    for policy in POLICIES:  # a fresh process each
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--steps", str(args.steps),
               "--tokens-per-step", str(args.tokens_per_step), "--min-len", str(args.min_len), "--max-len", str(args.max_len)]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ASYNCRL_MALLOC": policy})
        if r.returncode != 0:
            raise SystemExit(f"policy {policy} failed:\n{r.stderr[-3000:]}")
        out[policy] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"[host_memory] {policy}: {out[policy]['wall_s']:.1f} s, sys {out[policy]['sys_s']:.1f} s, "
              f"peak {out[policy]['peak_rss_gib']:.2f} GiB", file=sys.stderr)
    out["keep_vs_system_wall"] = out["keep"]["wall_s"] / out["system"]["wall_s"]
    out["keep_vs_system_peak"] = out["keep"]["peak_rss_gib"] / out["system"]["peak_rss_gib"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
