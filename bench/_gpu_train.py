"""Training-side sections of `bench/gpu.py`: a trainer step, CUDA IPC weights, a short async run.

trainer  The model loaded as the trainer loads it (`Precision.load(role="trainer")`: fp32 master
         weights, forward passes under autocast to the run's dtype, bf16 on CUDA), fused AdamW on
         CUDA as in `common/runtime/trainer.py`. One step = `token_logp(model, tokens, T, mask)` over
         `--train-rows` x `--train-tokens` random ids (loss mask on the tokens after
         `--train-prompt`), masked-mean loss, backward, grad-norm clip, AdamW step. Per setting of
         `model.checkpoint_layers` (False, True): warm-up steps, then the peak-memory counter is
         reset and `--train-reps` steps are timed one by one (synchronised); step_s = median,
         tok_s = rows x tokens / step_s (all tokens, as the 138k tok/s figure counted them),
         peak_gib = `torch.cuda.max_memory_allocated` over the timed steps (it includes the
         weights, AdamW state and gradients). On CPU: the process's max RSS (never reset).
         On CUDA, one more step under the profiler: device busy ms (union of kernel intervals),
         kernel count, wall / device, the kernels taking the most device time.
         `--train-group n` > 1: rows in groups of n sharing their prompt, and two more settings
         with the trainer's call on them (`prompt_lens`: each prompt run once, packed).
ipc      `WeightStore` on the device in the generators' dtype, a spawned reader process with its
         own copy of the model (bench/weights.py's structure). Per rep (after one warm-up):
         `publish(model)` timed here, the reader's `load_into` timed there (both synchronise the
         device inside). Also the trainer's real path: publish from the fp32 master weights (a
         cast while copying). Torn reads: the reader loops `load_into` while this process
         publishes `--ipc-publishes` versions back to back, each filling every tensor with a value
         of its version; a read whose tensors are not all that value is torn (must be 0).
async    `common/runtime/trainer.train` with `make_algo` (TBA) on run_gsm8k's GPU preset
         (`--preset=gpu`: 7 prompts x 20 samples, 512 new tokens, generator max_batch 256,
         micro-batches of 32768 tokens, publish every 2 steps, min_buffer 500), one generator
         sharing the device, random prompts of the sampler workload's lengths, no stop tokens,
         a toy reward; eval and periodic checkpoints off; buffer capacity `--async-buffer` (the
         preset's 65536 rows would only add shared memory and checkpoint time). Read back from
         runs/<name>/metrics.jsonl: steps/s after the first step, mean generator tok/s, weight
         syncs, trainer wait fraction (sum wait_s / wall, after the first step);
         first_step_at_s is on the metrics clock (from the trainer's logger start, after its
         model load: mostly the wait for min_buffer trajectories).
"""
from __future__ import annotations

import dataclasses
import resource
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
import torch.multiprocessing as mp

import run_gsm8k
from bench._gpu_util import (FIRST_ID, Ctx, device_ms, free_memory, median, random_prompts, sync, top_kernels,
                             toy_reward)
from common import task
from common.contracts.batch import PromptSet
from common.contracts.log import read_metrics
from common.contracts.ops import token_logp
from common.runtime.generator import GenConfig
from common.runtime.shared.weights import WeightStore
from common.train import train


