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
    python bench/gpu.py --arch rho-1b --only trainer       # a paper's shape (pythia-1b, rho-1b, r1-qwen-1.5b)

`--arch` builds a random checkpoint of a published shape (bench/_gpu_paper.py; common/engine/checkpoints/shapes.py)
in `--workdir`, reused by later runs there, and adds the decode step against its bandwidth floor and
the trainer's MFU (`paper`), with their targets; with `--smoke`, its family at tiny sizes.

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
from bench._gpu_gen import HF_SETTINGS, SAMPLER_PARTS, VARIANTS, sampler_section  # noqa: E402
from bench._gpu_paper import ALIASES, ARCH_DEFAULTS, arch_config, build_arch, hub_id  # noqa: E402
from bench._gpu_targets import WAS, targets  # noqa: E402
from bench._gpu_train import async_section, ipc_section, trainer_section  # noqa: E402
from bench.long_outputs import measure as long_measure, parse_args as long_args  # noqa: E402
from bench._gpu_util import (Ctx, default_config, free_memory, machine,  # noqa: E402
                             random_prompts, write_json)
from common.engine.machine.precision import PrecisionConfig, resolve  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402



def long_section(ctx) -> dict:
    """bench/long_outputs.py on this device (paged vs static KV at equal memory, packed vs padded
    rows: its docstring), bf16 on CUDA; smoke: its --quick without the trainer part."""
    cuda = ctx.device.type == "cuda"
    argv = ["--device", str(ctx.device), "--dtype", "bfloat16" if cuda else "float32"]
    return long_measure(long_args(argv + (["--quick", "--skip-trainer"] if ctx.args.smoke else [])))


SECTIONS = {"sampler": sampler_section, "decode": decode_section, "trainer": trainer_section,
            "ipc": ipc_section, "async": async_section, "long": long_section}
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
    arg("--arch", default=None, help=f"a paper's model shape instead of SmolLM2's (random weights): one of "
        f"{sorted(ALIASES)} or a hub id of common/engine/checkpoints/shapes.py; with --smoke its family at tiny sizes")
    arg("--mem-bw-tbs", type=float, default=None, help="the card's memory bandwidth, TB/s (default: from its name)")
    arg("--peak-tflops", type=float, default=None, help="the card's peak dense bf16 TFLOP/s (default: from its name)")
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
    g.add_argument("--sampler-parts", default=",".join(SAMPLER_PARTS),
                   help=f"the sampler section's parts, of {list(SAMPLER_PARTS)}")
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
    first = ap.parse_args(argv)
    if first.smoke:  # smoke sizes are defaults: flags given still win
        ap.set_defaults(**SMOKE)
    elif first.arch:  # the paper shapes' defaults (bench/_gpu_paper.py: ARCH_DEFAULTS)
        ap.set_defaults(**ARCH_DEFAULTS)
    a = ap.parse_args(argv)
    if a.arch:
        try:
            hub_id(a.arch)
        except ValueError as e:
            ap.error(str(e))
    a.sampler_parts = [p.strip() for p in a.sampler_parts.split(",") if p.strip()]
    if "default" not in a.sampler_parts or any(p not in SAMPLER_PARTS for p in a.sampler_parts):
        ap.error(f"--sampler-parts: default and any of {list(SAMPLER_PARTS)}")
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
    shape = arch_config(a.arch, a.smoke) if a.arch else default_config(a.smoke)
    res = {"bench": "gpu", "smoke": a.smoke, "sections": a.only, "machine": machine(device),
           "precision": {k: getattr(prec, k) for k in ("dtype", "kv", "gemm", "why")}, "was": WAS}
    print(f"[gpu] {res['machine']} precision {prec.summary()}; workdir {work}", file=sys.stderr)
    try:
        # one checkpoint per shape and seed in --workdir, reused by the next section's process
        ckpt = work / f"model-{(a.arch or 'smollm2-135m').replace('/', '__')}{'-smoke' if a.smoke else ''}-seed{a.seed}"
        named = {"arch": a.arch, "hub_id": hub_id(a.arch)} if a.arch else {}
        res["model"] = {**named, "shape": shape, **build_arch(ckpt, shape, device, seed=a.seed)}
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
        res["targets"] = targets(res, a)
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
