"""One-command GPU benchmark: our sampler against transformers `generate` (dynamic cache, static
cache, static cache + torch.compile) in the same run, one decode step's wall time against its GPU
time, the trainer step's time / tok/s / peak memory with and without activation checkpointing,
CUDA IPC weight publish/apply with a torn-read check, and a short async TBA run at the GPU
preset's shapes. Prints ONE JSON line on stdout (progress and every library's output go to stderr).

Why: the figures in BENCHMARKS.md ("One H100, measured by hand") were taken by hand on a lent
H100; this script takes them all again in one go on any CUDA machine, with the GPU path's targets
as ratios in "targets" (`targets`: what each needs, e.g. sampler >= 2x transformers' compiled
static-cache `generate` on both workloads and >= 1.5x engine against engine, a decode step at 256
rows in <= 3.0 ms of GPU time and <= 15 kernels per layer, its wall <= 1.2x its GPU time).
`--ours` picks our sampler's settings (bench/_gpu_gen.py: VARIANTS): the default captured fused
step, eager, `ours_graphs_plain` (captured, layer body uncompiled, dense attention) and
`ours_overlap` (captured, each step launched before the previous one is recorded) for A/Bs in
the same run; `--async-modes async,sync` adds lock-step to the async section.
It needs only torch, transformers, numpy, safetensors and tqdm: it builds its own random
checkpoint with SmolLM2-135M-Instruct's exact shapes (LlamaConfig -> from_config, seeded,
bf16, save_pretrained into a temp dir; no tokenizer, prompts are token ids), never downloads.

Workload (as measured before, for comparability): 64 prompts x 4 samples, prompt lengths
100-250 (random ids, seeded), 256 new tokens, no stop tokens (every sample runs 256),
max_batch 256, temperature 0.7 (transformers: top_k=0, top_p=1, same distribution). How each
figure is measured: the docstrings of bench/_gpu_gen.py (sampler), bench/_gpu_decode.py (decode) and
bench/_gpu_train.py (trainer, ipc, async).

    python bench/gpu.py --out gpu.json                    # everything (CUDA), ~5-8 min on one H100
    python bench/gpu.py --only sampler,decode             # some sections: sampler,decode,trainer,ipc,async,long
    python bench/gpu.py --smoke --device cpu              # tiny shapes, no torch.compile: tests the code path
    python bench/gpu.py --smoke --device cuda --hf-compile --strict   # every CUDA call, tiny, ~1 min

`--out` is rewritten after every finished part of a section (a sampler setting, a decode variant),
so a run cut short keeps what it measured (marked `partial`). A section
that raises is recorded as {"error", "traceback"} beside the parts it finished, and the others
still run (`--strict`: stop).
Only a CUDA machine exercises: torch.cuda synchronize / peak-memory counters, the profiler's CUDA
kernel events, transformers' static cache under torch.compile (reduce-overhead: CUDA graphs),
`Sampler(cuda_graphs=True)`, the weight store's CUDA IPC, and the async run on the device; the CPU
smoke test (tests/test_bench_gpu.py) runs everything else.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported (below): never the network

import torch  # noqa: E402

from bench._gpu_decode import decode_section  # noqa: E402
from bench._gpu_gen import HF_SETTINGS, VARIANTS, sampler_section  # noqa: E402
from bench._gpu_train import async_section, ipc_section, trainer_section  # noqa: E402
from bench.long_outputs import measure as long_measure, parse_args as long_args  # noqa: E402
from bench._gpu_util import (SMOLLM2_135M, TINY, Ctx, build_checkpoint, free_memory, machine,  # noqa: E402
                             random_prompts, write_json)
from common.engine.precision import PrecisionConfig, resolve  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402



def long_section(ctx) -> dict:
    """bench/long_outputs.py on this device (paged vs static KV at equal memory, packed vs padded
    rows: its docstring), bf16 on CUDA; smoke: its --quick without the trainer part."""
    cuda = ctx.device.type == "cuda"
    argv = ["--device", str(ctx.device), "--dtype", "bfloat16" if cuda else "float32"]
    return long_measure(long_args(argv + (["--quick", "--skip-trainer"] if ctx.args.smoke else [])))


SECTIONS = {"sampler": sampler_section, "decode": decode_section, "trainer": trainer_section,
            "ipc": ipc_section, "async": async_section, "long": long_section}
# BENCHMARKS.md, "One H100, measured by hand": one H100 80 GB, torch 2.11 + CUDA 13, transformers 5.17, 2026-11-23, code of 2026-11-22
WAS = {"ours_tok_s": 3573, "hf_dynamic_tok_s": 2153, "hf_static_tok_s": 7361, "hf_static_compiled_tok_s": 21322,
       "decode_wall_ms": 84.0, "decode_gpu_ms": 16.5, "trainer_step_s": 0.22, "trainer_tok_s": 138000,
       "trainer_peak_gib": 47.5, "ipc_publish_ms": 5.5, "ipc_apply_ms": 5.4}
SMOKE = dict(prompts=4, n=2, prompt_min=5, prompt_max=12, max_new=16, max_batch=8, hf_batch=8, hf_compile=False,
             gsm8k_prompts=3, gsm8k_n=3, gsm8k_prompt_min=4, gsm8k_prompt_max=12, gsm8k_stops=20,
             decode_warmup=1, decode_steps=3, decode_profile=2, train_rows=4, train_tokens=48, train_prompt=16, train_group=2,
             train_warmup=1, train_reps=2, ipc_reps=2, ipc_publishes=5, async_steps=3, async_prompts=8,
             async_buffer=256)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    arg("--smoke", action="store_true", help="tiny shapes and counts, no torch.compile (checks the code path)")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg("--out", default=None, help="also write the JSON here (indented), rewritten after every section")
    arg("--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="run precision (auto: bf16 on CUDA)")
    arg("--seed", type=int, default=0, help="checkpoint weights and prompts")
    arg("--workdir", default=None, help="checkpoint and run directory (default: a temp dir, removed at the end)")
    arg("--strict", action="store_true", help="stop at the first section that raises")
    g = ap.add_argument_group("sampler workload")
    g.add_argument("--prompts", type=int, default=64)
    g.add_argument("--n", type=int, default=4, help="samples per prompt")
    g.add_argument("--prompt-min", type=int, default=100)
    g.add_argument("--prompt-max", type=int, default=250)
    g.add_argument("--max-new", type=int, default=256)
    g.add_argument("--max-batch", type=int, default=256, help="our sampler's slots")
    g.add_argument("--ours", default=",".join(VARIANTS), help=f"our sampler's settings to run, of {list(VARIANTS)}")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--hf-batch", type=int, default=256, help="sequences per transformers generate call")
    g.add_argument("--skip-hf", action="store_true", help="no transformers runs")
    g.add_argument("--hf-settings", default="hf_dynamic,hf_static,hf_static_compiled",
                   help="the transformers settings the default workload runs (the gsm8k one: the static ones)")
    g.add_argument("--gsm8k-prompts", type=int, default=13, help="the GSM8K-shaped workload: prompts (x --gsm8k-n)")
    g.add_argument("--gsm8k-n", type=int, default=20)
    g.add_argument("--gsm8k-prompt-min", type=int, default=80)
    g.add_argument("--gsm8k-prompt-max", type=int, default=250)
    g.add_argument("--gsm8k-stops", type=int, default=200, help="stop ids (random weights: ~this / vocab per token)")
    g.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="run the static cache + torch.compile setting (off in --smoke unless given)")
    g = ap.add_argument_group("decode step")
    g.add_argument("--decode-warmup", type=int, default=10)
    g.add_argument("--decode-steps", type=int, default=20, help="steps timed on the host")
    g.add_argument("--decode-profile", type=int, default=10, help="steps run under the profiler")
    g.add_argument("--decode-schedule", action=argparse.BooleanOptionalAction, default=True,
                   help="also profile the GSM8K-shaped schedule, captured vs live shapes")
    g = ap.add_argument_group("trainer step")
    g.add_argument("--train-rows", type=int, default=40)
    g.add_argument("--train-tokens", type=int, default=760)
    g.add_argument("--train-prompt", type=int, default=250, help="tokens before the loss mask starts")
    g.add_argument("--train-group", type=int, default=1,
                   help="rows per shared prompt (> 1: also the shared-prompt settings; the GSM8K preset: 20)")
    g.add_argument("--train-warmup", type=int, default=2)
    g.add_argument("--train-reps", type=int, default=5)
    g = ap.add_argument_group("ipc / async")
    g.add_argument("--ipc-reps", type=int, default=10)
    g.add_argument("--ipc-publishes", type=int, default=50, help="publishes during the torn-read race (<= 127)")
    g.add_argument("--async-steps", type=int, default=12)
    g.add_argument("--async-prompts", type=int, default=256, help="random prompts in the async run's set")
    g.add_argument("--async-buffer", type=int, default=4096, help="replay buffer rows (the preset: 65536)")
    g.add_argument("--async-modes", default="async", help="train.mode runs of the async section: async, sync or both")
    if ap.parse_args(argv).smoke:  # smoke sizes are defaults: flags given still win
        ap.set_defaults(**SMOKE)
    a = ap.parse_args(argv)
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in a.only if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown sections {bad}; choose from {list(SECTIONS)}")
    a.ours = [v.strip() for v in a.ours.split(",") if v.strip()]
    if not a.ours or any(v not in VARIANTS for v in a.ours):
        ap.error(f"--ours: choose from {list(VARIANTS)}")
    a.hf_settings = [h.strip() for h in a.hf_settings.split(",") if h.strip()]
    bad = [h for h in a.hf_settings if h not in HF_SETTINGS]
    if bad:
        ap.error(f"--hf-settings: unknown {bad}; choose from {list(HF_SETTINGS)}")
    if a.train_group < 1 or a.train_rows % a.train_group:
        ap.error(f"--train-group {a.train_group} must divide --train-rows {a.train_rows}")
    a.async_modes = [m.strip() for m in a.async_modes.split(",") if m.strip()]
    if not a.async_modes or any(m not in ("async", "sync") for m in a.async_modes):
        ap.error("--async-modes: async, sync or async,sync")
    if not 0 < a.ipc_publishes <= 127:
        ap.error("--ipc-publishes must be in 1..127 (fill values are versions mod 128)")
    return a


def targets(res: dict) -> dict:
    """The GPU path's targets as ratios, from whatever sections ran."""
    t = {"comparable": not res["smoke"] and res["machine"]["device"].startswith("cuda")}
    s = res.get("sampler", {})
    for wl, d in (("default", s), ("gsm8k", s.get("gsm8k", {}))):
        if "ours_over_hf_static_compiled" in d:
            v = d["ours_over_hf_static_compiled"]
            t[f"sampler_over_hf_static_compiled_{wl}"] = {"value": v, "need": ">= 2", "met": v >= 2,
                                                          "ours": d.get("ours_best"), "kind": "system"}
    e = s.get("engine", {})
    if "ours_no_sharing_over_hf_static_compiled" in e:
        v = e["ours_no_sharing_over_hf_static_compiled"]
        t["engine_over_hf_static_compiled"] = {"value": v, "need": ">= 1.5", "met": v >= 1.5, "ours": e.get("variant"),
                                               "kind": "engine (no sharing)"}
    d = res.get("decode", {})
    c = d.get("ours_cuda_graphs", {})
    if c.get("kernels_per_layer") is not None:
        t["decode_kernels_per_layer"] = {"value": c["kernels_per_layer"], "need": "<= 15", "met": c["kernels_per_layer"] <= 15}
    if c.get("gpu_ms") is not None and c.get("rows") == 256:
        t["decode_gpu_ms_256_rows"] = {"value": c["gpu_ms"], "need": "<= 3.0", "met": c["gpu_ms"] <= 3.0}
    if "captured_over_live_gpu" in d.get("gsm8k_schedule", {}):
        v = d["gsm8k_schedule"]["captured_over_live_gpu"]
        t["captured_over_live_gpu"] = {"value": v, "need": "<= 1.3", "met": v <= 1.3}
    # the step as a run takes it (back to back, no sync between steps), overlap first where it ran;
    # a tree without that measurement: each step synced before and after
    for k, m in (("ours_overlap", "back_to_back_over_gpu"), ("ours_cuda_graphs", "back_to_back_over_gpu"),
                 ("ours_cuda_graphs", "wall_over_gpu"), ("ours_eager", "wall_over_gpu")):
        if d.get(k, {}).get(m) is not None:
            v = d[k][m]
            t["decode_wall_over_gpu"] = {"value": v, "need": "<= 1.2", "met": v <= 1.2, "variant": k, "kind": m}
            break
    tr = res.get("trainer", {})
    for k in ("no_checkpointing", "checkpointing", "shared_prompts", "shared_prompts_checkpointing"):
        if "peak_gib" in tr.get(k, {}):
            x = tr[k]
            t[f"trainer_{k}"] = {"peak_gib": x["peak_gib"], "tok_s": x["tok_s"],
                                 "need": "peak <= 12 GiB, tok/s >= 138k",
                                 "met": x["peak_gib"] <= 12 and x["tok_s"] >= WAS["trainer_tok_s"]}
    a = res.get("async", {})
    if "wait_frac" in a:
        t["async_trainer_wait"] = {"value": a["wait_frac"], "need": "< 0.1", "met": a["wait_frac"] < 0.1}
    if "async_over_sync" in a:
        t["one_gpu_async_over_sync"] = {"value": a["async_over_sync"], "need": "measured (the one-GPU default follows it)",
                                        "met": True}
    lo = res.get("long", {})
    for key, need in (("rows_paged_over_static", 5), ("sampler_paged_over_static", 3), ("trainer_packed_over_padded", 1.5),
                      ("short_paged_over_static", 0.95)):
        if lo.get(key) is not None:
            t[f"long_{key}"] = {"value": lo[key], "need": f">= {need}", "met": lo[key] >= need}
    ipc = res.get("ipc", {})
    if "publish_ms" in ipc:
        t["ipc"] = {"publish_ms": ipc["publish_ms"], "apply_ms": ipc["apply_ms"], "torn_reads": ipc["torn_reads"],
                    "was_ms": [WAS["ipc_publish_ms"], WAS["ipc_apply_ms"]], "met": ipc["torn_reads"] == 0}
    return t


