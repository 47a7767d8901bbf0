"""Long reasoning outputs: the paged KV pool against static slots, and packed training rows against
padded ones. One process, one thread; prints one JSON line.

  (a) rows_paged_over_static   rows held at equal KV memory under lognormal output lengths (mean
      `--mean`, cap `--cap`, sigma `--sigma` of the log; prompts `--prompt` tokens): continuous
      batching simulated on the real page allocator (`common/engine/kv/pages.py`: admission with its
      watermark, a page taken per `page` tokens, the youngest preempted when short) against static
      slots, each of which reserves prompt + cap. Mean rows over the run's steady part.
  (b) sampler_paged_over_static  the sampler's tokens/s on that length distribution scaled down by
      `--scale` (a CPU cannot decode 32k-token answers in minutes), at equal KV memory: the static
      cache gets the slots its memory buys, the paged one the same bytes as a pool (and up to
      `--paged-batch` rows); the same requests (lengths forced by max_new_tokens, no stop), timed whole.
  (c) trainer_packed_over_padded the trainer's forward + backward tokens/s on a long-tail batch, packed
      rows vs right-padded (`bench/_long_train.py`).
  (d) short_paged_over_static    today's short workloads, paged vs static sampler at the same slots:
      the GSM8K-shaped one (`bench/sampler.py`'s prompts, n = 4, 128 new tokens) and a batch of short
      random prompts; the worst ratio of the two.
Model: the default model's architecture (SmolLM2-135M) with random weights at the precision the
runtime picks (`--dtype`), or `--arch` / `--tiny`.

    python bench/long_outputs.py                 # defaults (~15 min on 2 CPU cores)
    python bench/long_outputs.py --quick         # smoke (~1 min)
    python bench/long_outputs.py --page-ab 16,64,256 --rounds 2   # (b)'s paged run per page size
    python bench/long_outputs.py --device=cuda --dtype=bfloat16   # on a GPU (lengths x 1/4); bench/gpu.py --only long
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._long_train import trainer_packed_vs_padded  # noqa: E402
from common.engine.kv.pages import PagePool  # noqa: E402
from common.engine.kv.budget import PAGE_SIZE  # noqa: E402
from common.engine.kv.paged_cache import WATERMARK  # noqa: E402
from common.engine.model.transformer import Transformer  # noqa: E402
from common.engine.model.model_config import ModelConfig  # noqa: E402
from common.engine.sampler.sampler import Sampler  # noqa: E402
from common.engine.sampler.sampling import SamplingParams  # noqa: E402


def lognormal_lengths(n: int, mean: float, sigma: float, cap: int, seed: int = 0) -> list[int]:
    """n lengths, lognormal with the given mean and sigma of the log, capped, at least 1."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    return [max(1, min(cap, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def rows_at_equal_memory(lengths: list[int], prompt: int, cap: int, kv_tokens: int, page: int,
                         watermark: float = WATERMARK) -> dict:
    """Mean rows running: static slots (kv_tokens // (prompt + cap)) vs the page pool driven as the
    sampler drives it: admission while pages remain above the watermark (prompt + first page), a
    page per `page` tokens generated (own tokens start on a fresh page, so every row crosses a page
    end together: the simulation advances a page at a time), the youngest preempted (back to the
    front of the queue, its tokens kept) when the pool is short. One prompt per sample here: no
    sharing, the conservative case."""
    static = kv_tokens // (prompt + cap)
    pool = PagePool.for_tokens(kv_tokens, page)
    keep, need = int(watermark * pool.n_pages), pool.pages_for
    queue = [[i, 0] for i in range(len(lengths))]  # (sample, pages of own tokens it had): preempted ones in front
    run: dict[int, list] = {}                       # sample -> [pages held, own pages written, admission order]
    order, rows, preempted, reprefill = 0, [], 0, 0
    while queue or run:
        while queue and pool.can_take(need(prompt) + queue[0][1] + 1, keep if run else 0):
            i, had = queue.pop(0)
            run[i] = [pool.take(need(prompt) + had + 1), had, order]
            order += 1
        rows.append(len(run))
        for i in sorted(run, key=lambda i: run[i][2]):  # oldest first: one page of tokens each
            if i not in run:
                continue
            st = run[i]
            st[1] += 1
            if st[1] * page >= lengths[i]:
                pool.drop(run.pop(i)[0])
                continue
            while i in run and not pool.can_take(1):
                victim = max(run, key=lambda j: run[j][2])
                held = run.pop(victim)
                pool.drop(held[0])
                queue.insert(0, [victim, held[1]])
                preempted += 1
                reprefill += prompt + held[1] * page  # what its resume prefills again
            if i in run:
                st[0] += pool.take(1)
    steady = rows[len(rows) // 10: len(rows) - len(rows) // 4] or rows  # without the ramp up and the tail
    mean = statistics.mean(steady)
    return {"static_rows": static, "paged_rows_mean": round(mean, 1), "pool_pages": pool.n_pages, "page": page,
            "watermark": watermark,
            "samples": len(lengths), "preemptions": preempted,
            "reprefill_over_generated": round(reprefill / sum(lengths), 3),  # the price of those rows (prefill, not decode)
            "rows_paged_over_static": round(mean / max(static, 1), 2)}


def random_model(args) -> Transformer:
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=65536, rope_theta=100000.0)  # SmolLM2-135M's shape
    if args.tiny:
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=65536)
    torch.manual_seed(0)
    m = Transformer(cfg).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    return m


