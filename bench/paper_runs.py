"""A task's preset end to end, as a user runs it, with random weights of its published shapes
(`--random_weights`: no hub), for a few trainer steps per mode (async, and lock-step with
`--modes async,sync`), each a fresh run of the task script in its own process group. Per mode, from
the run's metrics.jsonl, over the steps after the first (the first holds loading, compiling and the
buffer's fill):

  tok_s          completion tokens trained per second of wall (AReaL's throughput: 6.0k per GPU,
                 its appendix, 47.8k on 8 GPUs at 1.5B and 8k context; prompts are not counted)
  batch_tok_s    the trained batches' tokens (rows x width) per second of wall
  mfu            6 x parameters x the batches' own tokens (prompt + completion) / train_s / the
                 card's peak dense bf16 FLOP/s (bench/_gpu_paper.py's count and cards; AReaL's
                 recomputed proximal log-probs not counted; where the trainer computes each prompt
                 once for its group it computes fewer: `prompt_share` bounds the overstatement)
  step_s, wait_frac, trainer_tok_s, gen_tok_s, staleness, interrupts, preemptions: as logged
  memory        each process's CUDA allocator peak (`cuda_peak_gib`, `gen_cuda_peak_gib`) against
                 the memory plan's line for it (common/plan/memory_plan.py, this config, this card),
                 and each process's nvidia-smi peak, reward workers included (`smi_peak_gib`,
                 bench/_process_memory.py) against its planned total with its context, `within` 15%;
                 on a CPU not measured (bench/memory_plan.py reads the resident set)

A run is stopped (its process group killed) once it has logged the steps asked for: the figures are
in, its final checkpoint (GBs at these sizes) is not written. `LEASE` is what a short lease changes
from each preset: the evaluations off, and for AReaL's preset a smaller batch at 8k context (every
answer of a random model runs to the limit). JSON (one line) to stdout and, as each mode finishes,
to --out; the run folders under --workdir.

    python bench/paper_runs.py --task gsm8k --preset areal_long           # on a GPU: AReaL at 1.5B
    python bench/paper_runs.py --task gsm8k --preset paper --modes async,sync
    python bench/paper_runs.py --task gsm8k --preset cpu --no-random-weights --set model=tiny --steps 3
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._gpu_paper import card, mfu  # noqa: E402
from bench._process_memory import Peaks, plan_process, smi_used  # noqa: E402
from bench.leaks import group_alive, wait_until  # noqa: E402
from common.plan import preflight  # noqa: E402
from common.plan.memory_plan import TOLERANCE, GiB  # noqa: E402
from common.engine.checkpoints.shapes import param_count  # noqa: E402
from common.contracts.log import read_metrics  # noqa: E402

AREAL_TOK_S_PER_GPU = 6000.0  # AReaL's appendix: 47.8k tokens/s on 8 GPUs (R1-Distill-Qwen-1.5B, 8k context)
LEASE = {  # preset -> what a few-minute run changes (no evaluation; AReaL: 4 prompts x 16 at 8k context)
    ("gsm8k", "areal_long"): ["gen.max_new_tokens=8192", "train.prompts_per_step=4", "train.min_buffer=64",
                              "data.eval_size=0"],
    ("gsm8k", "paper"): ["data.eval_size=0"],
    ("tldr", "paper"): ["data.eval_size=0"],
    ("redteam", "paper"): ["data.eval_attacks=0"],
    ("redteam", "paper_llama"): ["data.eval_attacks=0"],
}


def argv_of(a, mode: str, run_root: Path) -> list[str]:
    """The task script's flags for one mode: the preset, the lease's changes, then --set's."""
    sets = LEASE.get((a.task, a.preset), []) if a.lease else []
    return ([f"--preset={a.preset}"] + (["--random_weights"] if a.random_weights else [])
            + [f"--{kv}" for kv in sets + a.set]
            + [f"--train.mode={mode}", f"--train.steps={a.steps + 1}", f"--run_root={run_root}", f"--name={a.preset}_{mode}"])


def gpus() -> list[tuple[str, int]]:
    """Each GPU's name and memory (bytes) from nvidia-smi, read without a CUDA context in this
    process (its ~0.5 GB would shrink the KV pool a generator sizes from the free memory); [] where
    there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [(name.strip(), int(mib) * 2**20) for name, mib in (x.rsplit(",", 1) for x in out.splitlines() if x.strip())]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def planned(a, cfg, memories: list[int] | None) -> tuple[dict, dict, int]:
    """The memory plan of the run's config `cfg` on GPUs of these `memories` (random models built
    here first, once: the run then finds them cached): per process its allocator bytes, and its
    total with its CUDA context (one reward worker's: the reward workers' over their count); and the
    policy's parameters."""
    if a.random_weights:
        preflight.use_random_weights(cfg)
    p = preflight.plan_of(cfg, memories)
    procs = {x.process: x.device for x in p.lines if x.device.startswith("cuda")}
    each = {w: max(1, cfg.train.reward_workers) if w == "reward workers" else 1 for w in procs}
    return ({w: p.used(d, w, allocator=True) for w, d in procs.items()},
            {w: p.used(d, w) / each[w] for w, d in procs.items()}, param_count(preflight.model_config(cfg.model)))