# ------------------------------------------------------------------ trainer
def _train_step(model, opt, tokens, mask, temperature, prompt_lens=None) -> float:
    lp = token_logp(model, tokens, temperature, mask, prompt_lens=prompt_lens)
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def trainer_section(ctx: Ctx) -> dict:
    a, dev = ctx.args, ctx.device
    model = ctx.prec.load(ctx.ckpt, device=dev, role="trainer", tokenizer=False)[0]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=ctx.cuda)
    g = torch.Generator().manual_seed(a.seed)
    tokens = torch.randint(FIRST_ID, model.cfg.vocab_size, (a.train_rows, a.train_tokens), generator=g).to(dev)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, a.train_prompt:] = True
    for r in range(a.train_rows):  # groups of --train-group rows share their prompt
        tokens[r, :a.train_prompt] = tokens[r - r % a.train_group, :a.train_prompt]
    plens = torch.full((a.train_rows,), a.train_prompt, device=dev)
    out = {"rows": a.train_rows, "tokens": a.train_tokens, "prompt_tokens": a.train_prompt,
           "loss_tokens": int(mask.sum()), "master_dtype": str(model.dtype).replace("torch.", ""),
           "compute_dtype": str(model.compute_dtype or model.dtype).replace("torch.", ""), "fused_adamw": ctx.cuda,
           "peak_source": "torch.cuda.max_memory_allocated over the timed steps" if ctx.cuda else
           "CPU: process max RSS (ru_maxrss), not reset between settings"}
    settings = [("no_checkpointing", False, None), ("checkpointing", True, None)]
    if a.train_group > 1:  # the trainer's call: each group's prompt run once (common/engine/model/prefix.py)
        settings += [("shared_prompts", False, plens), ("shared_prompts_checkpointing", True, plens)]
    out["group"] = a.train_group
    for name, ckpt, pl in settings:
        model.checkpoint_layers, model.share_prompts = ckpt, pl is not None  # asked for: off by default on CUDA
        for _ in range(a.train_warmup):
            _train_step(model, opt, tokens, mask, a.temperature, pl)
        free_memory(dev)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        times, losses = [], []
        for _ in range(a.train_reps):
            sync(dev)
            t = time.perf_counter()
            losses.append(_train_step(model, opt, tokens, mask, a.temperature, pl))
            sync(dev)
            times.append(time.perf_counter() - t)
        step = median(times)
        peak = (torch.cuda.max_memory_allocated(dev) if ctx.cuda else
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
        out[name] = {"step_s": step, "tok_s": tokens.numel() / step, "loss_tok_s": int(mask.sum()) / step,
                     "peak_gib": peak, "step_s_all": [round(x, 4) for x in times], "loss_last": losses[-1],
                     "checkpoint_layers": ckpt, "shared_prompts": pl is not None}
        if ctx.cuda:
            out[name]["allocated_before_gib"] = base / 2**30  # weights + AdamW state, no gradients
            out[name]["reserved_peak_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
            out[name]["profile"] = _profile_step(model, opt, tokens, mask, a.temperature, dev, step, pl)
        ctx.progress(name, out)
    return out


def _profile_step(model, opt, tokens, mask, temperature, dev, step_s: float, prompt_lens=None) -> dict:
    """One step under the profiler (CUDA events only): device busy time against the timed wall,
    the kernel count and the kernels that take the most device time (where a slow step goes)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train_step(model, opt, tokens, mask, temperature, prompt_lens)
        sync(dev)
    busy, n = device_ms(prof, True)
    return {"device_ms": busy, "device_events": n, "wall_over_device": 1e3 * step_s / busy if busy else None,
            "top_kernels_ms_launches": top_kernels(prof, 8)}


# ------------------------------------------------------------------ ipc
def fill_value(version: int) -> float:
    return float(version % 128)  # exact in bf16; consecutive versions differ


def ipc_reader(ckpt, device, prec, store, cmd_q, res_q, done) -> None:
    """Spawned process: its own model; serves "apply" (timed load_into) and "race" (read
    while the writer publishes, check every read); replies with numbers only."""
    torch.set_num_threads(1)
    prec.apply()
    model = prec.load(ckpt, device=device, role="generator", tokenizer=False)[0]
    params = list(model.parameters())
    res_q.put(("ready",))
    while (cmd := cmd_q.get())[0] != "stop":
        if cmd[0] == "apply":
            t = time.perf_counter()
            v = store.load_into(model)  # synchronises the device before returning
            res_q.put(("apply", v, time.perf_counter() - t))
            continue
        first = cmd[1]  # "race": versions >= first carry fill values; older ones are real weights
        reads = torn = exhausted = 0
        seen = set()
        res_q.put(("racing",))
        while True:
            last = done.is_set()  # one more read after the writer's last publish
            try:
                v = store.load_into(model)
            except RuntimeError:  # every retry torn: the writer outran us max_retries times
                exhausted += 1
                continue
            if v >= first:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                torn += not bool((flat == fill_value(v)).all())
                reads += 1
                seen.add(v)
            if last:
                break
        res_q.put(("race", reads, torn, exhausted, len(seen)))


def ipc_section(ctx: Ctx) -> dict:
    a, dev, prec = ctx.args, ctx.device, ctx.prec
    model = prec.load(ctx.ckpt, device=dev, role="generator", tokenizer=False)[0]
    store = WeightStore.from_module(model, device=dev, dtype=prec.torch_dtype)
    mctx = mp.get_context("spawn")
    cmd_q, res_q, done = mctx.Queue(), mctx.Queue(), mctx.Event()
    proc = mctx.Process(target=ipc_reader, args=(ctx.ckpt, str(dev), prec, store, cmd_q, res_q, done), daemon=True)
    proc.start()
    try:
        assert res_q.get(timeout=600)[0] == "ready"
        pub, app = [], []
        for rep in range(a.ipc_reps + 1):  # rep 0: warm-up
            t = time.perf_counter()
            store.publish(model, rep + 1)  # synchronises the device before returning
            t_pub = time.perf_counter() - t
            cmd_q.put(("apply",))
            tag, v, t_app = res_q.get(timeout=600)
            assert tag == "apply" and v == rep + 1, (tag, v)
            if rep:
                pub.append(t_pub), app.append(t_app)
        ver = a.ipc_reps + 1
        master = prec.load(ctx.ckpt, device=dev, role="trainer", tokenizer=False)[0]  # the trainer's fp32 weights
        pub32 = []
        for rep in range(a.ipc_reps + 1):
            ver += 1
            t = time.perf_counter()
            store.publish(master, ver)
            if rep:
                pub32.append(time.perf_counter() - t)
        del master
        fill = {n: torch.empty(p.shape, dtype=prec.torch_dtype, device=dev) for n, p in model.named_parameters()}
        cmd_q.put(("race", ver + 1))
        assert res_q.get(timeout=600)[0] == "racing"
        t_race = time.perf_counter()
        for _ in range(a.ipc_publishes):
            ver += 1
            for x in fill.values():
                x.fill_(fill_value(ver))
            store.publish(fill, ver)
        done.set()
        t_race = time.perf_counter() - t_race
        tag, reads, torn, exhausted, seen = res_q.get(timeout=600)
        cmd_q.put(("stop",))
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
    return {"param_bytes": store.nbytes, "store_dtype": str(prec.torch_dtype).replace("torch.", ""),
            "store_device": str(dev), "reps": a.ipc_reps, "publish_ms": 1e3 * median(pub),
            "apply_ms": 1e3 * median(app), "publish_from_fp32_master_ms": 1e3 * median(pub32),
            "publish_ms_all": [round(1e3 * x, 3) for x in pub], "apply_ms_all": [round(1e3 * x, 3) for x in app],
            "race_publishes": a.ipc_publishes, "race_s": t_race, "race_reads": reads, "race_versions_seen": seen,
            "torn_reads": torn,
            "reads_retry_exhausted": exhausted}


# ------------------------------------------------------------------ async
def async_argv(ctx: Ctx, run_root, name: str) -> list[str]:
    a = ctx.args
    argv = ["--preset=gpu", f"--model={ctx.ckpt}", f"--name={name}", f"--run_root={run_root}",
            f"--train.steps={a.async_steps}", f"--train.device={ctx.device}", f"--precision.dtype={a.dtype}",
            "--train.checkpoint_every=0", "--train.keep_checkpoints=1", "--train.eval_every=0", "--data.eval_size=0",
            f"--train.buffer_capacity={a.async_buffer}", "--train.stall_timeout=600",
            "--train.n_generators=1"]  # one generator (on a one-GPU machine it shares the trainer's device)
    if a.smoke:  # the preset's path, at shapes a CPU runs in seconds
        argv += ["--gen.max_batch=8", "--gen.max_new_tokens=8", "--gen.n=2", "--train.prompts_per_step=2",
                 "--train.min_buffer=4", "--train.micro_batch_tokens=512"]
    if ctx.cuda and "cuda_graphs" in {f.name for f in dataclasses.fields(GenConfig)}:
        argv.append("--gen.cuda_graphs=true")
    return argv


def async_section(ctx: Ctx) -> dict:
    """The async run's figures at the top level; with `--async-modes=async,sync`, also the same
    run lock-step (`--train.mode=sync`) under "sync", and async's steps/s over sync's (one GPU shared
    by the generator and the trainer may lose to lock-step)."""
    out = {}
    for mode in ctx.args.async_modes:
        out[mode] = _async_run(ctx, mode)
        ctx.progress(mode, out)
    res = dict(out.get("async", {}), **({"sync": out["sync"]} if "sync" in out else {}))
    if "async" in out and "sync" in out:
        res["async_over_sync"] = out["async"]["steps_per_s"] / out["sync"]["steps_per_s"]
    return res


def _async_run(ctx: Ctx, mode: str) -> dict:
    a = ctx.args
    if a.async_steps < 2:
        raise ValueError("--async-steps must be >= 2 (rates are taken after the first step)")
    root, name = ctx.workdir / "runs", f"gpu_{mode}"
    cfg = run_gsm8k.make_config(async_argv(ctx, root, name) + [f"--train.mode={mode}"])
    task.setup(cfg)
    V = ctx.shape["vocab_size"]
    prompts = PromptSet(random_prompts(a.async_prompts, a.prompt_min, a.prompt_max, V, a.seed + 1),
                        [V // 5] * a.async_prompts)
    t = time.perf_counter()
    train(cfg, task.make_algo(cfg), prompts, toy_reward, stop_token_ids=())
    wall = time.perf_counter() - t
    rows = [r for r in read_metrics(root / name / "metrics.jsonl") if "step_s" in r]
    after = rows[1:]
    span = rows[-1]["time"] - rows[0]["time"]
    syncs = rows[-1]["gen_syncs"]
    pubs = [r["publish_s"] for r in rows if r["publish_s"] > 0]
    return {"algo": cfg.algo, "mode": mode, "steps": len(rows), "wall_s": wall, "first_step_at_s": rows[0]["time"],
            "steps_per_s": len(after) / span, "gen_tok_s": statistics.mean(r["gen_tok_s"] for r in after),
            "gen_syncs": syncs, "gen_sync_ms": 1e3 * rows[-1]["gen_sync_s"] / syncs if syncs else None,
            "wait_frac": sum(r["wait_s"] for r in after) / span,
            "trainer_tok_s": statistics.mean(r["trainer_tok_s"] for r in after),
            "train_s": statistics.mean(r["train_s"] for r in after),
            "publish_ms": 1e3 * statistics.mean(pubs) if pubs else None,
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in after),
            "reward_mean_last": rows[-1]["reward_mean"],
            "config": {"prompts_per_step": cfg.train.prompts_per_step, "n": cfg.gen.n,
                       "max_new_tokens": cfg.gen.max_new_tokens, "gen_max_batch": cfg.gen.max_batch,
                       "sync_every": cfg.train.sync_every, "min_buffer": cfg.train.min_buffer,
                       "micro_batch_tokens": cfg.train.micro_batch_tokens, "n_generators": cfg.train.n_generators,
                       "buffer_capacity": cfg.train.buffer_capacity, "device": cfg.train.device,
                       "gen_cuda_graphs": getattr(cfg.gen, "cuda_graphs", None), "prompts": a.async_prompts},
            "run_dir": str(root / name)}