def timed_generate(model, prompts, params_list, **kw) -> dict:
    s = Sampler(model, **kw)
    s.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=1.0))  # warm-up
    t = time.perf_counter()
    for p, params in zip(prompts, params_list):
        s.submit(p, params)
    n = 0
    while s.has_work():
        n += sum(len(c.tokens) for c in s.step())
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {"tok_s": n / dt, "seconds": round(dt, 2), "tokens": n, "preemptions": s.stats["preemptions"],
            "kv_mb": round(s.cache.nbytes() / 2**20, 1), "rows_mean": round(s.stats["decode_tokens"] /
                                                                           max(1, s.stats["decode_steps"]), 1)}


def long_workload(model, args) -> dict:
    """(b)'s requests: lognormal lengths scaled by `--scale` (forced by max_new_tokens, no stop),
    random prompts, and the KV memory of `--static-batch` static slots in tokens (`kv/static_cache.py`:
    (slots + 1) prompt entries of the longest prompt, slots of prompt + cap)."""
    mean, cap = max(8, int(args.mean * args.scale)), max(16, int(args.cap * args.scale))
    lengths = lognormal_lengths(args.requests, mean, args.sigma, cap, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in lengths]
    L = args.prompt_len + cap
    return {"prompts": prompts, "params": [SamplingParams(max_new_tokens=n, temperature=1.0, seed=0) for n in lengths],
            "lengths": {"mean": mean, "cap": cap, "sigma": args.sigma, "requests": args.requests,
                        "prompt": args.prompt_len, "generated": sum(lengths)},
            "sizes": dict(max_seq_len=L, max_prompt_len=args.prompt_len),
            "kv_tokens": args.static_batch * L + (args.static_batch + 1) * args.prompt_len}


def sampler_at_equal_memory(model, args) -> dict:
    """(b): static slots vs the paged pool, same bytes, the same lognormal requests (scaled)."""
    w = long_workload(model, args)
    static_kw = dict(max_batch=args.static_batch, kv_layout="static", **w["sizes"])
    paged_kw = dict(max_batch=args.paged_batch, kv_tokens=w["kv_tokens"], **w["sizes"])
    runs = {"static": [], "paged": []}
    for _ in range(args.rounds):
        runs["static"].append(timed_generate(model, w["prompts"], w["params"], **static_kw))
        runs["paged"].append(timed_generate(model, w["prompts"], w["params"], **paged_kw))
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    return {"lengths": w["lengths"], "kv_tokens": w["kv_tokens"], "static": runs["static"][-1], "paged": runs["paged"][-1],
            "tok_s": {k: round(v, 1) for k, v in med.items()},
            "sampler_paged_over_static": round(med["paged"] / med["static"], 3)}


