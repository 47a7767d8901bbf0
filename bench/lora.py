"""LoRA (`--train.lora.rank`) against full fine-tuning, on CPU, in one run; prints one JSON line.

- sync: what one weight update moves and how long publish -> generator takes, rank 16 on the
  default model (SmolLM2-135M): the full weights (the store in the generators' dtype, one copy
  into the generator's bound model) vs the adapters (fp32 A and B into the store, copied into the
  generator's adapters and folded into its base, `Merger.merge`). Median of `--reps`.
- memory: the trainer process's peak RSS for one micro-batch (`--rows` x `--tokens`: 1,024 and 4,096 tokens; forward +
  backward + AdamW) with its reference pass (no_grad logp of the same rows): full fine-tuning holds
  fp32 master weights, grads, AdamW moments and a reference copy of the model (the runtime keeps it
  in the generators; here it is counted with the trainer's); LoRA holds the frozen base in the
  trainer's compute dtype and the adapters, the reference being the base with the adapters off.
  `full_no_ref` is full fine-tuning without the reference copy. A fresh process each, with and
  without activation checkpointing (the same on both sides of each ratio).
- plan: `--print-memory`'s totals for AReaL's long run (`--preset=areal_long`) on
  R1-Distill-Qwen-7B at 8,192 new tokens on one 80 GB GPU, with and without `--train.lora.rank=16`.
- learn: the staleness bench's toy task (bench/staleness.py: a 3.6M Llama learning to emit ids
  below 64; AReaL, eta 2, k 1), LoRA rank 16 (default targets q, v) vs full fine-tuning at the same
  steps; each at its best lr of a small sweep (sweep seeds), then judged on other seeds: the final
  policy reward's mean and a bootstrap 95% interval of full fine-tuning's mean and of the difference.

    python bench/lora.py                              # every part (~15 min on 2 cores)
    python bench/lora.py --parts sync memory plan     # ~3 min
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.contracts.ops import token_logp  # noqa: E402
from common.engine.checkpoints.hf_io import DEFAULT_MODEL  # noqa: E402
from common.engine.checkpoints.peft_io import attach_lora  # noqa: E402
from common.engine.machine.precision import PrecisionConfig, cpu_info, resolve  # noqa: E402
from common.engine.model.lora import LoRAConfig, Merger, adapter_state, adapters_off  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402
from common.runtime.shared.weights import WeightStore  # noqa: E402
from common.runtime.step import make_optimizer, with_lora  # noqa: E402

PARTS = ("sync", "memory", "plan", "learn")


def _median_s(fn, reps: int) -> float:
    fn()  # warm: first-call kernel setup is not a sync's
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sync(a) -> dict:
    """Bytes and publish -> generator seconds of one update, full weights vs rank-`a.rank` adapters."""
    prec = resolve(PrecisionConfig(dtype=a.dtype), "cpu").apply()
    trainer = prec.load(a.model, role="trainer", tokenizer=False)[0]
    gen = prec.load(a.model, role="generator", tokenizer=False)[0]
    full = WeightStore.from_module(trainer, device=trainer.device, dtype=prec.torch_dtype)
    full.bind(gen)
    version = iter(range(1, 10**6))  # each publish a newer version, as the trainer's
    full_s = _median_s(lambda: (full.publish(trainer, next(version)), full.load_into(gen)), a.reps)
    full_bytes = full.nbytes
    full = gen = None  # freed before the LoRA half
    cfg = LoRAConfig(rank=a.rank)
    with_lora(trainer, cfg)
    with torch.no_grad():
        for name, p in adapter_state(trainer).items():
            if name.endswith(".B"):
                p.normal_(0, 1e-3)  # a trained adapter: the merge folds a non-zero update
    ads = adapter_state(trainer)
    store = WeightStore({n: (p.shape, torch.float32) for n, p in ads.items()}, device=trainer.device)
    gen = prec.load(a.model, role="generator", tokenizer=False)[0]
    attach_lora(gen, cfg, freeze=False)
    merger = Merger(gen)

    def lora_sync():  # as the trainer's OneRank.publish, the adapters' parameters found once
        store.publish(ads, next(version))
        store.load_into(gen, subset=True)
        merger.merge()

    lora_s = _median_s(lora_sync, a.reps)
    return {"model": a.model, "rank": a.rank, "targets": list(cfg.targets), "dtype": prec.dtype,
            "full_bytes": full_bytes, "lora_bytes": store.nbytes, "bytes_ratio": store.nbytes / full_bytes,
            "full_sync_s": full_s, "lora_sync_s": lora_s, "time_ratio": lora_s / full_s,
            "what": "publish + the generator's load (LoRA: + merge into its base), median of reps"}


def _reset_peak() -> None:
    """Linux: the peak resident set restarts from the current one (clear_refs 5)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    """Bytes: the peak resident set since `_reset_peak` (VmHWM), else since the process started."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(a) -> dict:
    """One variant of the memory part in this process (a fresh one per variant)."""
    set_process_defaults("cpu")
    prec = resolve(PrecisionConfig(dtype=a.dtype), "cpu").apply()
    model = prec.load(a.model, role="trainer", tokenizer=False, frozen=a.variant == "lora")[0]  # as trainer_model
    model.train()
    if a.variant == "lora":
        with_lora(model, LoRAConfig(rank=a.rank))
    model.checkpoint_layers = a.checkpointing
    ref = prec.load(a.model, role="generator", tokenizer=False)[0] if a.variant == "full" else None
    opt = make_optimizer(model, 1e-5, 0.0)
    _reset_peak()  # what loading took on the way (a file read, a cast) is not the step's
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.cfg.vocab_size, (a.rows[0], a.tokens), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, a.prompt:] = True
    t = time.perf_counter()
    with torch.no_grad():
        if a.variant == "lora":
            with adapters_off(model):
                ref_lp = token_logp(model, tokens, 1.0, mask)
        elif ref is not None:
            ref_lp = token_logp(ref, tokens, 1.0, mask)
        else:
            ref_lp = torch.zeros(tokens.shape)
    lp = token_logp(model, tokens, 1.0, mask)
    (-((lp - ref_lp) * mask).sum() / mask.sum()).backward()
    opt.step()
    return {"variant": a.variant, "peak_gib": _peak() / 2**30,
            "step_s": time.perf_counter() - t, "dtype": prec.dtype,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def memory(a) -> dict:
    """Each variant at each micro-batch (`--rows` sizes x `--tokens`), with and without activation
    checkpointing (the same on both sides of each ratio)."""
    out = {"model": a.model, "rank": a.rank, "tokens": a.tokens, "prompt": a.prompt,
           "what": "peak RSS of the process from the model's load on (VmHWM reset after loading)", "runs": []}
    for rows in a.rows:
        for ck in (False, True):
            res = {"rows": rows, "micro_batch_tokens": rows * a.tokens, "checkpointing": ck}
            for v in ("full", "full_no_ref", "lora"):
                cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--model", a.model, "--rank",
                       str(a.rank), "--rows", str(rows), "--tokens", str(a.tokens), "--prompt", str(a.prompt),
                       "--dtype", a.dtype, *(["--checkpointing"] if ck else [])]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"memory variant {v} failed:\n{r.stderr[-3000:]}")
                res[v] = json.loads(r.stdout.strip().splitlines()[-1])
            res["peak_ratio"] = res["lora"]["peak_gib"] / res["full"]["peak_gib"]
            res["peak_ratio_vs_no_ref"] = res["lora"]["peak_gib"] / res["full_no_ref"]["peak_gib"]
            print(f"[lora] memory {rows} x {a.tokens} checkpointing={ck}: full {res['full']['peak_gib']:.2f}, "
                  f"lora {res['lora']['peak_gib']:.2f} GiB ({res['peak_ratio']:.2f}x)", file=sys.stderr)
            out["runs"].append(res)
    return out


def paper_plan(a) -> dict:
    import run_gsm8k
    from common.plan.preflight import plan_of
    argv = ["--preset=areal_long", "--model=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "--gen.max_new_tokens=8192"]
    out = {"argv": argv, "gpu_gb": 80}
    for name, extra in (("full", []), ("lora", [f"--train.lora.rank={a.rank}"])):
        p = plan_of(run_gsm8k.make_config(argv + extra), gpus=[80e9])
        out[name] = {"fits": p.fits, "cuda0_gb": round(p.used("cuda:0") / 1e9, 2),
                     "trainer_gb": round(p.used("cuda:0", "trainer") / 1e9, 2)}
    return out


def _bootstrap(xs: list[float], ys: list[float] | None = None, n: int = 10000) -> list[float]:
    """95% interval of mean(xs) (or of mean(xs) - mean(ys)), resampling seeds."""
    rng = random.Random(0)
    stats = sorted(statistics.mean(rng.choices(xs, k=len(xs))) - (statistics.mean(rng.choices(ys, k=len(ys))) if ys else 0)
                   for _ in range(n))
    return [stats[int(0.025 * n)], stats[int(0.975 * n) - 1]]


def _toy_run(a, model_dir: str, root: str, rank: int, lr: float, seed: int) -> float:
    """One AReaL run of the toy task; its final policy reward (fresh samples of the last weights)."""
    from areal.algo import AReaL, AReaLConfig
    from bench.staleness import policy_reward, prompts, reward_fn
    from common.runtime.generator import GenConfig
    from common.runtime.train_config import TrainConfig
    from common.task import RunConfig
    from common.train import train
    name = f"r{rank}_lr{lr:g}_s{seed}"
    n, k = 8, 4
    cfg = RunConfig(name=name, run_root=root, model=model_dir, seed=seed,
                    gen=GenConfig(max_batch=k * n, max_new_tokens=24, n=n, temperature=1.0, update_mode="interrupt",
                                  ref_logp=False),
                    train=TrainConfig(steps=a.steps, lr=lr, warmup_steps=1, prompts_per_step=k, sync_every=1,
                                      max_staleness=2, min_buffer=k * n, buffer_capacity=6 * k * n,
                                      micro_batch_tokens=4096, keep_checkpoints=1,
                                      lora=LoRAConfig(rank=rank, export="merged")),
                    precision=PrecisionConfig(dtype="fp32"))
    algo = AReaL(AReaLConfig(n_minibatches=4), k, n, 1.0, 4096, max_staleness=2)
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(sys.stderr):
        train(cfg, algo, prompts(), reward_fn, stop_token_ids=())
    final = sorted(os.listdir(os.path.join(root, name, "checkpoints")))[-1]
    return policy_reward(os.path.join(root, name, "checkpoints", final, "model"), 24)


def learn(a) -> dict:
    from bench.staleness import make_model
    root = tempfile.mkdtemp(prefix="asyncrl_lora_")
    model_dir = os.path.join(root, "toy")
    make_model(model_dir)
    out = {"task": "bench/staleness.py toy (AReaL, eta 2)", "steps": a.steps, "rank": a.rank,
           "sweep_seeds": a.sweep_seeds, "seeds": a.seeds, "sweep": {}}
    best = {}
    for rank, lrs in ((0, a.full_lrs), (a.rank, a.lora_lrs)):
        for lr in lrs:
            r = [_toy_run(a, model_dir, root, rank, lr, s) for s in a.sweep_seeds]
            out["sweep"][f"rank{rank}_lr{lr:g}"] = r
            print(f"[lora] learn rank {rank} lr {lr:g}: {r}", file=sys.stderr)
            if rank not in best or statistics.mean(r) > best[rank][1]:
                best[rank] = (lr, statistics.mean(r))
    final = {rank: [_toy_run(a, model_dir, root, rank, best[rank][0], s) for s in a.seeds] for rank in best}
    full, lora = final[0], final[a.rank]
    out.update(full_lr=best[0][0], lora_lr=best[a.rank][0], full=full, lora=lora,
               full_mean=statistics.mean(full), lora_mean=statistics.mean(lora), full_ci=_bootstrap(full),
               diff_ci=_bootstrap(lora, full))
    out["lora_within_full_ci"] = out["lora_mean"] >= out["full_ci"][0]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--reps", type=int, default=20, help="sync: repetitions (median)")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 8], help="memory: rows of the micro-batches")
    ap.add_argument("--tokens", type=int, default=512, help="memory: tokens per row")
    ap.add_argument("--prompt", type=int, default=128, help="memory: tokens before the loss positions")
    ap.add_argument("--steps", type=int, default=30, help="learn: trainer steps per run")
    ap.add_argument("--full_lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    ap.add_argument("--lora_lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--sweep_seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)  # memory's child
    ap.add_argument("--variant", choices=["full", "full_no_ref", "lora"], help=argparse.SUPPRESS)  # memory's child
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(memory_child(a)))
        return
    set_process_defaults("cpu")
    out = {"bench": "lora", "cpu": cpu_info()["model"], "date": time.strftime("%Y-%m-%d")}
    for part, fn in (("sync", sync), ("memory", memory), ("plan", paper_plan), ("learn", learn)):
        if part in a.parts:
            t = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
                out[part] = fn(a)
            out[part]["wall_s"] = round(time.perf_counter() - t, 1)
            print(f"[lora] {part}: {json.dumps(out[part])[:400]}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
