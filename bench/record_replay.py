"""What recording costs an async run, and what replaying costs against the trainer's own update.

1. Record overhead: the async TBA run of `run_gsm8k.main` (default model, one generator + the
   trainer, evaluation off, `--dtype`), run `--pairs` times with `--train.record=false` and
   `=true`, alternating (A B, B A, A B, ...: the shared machine's drift hits both alike), same
   config. Per run: mean wall seconds per trainer step (`step_s`) after `--warmup` steps. Reports
   each pair's ratio recorded / not recorded, their median and spread, and the stream's bytes
   per step.
2. Replay vs update: the last recorded run's stream, replayed (`common.replay.replay_stream`,
   per step: read the step file + the update) and, in the same process, the trainer's update
   (`common.runtime.step.update`, what `OneRank.update` runs) on the same
   batches already in memory, from the same initial weights, `--reps` times alternating. Reports
   the ratio of seconds per step after `--warmup` steps, and the largest weight difference
   between the replay and the recorded run's final checkpoint.

Prints one JSON line.

    python bench/record_replay.py                 # 4 prompts x 4 samples, <= 64 new tokens, 8 steps
    python bench/record_replay.py --quick         # a smoke check (2 steps, 1 pair)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import run_gsm8k  # noqa: E402  (the task script, run as bench/async_speedup.py runs it)

from common.engine.checkpoints.hf_io import load_model  # noqa: E402
from common.engine.machine.precision import Precision  # noqa: E402
from common.contracts.log import read_metrics  # noqa: E402
from common.replay import replay_config, replay_stream  # noqa: E402
from common.runtime.files.checkpoint import latest_checkpoint  # noqa: E402
from common.runtime.step import make_optimizer, update  # noqa: E402
from common.runtime.files.stream import read_meta, read_steps  # noqa: E402
from common.task import make_algo  # noqa: E402


def record_run(record: bool, i: int, a, root: str) -> dict:
    name = f"rec{int(record)}_{i}"
    argv = [f"--name={name}", f"--run_root={root}", f"--train.steps={a.steps}", "--train.checkpoint_every=0",
            "--train.keep_checkpoints=1", "--data.eval_size=0", f"--precision.dtype={a.dtype}",
            f"--train.prompts_per_step={a.prompts}", f"--train.min_buffer={a.prompts * a.n}", f"--gen.n={a.n}",
            f"--gen.max_batch={a.prompts * a.n}", f"--gen.max_new_tokens={a.max_new}", "--train.sync_every=1",
            f"--train.record={str(record).lower()}"]
    run_gsm8k.main(argv)
    rows = [r for r in read_metrics(os.path.join(root, name, "metrics.jsonl")) if "step_s" in r][a.warmup:]
    return {"dir": os.path.join(root, name), "step_s": statistics.mean(r["step_s"] for r in rows),
            "train_s": statistics.mean(r["train_s"] for r in rows),
            "record_bytes": statistics.mean(r["record_bytes"] for r in rows) if record else None,
            "record_s": statistics.mean(r["record_s"] for r in rows) if record else None}


def direct_updates(cfg, stream: str, prec: Precision) -> list[float]:
    """Seconds of each `update` on the stream's batches (in memory), from the initial weights."""
    steps = list(read_steps(stream, cfg.train.steps))
    model, _ = prec.load(cfg.model, device="cpu", role="trainer")
    model.train()
    opt, algo, out = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay), make_algo(cfg), []
    for i, s in enumerate(steps):
        for g in opt.param_groups:
            g["lr"] = s.lr
        t = time.perf_counter()
        update(algo, model, opt, s.batch, i, cfg.train.grad_clip)
        out.append(time.perf_counter() - t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="record off/on pairs of async runs")
    ap.add_argument("--reps", type=int, default=2, help="replay / direct-update repetitions")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of each mean")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "auto", "bf16"])
    ap.add_argument("--root", default=None, help="where the runs go (default: a temporary folder, deleted)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.pairs, a.reps, a.steps, a.warmup, a.max_new = 1, 1, 3, 1, 8
    root = a.root or tempfile.mkdtemp(prefix="bench_record_replay_")
    try:
        pairs = []
        for i in range(a.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            res = {rec: record_run(rec, i, a, root) for rec in order}
            pairs.append(res)
            print(f"[bench] pair {i}: off {res[False]['step_s']:.3f} s/step, on {res[True]['step_s']:.3f}", flush=True)
        ratios = [p[True]["step_s"] / p[False]["step_s"] for p in pairs]
        stream = os.path.join(pairs[-1][True]["dir"], "stream")
        meta = read_meta(stream)
        prec = Precision.from_dict(meta["precision"]).apply()
        rep_s, upd_s = [], []
        for r in range(a.reps):
            cfg = replay_config(stream, [f"--run_root={root}", f"--name=replay{r}", "--train.checkpoint_every=0",
                                         "--train.keep_checkpoints=1"])
            replay_stream(cfg, make_algo(cfg), stream, precision=prec)
            rows = [x for x in read_metrics(os.path.join(root, f"replay{r}", "metrics.jsonl")) if "step_s" in x]
            rep_s += [x["step_s"] for x in rows[a.warmup:]]
            upd_s += direct_updates(cfg, stream, prec)[a.warmup:]
        final = load_model(str(latest_checkpoint(os.path.join(root, "replay0")) / "model"), tokenizer=False)[0]
        recorded = load_model(str(latest_checkpoint(pairs[-1][True]["dir"]) / "model"), tokenizer=False)[0]
        diff = max((x - y).abs().max().item() for x, y in zip(final.state_dict().values(),
                                                                recorded.state_dict().values()))
        out = {"bench": "record_replay", "model": meta["model"], "dtype": prec.dtype, "prompts": a.prompts, "n": a.n,
               "max_new_tokens": a.max_new, "steps": a.steps, "warmup": a.warmup, "threads": torch.get_num_threads(),
               "record_off_step_s": [round(p[False]["step_s"], 3) for p in pairs],
               "record_on_step_s": [round(p[True]["step_s"], 3) for p in pairs],
               "record_ratio_per_pair": [round(x, 4) for x in ratios],
               "record_ratio_median": round(statistics.median(ratios), 4),
               "record_ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)],
               # in-run: seconds the trainer spent capturing + writing each step, over that run's step time
               "record_s_per_step": round(statistics.mean(p[True]["record_s"] for p in pairs), 5),
               "record_s_over_step_s": round(statistics.mean(p[True]["record_s"] / p[True]["step_s"] for p in pairs), 6),
               "stream_kb_per_step": round(statistics.mean(p[True]["record_bytes"] for p in pairs) / 1e3, 1),
               "replay_step_s": round(statistics.mean(rep_s), 3), "update_s": round(statistics.mean(upd_s), 3),
               "replay_over_update": round(statistics.mean(rep_s) / statistics.mean(upd_s), 4),
               "replay_max_weight_diff": diff}
        print(json.dumps(out))
    finally:
        if a.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