def page_ab(model, args) -> dict:
    """The sampler on (b)'s workload and pool at each page size of `--page-ab`, alternating rounds:
    how the page size is chosen per device (`kv_budget.PAGE_SIZE`)."""
    w = long_workload(model, args)
    sizes = [int(x) for x in args.page_ab.split(",")]
    runs = {p: [] for p in sizes}
    for _ in range(args.rounds):
        for p in sizes:
            runs[p].append(timed_generate(model, w["prompts"], w["params"], max_batch=args.paged_batch,
                                          kv_tokens=w["kv_tokens"], page_size=p, **w["sizes"]))
    return {"page_ab": {str(p): {"tok_s": round(statistics.median(r["tok_s"] for r in v), 1),
                                 "rows_mean": v[-1]["rows_mean"], "preemptions": v[-1]["preemptions"]}
                        for p, v in runs.items()}, "kv_tokens": w["kv_tokens"], "rounds": args.rounds,
            "device": args.device, "model": "tiny" if args.tiny else "smollm2-135m-shape (random)"}


def short_workloads(model, args) -> dict:
    """(d): paged vs static at the same slots on short requests, alternating; the worst ratio."""
    g = torch.Generator().manual_seed(2)
    shapes = {"gsm8k_like": (args.short_prompts, 150, 4, 128), "short_random": (args.short_prompts * 2, 24, 1, 32)}
    out = {}
    for name, (n_prompts, plen, n, new) in shapes.items():
        prompts = [torch.randint(3, model.cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(n_prompts)]
        params = [SamplingParams(max_new_tokens=new, temperature=0.7, n=n, seed=0)] * n_prompts
        kw = dict(max_batch=args.short_batch, max_seq_len=plen + new, max_prompt_len=plen)
        rates = {"static": [], "paged": []}
        for _ in range(args.rounds):
            for layout in ("static", "paged"):
                rates[layout].append(timed_generate(model, prompts, params, kv_layout=layout, **kw)["tok_s"])
        ratio = statistics.median(p / s for p, s in zip(rates["paged"], rates["static"]))
        out[name] = {"tok_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                     "paged_over_static": round(ratio, 3), "prompts": n_prompts, "n": n, "new": new}
    out["short_paged_over_static"] = min(v["paged_over_static"] for v in out.values())
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke runs)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mean", type=float, default=4096)
    ap.add_argument("--cap", type=int, default=32768)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=256, help="(a): prompt tokens per sample")
    ap.add_argument("--static-rows", type=int, default=8, help="(a): the static slots the KV memory buys")
    ap.add_argument("--page", type=int, default=0, help="tokens per page; 0 = the sampler's default for the device")
    ap.add_argument("--scale", type=float, default=None, help="(b): lengths x this (default: 1/16 on CPU, 1/4 on CUDA)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--static-batch", type=int, default=4)
    ap.add_argument("--paged-batch", type=int, default=64)
    ap.add_argument("--short-batch", type=int, default=16)
    ap.add_argument("--short-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip-trainer", action="store_true", help="leave out (c)")
    ap.add_argument("--page-ab", default=None, help="instead: (b)'s paged run at these page sizes, e.g. 16,64,256")
    args = ap.parse_args(argv)
    if args.scale is None:
        args.scale = 0.25 if args.device.startswith("cuda") else 1 / 16
    if args.quick:
        args.tiny, args.requests, args.short_prompts = True, 12, 3
    return args


def measure(args: argparse.Namespace) -> dict:
    """The JSON line's content (module docstring); `bench/gpu.py`'s "long" section calls this too."""
    cuda = args.device.startswith("cuda")
    page = args.page or PAGE_SIZE["cuda" if cuda else "cpu"]
    t0 = time.perf_counter()
    lengths = lognormal_lengths(4000 if not args.quick else 800, args.mean, args.sigma, args.cap)
    rows = rows_at_equal_memory(lengths, args.prompt, args.cap, args.static_rows * (args.prompt + args.cap), page)
    model = random_model(args)
    samp = sampler_at_equal_memory(model, args)
    short = short_workloads(model, args)
    del model
    train = {"packed_over_padded": None} if args.skip_trainer else trainer_packed_vs_padded(quick=args.quick)
    return {"rows_paged_over_static": rows["rows_paged_over_static"],
            "sampler_paged_over_static": samp["sampler_paged_over_static"],
            "trainer_packed_over_padded": train["packed_over_padded"],
            "short_paged_over_static": short["short_paged_over_static"],
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "page": page, "rows": rows, "sampler": samp, "short": short, "trainer": train,
            "model": "tiny" if args.tiny else "smollm2-135m-shape (random)", "dtype": args.dtype,
            "wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d"), "quick": args.quick}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(json.dumps(page_ab(random_model(args), args) if args.page_ab else measure(args)))


if __name__ == "__main__":
    main()