def run(a, mode: str, work: Path, timeout: float, on_gpu: bool = False) -> tuple[list[dict], dict]:
    """One mode's run until it has logged `steps + 1` steps (or `timeout` s): its step rows, and how
    it ended (`on_gpu`: with each process's peak as nvidia-smi sees it, polled every second). The run's process group is killed on the way out, however this process leaves (a
    SIGTERM from an outer time limit included: main turns it into SystemExit): `stop`."""
    root = work / "runs"
    cmd = [sys.executable, str(ROOT / f"run_{a.task}.py")] + argv_of(a, mode, root)
    metrics, log = root / f"{a.preset}_{mode}" / "metrics.jsonl", work / f"{a.preset}_{mode}.log"
    peaks = Peaks(root / f"{a.preset}_{mode}" / "workers.json", query=smi_used if on_gpu else dict)  # dict: nothing polled
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rows, end = [], None
        try:
            while end is None:
                time.sleep(1.0)
                peaks.poll()
                rows = [r for r in read_metrics(metrics) if "step_s" in r] if metrics.exists() else []
                if len(rows) > a.steps:
                    end = "stopped after the steps measured (no final checkpoint)"
                elif p.poll() is not None:
                    end = f"exited {p.returncode} after {len(rows)} steps"
                elif time.perf_counter() - t0 > timeout:
                    end = f"timed out at {timeout:.0f} s after {len(rows)} steps"
        finally:
            if p.poll() is None:
                stop(p)
    tail = log.read_text(errors="replace")[-1500:] if p.returncode not in (0, -signal.SIGKILL) else None
    return rows, {"cmd": " ".join(cmd[1:]), "end": end, "wall_s": time.perf_counter() - t0, "log": str(log),
                  "smi_peak_gib": {k: v / GiB for k, v in peaks.peak.items()}, **({"log_tail": tail} if tail else {})}


def stop(p: subprocess.Popen) -> None:
    """SIGKILL the run's main process: its workers follow by PDEATHSIG and multiprocessing's resource
    tracker unlinks their semaphores (a SIGKILL to the whole group would leave them in /dev/shm for
    good); whatever of its group is alive 15 s later is killed with the group."""
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if not wait_until(lambda: not group_alive(p.pid), 15.0, 0.1):
        os.killpg(p.pid, signal.SIGKILL)


def summarise(rows: list[dict], params: int | None = None, peak: float | None = None) -> dict:
    """The figures of a run's step rows, over the steps after the first (module docstring); MFU
    with the policy's `params` and the card's `peak` FLOP/s."""
    if len(rows) < 2:
        return {"steps": len(rows), "error": "fewer than 2 steps logged: no rate"}
    after, span = rows[1:], rows[-1]["time"] - rows[0]["time"]
    trained = sum(r["trainer_tok_s"] * r["train_s"] for r in after)  # completion tokens of each batch
    out = {"steps": len(rows), "first_step_at_s": rows[0]["time"], "span_s": span,
           "tok_s": trained / span, "batch_tok_s": sum(r["batch_tokens"] for r in after) / span,
           "step_s": span / len(after), "wait_frac": sum(r["wait_s"] for r in after) / span,
           **{k: statistics.mean(r[k] for r in after) for k in ("trainer_tok_s", "gen_tok_s", "train_s",
                                                                "staleness_mean", "comp_len_mean")},
           **{k: rows[-1][k] for k in ("gen_interrupts", "gen_preemptions", "dropped_stale", "version")}}
    if "batch_seq_tokens" in rows[-1]:
        seq = sum(r["batch_seq_tokens"] for r in after)
        out["seq_tok_s_training"] = seq / sum(r["train_s"] for r in after)  # the trainer's rate while it trains
        out["prompt_share"] = 1 - trained / seq
        out["mfu"] = mfu(params, out["seq_tok_s_training"], peak) if params else None
    for k in ("cuda_peak_gib", "gen_cuda_peak_gib"):
        if k in rows[-1]:
            out[k] = max(r[k] for r in rows)
    return out


def memory(s: dict, plan: dict, totals: dict | None = None, smi: dict | None = None) -> dict:
    """Measured peaks against the plan: each allocator peak the run logs against its process's
    allocator bytes, and each process's nvidia-smi peak (`smi`, by workers.json name; a reward
    worker's included) against its total with its context (`totals`). Ratio measured / planned,
    within 15%."""
    if "cuda_peak_gib" not in s:
        return {"measured": None, "why": "not on CUDA: no allocator peaks (bench/memory_plan.py reads a CPU's resident set)"}
    out = {}
    for who, key in (("trainer", "cuda_peak_gib"), ("generator 0", "gen_cuda_peak_gib")):
        if who in plan and s.get(key):
            out[who] = _ratio(s[key], plan[who])
    for name, gib in (smi or {}).items():
        who = plan_process(name)
        if who in (totals or {}):
            out[f"{name}_smi"] = _ratio(gib, totals[who])
    return out


