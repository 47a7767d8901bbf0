"""Trainer step: fp32 (the previous default) vs the precision picked for this machine, and the
train/inference log-prob mismatch each precision brings.

Single process, default model, one thread. A step here is what the trainer does per micro-batch
plus the update: `token_logp` over `--rows` x `--tokens` random tokens (loss on the second
half, as completions after a prompt), backward, AdamW step on fp32 master weights. The two
precisions alternate, `--reps` times each, after one warm-up each; medians are reported.

Mismatch: the sampler (generator dtype, KV dtype) samples `--mismatch-prompts` GSM8K prompts x 4
at T = 0.7; the trainer recomputes the same tokens' log-probs with its weights; we report the
mean and max |difference| per token and the mean exp(diff) - 1 (the importance weight's bias).
For fp32 both sides are fp32 and the difference is kernel rounding only. The fp32 forward +
backward is also set against its FLOP floor on this machine (`floor_s`, `frac_of_floor`:
bench/_floor.py, measured beside every rep; the fraction is the median of the reps' own;
bench/trainer_floor.py has the profile). Prints one JSON line.

    python bench/trainer_step.py              # 16 x 200 tokens, 3 reps (~4 min on 2 cores)
    python bench/trainer_step.py --quick      # 4 x 64 tokens, 1 rep

Ranks (`--ranks 1,2`): the trainer-only step time with N FSDP2 ranks (`train.trainer_devices`),
the same work for every N: one TBA step (`common/runtime/step.py: OneRank.update`, `TrainerGroup.update` for N,
what the trainer runs: every micro-batch's forward and backward, grad clip, AdamW) on one
fixed batch of `--rows` x `--tokens` (groups of 4, loss on the second half), micro-batches of
`--micro-rows` rows, at the precision `auto` picks here (or `--dtype`). Ranks are processes of one thread
each (on CPU: gloo, one rank per core). The one rank (no process group) and each N > 1
group (for each `--reshard` mode) are built once and their steps alternate, `--reps` each
after one warm-up; medians and the ratio step_s(1) / step_s(N) (against the one-rank steps of
the same window) are reported, with the CPU and the load average.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._floor import frac_of_floor, gemm_floor, work_args  # noqa: E402
from common.contracts.batch import Trajectory, collate  # noqa: E402
from common.engine.machine.precision import Precision, PrecisionConfig, cpu_info, resolve  # noqa: E402
from common.engine.sampler.sampler import Sampler  # noqa: E402
from common.engine.sampler.sampling import SamplingParams  # noqa: E402
from common.contracts.ops import token_logp  # noqa: E402
from common.runtime.process import set_process_defaults  # noqa: E402
from common.runtime.step import make_optimizer  # noqa: E402
from common.runtime.train_config import TrainConfig  # noqa: E402
from common.runtime.shared.weights import WeightStore  # noqa: E402
from common.train import trainer_ranks  # noqa: E402
from tba.algo import TBA, TBAConfig  # noqa: E402


def step_times(model, opt, tokens, mask) -> tuple[float, float]:
    """(forward + backward s, optimizer s) of one step."""
    t = time.perf_counter()
    token_logp(model, tokens, 0.7, mask).sum().backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t, time.perf_counter() - t1


def mismatch(prec: Precision, model_name: str, trainer, prompts) -> dict:
    gen, _ = prec.load(model_name, tokenizer=False)
    P = max(map(len, prompts))
    outs = Sampler(gen, max_batch=len(prompts) * 4, max_seq_len=P + 64, max_prompt_len=P).generate(
        prompts, SamplingParams(max_new_tokens=64, temperature=0.7, n=4, seed=0))
    d = []
    with torch.no_grad():
        for c in outs:
            lp = token_logp(trainer, torch.tensor([c.prompt_tokens + c.tokens]), 0.7)[0, len(c.prompt_tokens):]
            d.append(c.logp_tensor() - lp)
    d = torch.cat(d)
    return {"tokens": d.numel(), "mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(),
            "ratio_bias": (d.exp() - 1).mean().item()}


def rank_batch(rows: int, tokens: int, vocab: int, k: int = 4):
    """rows x tokens random tokens in groups of k, the second half a completion with rewards."""
    g = torch.Generator().manual_seed(0)
    half = tokens // 2
    trajs = [Trajectory(torch.randint(0, vocab, (half,), generator=g), torch.randint(0, vocab, (tokens - half,), generator=g),
                        torch.zeros(tokens - half), torch.zeros(tokens - half, dtype=torch.long),
                        float(torch.rand(1, generator=g)), i // k, ref_seq_logp=-float(tokens - half))
             for i in range(rows)]
    return collate(trajs)


def bench_ranks(a, prec: Precision) -> dict:
    """Trainer-only step time for 1 rank and for each N in --ranks (module docstring)."""
    ranks = sorted({int(x) for x in a.ranks.split(",")})
    if ranks[0] != 1:
        raise SystemExit("--ranks must include 1 (the baseline)")
    run_dir = Path(tempfile.mkdtemp(prefix="asyncrl_ranks_"))
    modes = [(n, r) for n in ranks[1:] for r in a.reshard.split(",")]
    tc = {(n, r): TrainConfig(trainer_devices=n, lr=1e-7, grad_clip=1.0, stall_timeout=0, reshard=r)
          for n, r in [(1, "pass")] + modes}
    algo = TBA(TBAConfig(beta_init=1.0, beta_final=1.0), a.rows // 4, 4, 0.7, a.micro_rows * a.tokens)

    def group(mode):
        m, _ = prec.load(a.model, role="trainer", tokenizer=False)
        return trainer_ranks(tc[mode])(m.train(), tc[mode], prec, a.model, algo, WeightStore.from_module(m), run_dir)

    def step(g) -> float:
        t = time.perf_counter()
        g.update(batch, 0, 1e-7, 1.0)
        return time.perf_counter() - t

    one = group((1, "pass"))
    batch = rank_batch(a.rows, a.tokens, one.model.cfg.vocab_size)
    res = {"bench": "trainer_step_ranks", "model": a.model, "cpu": prec.cpu.get("model") or cpu_info()["model"],
           "cores": os.cpu_count(), "threads_per_rank": 1, "rows": a.rows, "tokens": a.tokens,
           "micro_batches": -(-a.rows // a.micro_rows), "reps": a.reps, "dtype": prec.dtype, "gemm": prec.gemm,
           "loadavg_before": os.getloadavg()[0]}
    times = {"1": [], **{f"{n}_{r}": [] for n, r in modes}}
    step(one)  # warm-up (kernel creation, AdamW state)
    for n, r in modes:
        with group((n, r)) as g:
            step(g)
            for _ in range(a.reps):  # alternate, so drift on a shared machine hits both alike
                times["1"].append(step(one))
                times[f"{n}_{r}"].append(step(g))
    if not modes:
        times["1"] = [step(one) for _ in range(a.reps)]
    one.close()
    shutil.rmtree(run_dir, ignore_errors=True)  # only the ranks' stack-dump files
    for k, ts in times.items():
        res[f"step_s_{k}"] = statistics.median(ts)
        res[f"all_{k}"] = [round(t, 3) for t in ts]
    for n, r in modes:  # against the one-rank steps of the same window
        i = modes.index((n, r))
        res[f"speedup_{n}_{r}"] = statistics.median(times["1"][i * a.reps:(i + 1) * a.reps]) / res[f"step_s_{n}_{r}"]
    res["loadavg_after"] = os.getloadavg()[0]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    work_args(ap)
    ap.add_argument("--mismatch-prompts", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", default="", help="e.g. 1,2: trainer step time with N FSDP2 ranks (module docstring)")
    ap.add_argument("--micro-rows", type=int, default=4, help="--ranks: rows per micro-batch")
    ap.add_argument("--reshard", default="pass,update", help="--ranks: train.reshard modes of the N > 1 groups")
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"), help="--ranks: precision.dtype")
    a = ap.parse_args()
    if a.quick:
        a.rows, a.tokens, a.reps, a.mismatch_prompts = 4, 64, 1, 1
    set_process_defaults("cpu")  # one thread, freed memory kept: as the trainer runs
    auto = resolve(PrecisionConfig())
    print(f"[bench] precision: {auto.summary()}", file=sys.stderr)
    if a.ranks:
        prec = auto if a.dtype == "auto" else resolve(PrecisionConfig(dtype=a.dtype))
        print(json.dumps(bench_ranks(a, prec.apply())))
        return
    precs = {"fp32": Precision("fp32", auto.gemm, "fp32", auto.attention), "auto": auto}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 49152, (a.rows, a.tokens), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, a.tokens // 2:] = True
    models = {}
    for name, p in precs.items():
        p.apply()
        m, tok = p.load(a.model, role="trainer")
        m.train()
        opt = make_optimizer(m, 1e-7, 0.0)  # the trainer's AdamW
        step_times(m, opt, tokens, mask)  # warm-up (oneDNN kernel creation, AdamW state)
        models[name] = (m, opt)
    times = {n: {"fwd_bwd_s": [], "opt_s": []} for n in precs}
    floors, scored = [], int(mask[:, 1:].sum())  # the fp32 step's FLOP floor (bench/_floor.py), beside every rep
    for _ in range(a.reps):
        floors.append(gemm_floor(models["fp32"][0].cfg, a.rows, a.tokens, scored, reps=2))
        for name, p in precs.items():  # alternate, so drift on a shared machine hits both alike
            p.apply()
            fb, o = step_times(*models[name], tokens, mask)
            times[name]["fwd_bwd_s"].append(fb)
            times[name]["opt_s"].append(o)
    from run_gsm8k import default_data_dir, format_prompt, load_split
    ex = load_split(str(default_data_dir()), "test", limit=a.mismatch_prompts)
    prompts = [tok(format_prompt(e.question, tok), add_special_tokens=False)["input_ids"] for e in ex]
    res = {"bench": "trainer_step", "model": a.model, "cpu": auto.cpu.get("model"), "threads": 1, "rows": a.rows,
           "tokens": a.tokens, "reps": a.reps, "precision": {k: v for k, v in auto.to_dict().items() if k != "cpu"}}
    for name, p in precs.items():
        p.apply()
        fb, o = statistics.median(times[name]["fwd_bwd_s"]), statistics.median(times[name]["opt_s"])
        res[name] = {"dtype": p.dtype, "kv": p.kv, "gemm": p.gemm, "fwd_bwd_s": fb, "opt_s": o, "step_s": fb + o,
                     "tok_s": int(mask.sum()) / (fb + o), "fwd_bwd_all": times[name]["fwd_bwd_s"],
                     "mismatch": mismatch(p, a.model, models[name][0], prompts)}
    res["speedup_step"] = res["fp32"]["step_s"] / res["auto"]["step_s"]
    # the fp32 step against its FLOP floor on this machine (bf16 has none measured): median of each rep's ratio
    res["fp32"].update(floor_s=statistics.median(f["floor_s"] for f in floors), floor_all=[f["floor_s"] for f in floors],
                       tflop=floors[0]["tflop"], gemm_gflops_best=max(f["gemm_gflops_best"] for f in floors),
                       frac_of_floor=frac_of_floor(floors, times["fp32"]["fwd_bwd_s"]))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
