"""Synchronous vs asynchronous TBA or AReaL on a task: seconds per trainer step on equal work.

Runs the task script's `main` (`--task=gsm8k|tldr|redteam`) twice with the same config,
`--train.mode=sync` then async (one generator process + the trainer, plus the task's reward
workers), default model, one thread per process, evaluation off, at `--dtype` (default auto: the
precision picked for this machine; the runs' precision.json says which). TBA async publishes every
`--sync-every` steps with unbounded staleness; AReaL (`--algo=areal`) is run_gsm8k's AReaL
setting: async eta = 4, k = 1, interruptible generation, 4 minibatch updates per step, against
sync eta = 0 on the same batches. Reads each run's
metrics.jsonl and reports the mean wall seconds per trainer step after `--warmup` steps, the
ratio sync/async, and the ideal ratio (G + T) / max(G, T) from the sync run's measured
generation time G (the trainer's wait for its batch) and training time T per step.
Prints one JSON line.

    python bench/async_speedup.py                 # 4 prompts x 4 samples, <= 96 new tokens
    python bench/async_speedup.py --algo=areal    # AReaL: async eta = 4 vs sync eta = 0
    python bench/async_speedup.py --quick         # tiny smoke check
    python bench/async_speedup.py --task=tldr --steps=12   # TL;DR at its CPU preset (RM in a reward worker)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.contracts.log import read_metrics  # noqa: E402
from common.contracts.plots import plot_runs  # noqa: E402


# per task: the flag that turns evaluation off, and the batch this bench uses unless told (None = the task's preset)
TASKS = {"gsm8k": ("--data.eval_size=0", dict(prompts=4, n=4, max_new=96)),
         "tldr": ("--data.eval_size=0", dict(prompts=None, n=None, max_new=None)),
         "redteam": ("--data.eval_attacks=0", dict(prompts=None, n=None, max_new=None))}


def run(mode: str, a, root: str) -> list[dict]:
    import importlib
    name = f"bench_{a.task}_{a.algo}_{mode}"
    argv = [f"--algo={a.algo}", f"--name={name}", f"--run_root={root}", f"--train.mode={mode}", f"--train.steps={a.steps}",
            "--train.checkpoint_every=0", "--train.keep_checkpoints=1", TASKS[a.task][0], f"--model={a.model}",
            f"--precision.dtype={a.dtype}"]
    if a.prompts is not None:
        argv += [f"--train.prompts_per_step={a.prompts}", f"--train.min_buffer={a.prompts * (a.n or 4)}"]
    if a.n is not None:
        argv += [f"--gen.n={a.n}"] + ([f"--gen.max_batch={a.prompts * a.n}"] if a.prompts else [])
    if a.max_new is not None:
        argv += [f"--gen.max_new_tokens={a.max_new}"]
    if a.sync_every is not None:
        argv += [f"--train.sync_every={a.sync_every}"]
    importlib.import_module(f"run_{a.task}").main(argv)
    return [r for r in read_metrics(os.path.join(root, name, "metrics.jsonl")) if "step_s" in r]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=list(TASKS), default="gsm8k")
    ap.add_argument("--algo", choices=["tba", "areal"], default="tba")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (gsm8k: 4; others: the preset's)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (gsm8k: 4; others: the preset's)")
    ap.add_argument("--max-new", type=int, default=None, help="new tokens (gsm8k: 96; others: the preset's)")
    ap.add_argument("--sync-every", type=int, default=None, help="async: publish weights every k steps (gsm8k: 1; others: the preset's)")
    ap.add_argument("--root", default=None, help="run directory root (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 2 samples, 16 tokens, 3 steps")
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                    help="run_gsm8k's --precision.dtype (auto: picked per machine, common/engine/machine/precision.py)")
    a = ap.parse_args()
    for k, v in TASKS[a.task][1].items():
        if getattr(a, k) is None and v is not None:
            setattr(a, k, v)
    if a.task == "gsm8k" and a.sync_every is None:
        a.sync_every = 1
    if a.quick:
        a.steps, a.warmup, a.prompts, a.n, a.max_new = 3, 1, 2, 2, 16
    root = a.root or tempfile.mkdtemp(prefix="asyncrl_bench_")
    res = {"bench": "async_speedup", "task": a.task, "algo": a.algo, "model": a.model, "prompts": a.prompts, "n": a.n, "max_new_tokens": a.max_new,
           "steps": a.steps, "warmup": a.warmup, "sync_every_async": a.sync_every, "dtype_flag": a.dtype, "root": root}
    rows = {m: run(m, a, root)[a.warmup:] for m in ("sync", "async")}
    for m, rs in rows.items():
        res[m] = {"step_s": statistics.mean(r["step_s"] for r in rs),
                  "train_s": statistics.mean(r["train_s"] for r in rs),
                  "wait_s": statistics.mean(r["wait_s"] for r in rs),
                  # an update's cost follows its batch's size, which differs between the runs' batches
                  "batch_tokens": statistics.mean(r["batch_tokens"] for r in rs),
                  "train_ms_per_token": 1e3 * sum(r["train_s"] for r in rs) / sum(r["batch_tokens"] for r in rs),
                  "reward_mean": statistics.mean(r["reward_mean"] for r in rs)}
    with open(os.path.join(root, f"bench_{a.task}_{a.algo}_async", "precision.json")) as f:
        res["precision"] = {k: v for k, v in json.load(f).items() if k in ("dtype", "gemm", "kv")}
    G, T = res["sync"]["wait_s"], res["sync"]["train_s"]
    res["speedup"] = res["sync"]["step_s"] / res["async"]["step_s"]
    res["ideal_speedup"] = (G + T) / max(G, T)
    res["frac_of_ideal"] = (res["speedup"] - 1) / max(res["ideal_speedup"] - 1, 1e-9)
    res["async_update_over_sync"] = res["async"]["train_s"] / res["sync"]["train_s"]
    res["async_update_per_token_over_sync"] = res["async"]["train_ms_per_token"] / res["sync"]["train_ms_per_token"]
    png = os.path.join(root, f"sync_vs_async_{a.task}_{a.algo}.png")
    fig = plot_runs([(os.path.join(root, f"bench_{a.task}_{a.algo}_{m}", "metrics.jsonl"), m) for m in ("sync", "async")],
                    png, x="time", panels=(("version", "published versions"), ("reward_mean", "train reward")),
                    title=f"{a.algo.upper()} on {a.task}: sync vs async")
    res["plot"] = png if fig is not None else None
    print(json.dumps(res))


if __name__ == "__main__":
    main()