def _ratio(measured_gib: float, planned_bytes: float) -> dict:
    r = measured_gib * GiB / planned_bytes
    return {"measured_gib": measured_gib, "planned_gib": planned_bytes / GiB, "measured_over_planned": r,
            "within": abs(r - 1) <= TOLERANCE}


def targets(a, res: dict) -> dict:
    t = {}
    x = res.get("async", {})
    if (a.task, a.preset) == ("gsm8k", "areal_long") and "tok_s" in x:
        c = res["config"]  # AReaL's figure is one GPU's share at 8k context: on a CPU or shorter, not comparable
        ok = str(c.get("device")).startswith("cuda") and c.get("max_new_tokens", 0) >= 8192
        t["areal_tok_s_one_gpu"] = {"value": x["tok_s"], "need": f">= {AREAL_TOK_S_PER_GPU:.0f}", "comparable": ok,
                                    "met": x["tok_s"] >= AREAL_TOK_S_PER_GPU if ok else None,
                                    "context": c.get("max_new_tokens")}
    for mode in a.modes:
        for who, m in res.get(mode, {}).get("memory", {}).items():
            if isinstance(m, dict):
                t[f"plan_{mode}_{who.replace(' ', '_')}"] = {"value": m["measured_over_planned"], "need": "within 15%",
                                                            "met": m["within"]}
    return t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("gsm8k", "tldr", "redteam"), default="gsm8k")
    ap.add_argument("--preset", default="areal_long", help="the task's preset (its --preset)")
    ap.add_argument("--steps", type=int, default=3, help="steps measured, after a first one (>= 1)")
    ap.add_argument("--modes", default="async", help="train.mode runs: async, sync or async,sync")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run flag, e.g. gen.n=8 (repeatable)")
    ap.add_argument("--no-lease", dest="lease", action="store_false", help="not LEASE's changes: the preset as it is")
    ap.add_argument("--no-random-weights", dest="random_weights", action="store_false", help="the config's models as named")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mode before its run is stopped")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole bench: each mode gets at most an equal share of what is left")
    ap.add_argument("--workdir", default=None, help="run folders and logs (default: a new temporary folder)")
    ap.add_argument("--out", default=None, help="also write the JSON here, after each mode")
    a = ap.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.steps < 1 or not a.modes or any(m not in ("async", "sync") for m in a.modes):
        ap.error("--steps >= 1; --modes: async, sync or async,sync")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="asyncrl_paper_runs_"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = importlib.import_module(f"run_{a.task}").make_config(argv_of(a, a.modes[0], work / "runs"))
    res = {"bench": "paper_runs", "task": a.task, "preset": a.preset, "steps": a.steps, "modes": a.modes,
           "lease": LEASE.get((a.task, a.preset), []) if a.lease else [], "set": a.set, "random_weights": a.random_weights,
           "config": {"model": cfg.model, "algo": cfg.algo, "prompts_per_step": cfg.train.prompts_per_step, "n": cfg.gen.n,
                      "max_new_tokens": cfg.gen.max_new_tokens, "device": cfg.train.device, "max_batch": cfg.gen.max_batch},
           "date": time.strftime("%Y-%m-%d"), "complete": False}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # an outer limit's SIGTERM: run()'s cleanup runs
    t = start = time.perf_counter()
    smi = gpus()
    try:
        plan, totals, params = planned(a, cfg, [m for _, m in smi] or None)
    except Exception as e:  # noqa: BLE001 - the runs still measure; the plan's failure is reported
        plan, totals, params, res["plan_error"] = {}, {}, None, f"{type(e).__name__}: {e}"
    res["plan_gib"], res["plan_s"], res["params"] = {k: v / GiB for k, v in plan.items()}, time.perf_counter() - t, params
    res["card"] = c = card(smi[0][0] if smi else None)
    for i, mode in enumerate(a.modes):
        left = a.budget - (time.perf_counter() - start) if a.budget else math.inf
        rows, how = run(a, mode, work, min(a.timeout, left / (len(a.modes) - i)), on_gpu=bool(smi))
        s = summarise(rows, params, c["peak_flops"])
        res[mode] = {**s, **how, "memory": memory(s, plan, totals, how["smi_peak_gib"])}
        if "async" in res and "sync" in res and "tok_s" in res["async"] and "tok_s" in res["sync"]:
            res["async_over_sync_tok_s"] = res["async"]["tok_s"] / res["sync"]["tok_s"]
        res["targets"] = targets(a, res)
        res["complete"] = mode == a.modes[-1]
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(json.dumps(res, default=str))
    return res


if __name__ == "__main__":
    main()