def merge(into: dict, new: dict) -> dict:
    """`new` merged into `into` in place, nested dicts key by key (a later leaf wins)."""
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


def main(argv=None) -> dict:
    a = parse_args(argv)
    # stdout carries the JSON line only: everything else (ours, tqdm, transformers, spawned workers) -> stderr
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    t_start = time.perf_counter()
    device = torch.device(a.device)
    set_process_defaults(str(device))
    if device.type == "cuda":  # the profiler must know about CUDA graphs before any is captured
        torch.profiler._utils._init_for_cuda_graphs()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="asyncrl_gpu_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    prec = resolve(PrecisionConfig(dtype=a.dtype), str(device)).apply()
    shape = TINY if a.smoke else SMOLLM2_135M
    res = {"bench": "gpu", "smoke": a.smoke, "sections": a.only, "machine": machine(device),
           "precision": {k: getattr(prec, k) for k in ("dtype", "kv", "gemm", "why")}, "was": WAS}
    print(f"[gpu] {res['machine']} precision {prec.summary()}; workdir {work}", file=sys.stderr)
    try:
        ckpt = work / "model"
        res["model"] = {"shape": shape, **build_checkpoint(ckpt, shape, seed=a.seed)}
        prompts = random_prompts(a.prompts, a.prompt_min, a.prompt_max, shape["vocab_size"], a.seed)
        ctx = Ctx(a, device, prec, str(ckpt), shape, prompts, work)
        res["section_s"] = {}
        for name in a.only:
            print(f"[gpu] section {name} ...", file=sys.stderr)
            t = time.perf_counter()

            parts: dict = {}

            def progress(part: str, done: dict, name=name, t=t) -> None:  # a finished part of the section
                print(f"[gpu] {name}: {part} at {time.perf_counter() - t:.1f} s", file=sys.stderr)
                merge(parts, done)  # a part may report one branch only ({"gsm8k": {...}}): merged, not replaced
                if a.out:
                    write_json(a.out, {**res, name: {**parts, "partial": True}, "complete": False})
            ctx.progress = progress
            try:
                res[name] = SECTIONS[name](ctx)
            except Exception as e:  # noqa: BLE001 - one failing section must not lose the others' figures
                # the parts that finished before it raised are kept beside the error
                res[name] = {**parts, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                print(f"[gpu] section {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
                if a.strict:
                    raise
            finally:
                free_memory(device)
            res["section_s"][name] = round(time.perf_counter() - t, 2)
            print(f"[gpu] section {name} done in {res['section_s'][name]} s: {json.dumps(res[name])[:2000]}",
                  file=sys.stderr)
            if a.out:
                write_json(a.out, {**res, "complete": False})
        res["targets"] = targets(res)
        res["wall_s"] = round(time.perf_counter() - t_start, 2)
        res["complete"] = True
        if a.out:
            write_json(a.out, res)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    with os.fdopen(out_fd, "w") as f:
        f.write(json.dumps(res) + "\n")
    return res


if __name__ == "__main__":
    main()
