"""The trainer on long, uneven completions: a micro-batch's rows packed end to end
(`train.pack_rows`, common/engine/model/packing.py) against right-padded rows, and the attention
candidates the packed pass was picked from. Functions for `bench/long_outputs.py` to call; one
process, one CPU thread, fp32 (the GEMM backend and attention kernel this machine's precision
picks), a small random Llama (`SHAPE`: the body dominates per token, as in a real model; the
tiny model's 49k x 64 head would hide the padding).

    trainer_packed_vs_padded(quick)  tokens/s of one TBA backward (`TBA.backward`: micro-batches
                                     under `train.micro_batch_tokens`, forward, loss, backward,
                                     what the trainer runs per minibatch less the optimizer
                                     step) on a long-tail batch (lognormal completion lengths),
                                     padded / prompts shared (today's CPU default without
                                     packing) / packed, alternating, medians
    trainer_even_rows(quick)         the same on GSM8K-like groups of 8 even short samples
    attention_candidates(quick)      causal attention forward + backward over uneven rows:
                                     per-row slices (our kernel, SDPA), the padded kernel, one
                                     SDPA with a block-diagonal mask (FlexAttention: no CPU
                                     backward in torch 2.13)
    row_memory(tokens)               peak RSS of training one row of `tokens` tokens on the tiny
                                     model (`--model=tiny`), chunked head, with and without
                                     activation checkpointing, each in a fresh process

Memory of one 16k-token row (`row_memory(16384)`: tiny model, fp32, one thread, forward +
backward, peak RSS; 2-core AMD EPYC with AVX-512, torch 2.13):
    attention through our kernel (`precision.attention=kernel`, what `auto` picks there at one
    thread from its 200-token measurement)      9.6 GiB, 43.5 s; checkpointed 9.6 GiB, 52.9 s
    through SDPA (`precision.attention=sdpa`)   1.54 GiB, 11.5 s; checkpointed 1.48 GiB, 12.6 s
The kernel's peak is its attention, not the activations: a (G*T x T) fp32 score block per
key/value head (2 GiB at T = 16k, G = 2; forward's P, backward's P, dP, dS) and a (T x T) additive
mask (1 GiB), which activation checkpointing (`train.activation_checkpointing`) cannot free and
the chunked head (512 MiB of logits at a time, common/engine/model/head.py) does not touch. SDPA's
flash kernel tiles; there it is also faster than ours on one row of 512 tokens (1.2x), 1k (1.6x),
4k (2.5x) (4 query / 2 key-value heads of 64, forward + backward).

Measured there (python -m bench._long_train, 2 min 9 s): 12 rows, 17,172 tokens (49,728 padded),
packed 2,482 tokens/s, padded 1,112, prompts shared 900: packed 2.23x padded (2.15x with
precision.attention=sdpa: 2,726 vs 1,266). `--even` (32 rows of ~350 tokens, groups of 8, 20 s):
packed 6,757, padded 5,144, shared 6,941 tokens/s (packing defers to prompt sharing there).
Equal rows with nothing to share (16 x 450 tokens): packed ~1-5% slower than padded.
Estimated, not measured, for SmolLM2-135M (d 576, 30 layers): ~1.4 MB of saved activations per
token, ~23 GiB for 16k tokens without checkpointing, ~2 GiB with it.
"""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from common.contracts.batch import Trajectory, collate
from common.engine.model.causal_attention import causal_attention
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.transformer import Transformer
from common.engine.model.model_config import ModelConfig
from common.engine.machine.precision import PrecisionConfig, cpu_info, resolve
from common.engine.checkpoints.tiny_model import BASE
from common.contracts.ops import token_logp
from common.runtime.process import set_process_defaults
from tba.algo import TBA, TBAConfig

# a small random Llama: 4 layers of width 256 (3.1M body parameters), vocab 4096 (1M head)
SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 32768}
# groups x k rows, completions lognormal(sigma) of mean `mean` capped at `cap`, prompts in `prompt`,
# micro_batch_tokens `budget`, timed rounds `reps`
DEFAULT = dict(groups=3, k=4, mean=1000, sigma=1.0, cap=4000, prompt=(100, 300), budget=8192, reps=3)
QUICK = dict(groups=2, k=4, mean=400, sigma=1.0, cap=1500, prompt=(50, 100), budget=4096, reps=2)
# where padding drops little: GSM8K-like groups of 8 even samples of one prompt
EVEN = dict(groups=4, k=8, mean=200, sigma=0.1, cap=400, prompt=(100, 200), budget=8192, reps=3)


def small_llama(seed: int = 0) -> Transformer:
    """`SHAPE` on SmolLM2's architecture, weights N(0, 0.02) (norms 1), fp32, training mode."""
    cfg = {**BASE, **SHAPE}
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        model = Transformer(ModelConfig.from_hf(cfg), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    model.tie_weights()
    return model.train()


def long_tail_batch(groups: int, k: int, mean: int, cap: int, prompt: tuple[int, int], vocab: int,
                    sigma: float = 1.0, seed: int = 0):
    """`groups` prompts x `k` samples; completion lengths lognormal (`sigma`, mean `mean`) in
    [1, cap], prompts uniform in `prompt`. Returns (Batch, completion lengths)."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    trajs, lens = [], []
    for gid in range(groups):
        p = torch.randint(3, vocab, (int(torch.randint(*prompt, (1,), generator=g)),), generator=g)
        for _ in range(k):
            c = int(min(cap, max(1, round(math.exp(mu + sigma * float(torch.randn(1, generator=g)))))))
            lens.append(c)
            trajs.append(Trajectory(p, torch.randint(3, vocab, (c,), generator=g), -torch.rand(c, generator=g),
                                    torch.zeros(c, dtype=torch.long), float(torch.rand(1, generator=g)), gid,
                                    ref_seq_logp=-float(c)))
    return collate(trajs), lens


def _set(model, mode: str) -> None:
    """padded: neither packing; shared: prompt sharing only (the CPU default before pack_rows);
    packed: `train.pack_rows` (prompt sharing where it beats it)."""
    model.share_prompts, model.pack_rows = mode != "padded", mode == "packed"


def trainer_packed_vs_padded(quick: bool) -> dict:
    """Tokens/s of the trainer's backward on a long-tail batch, padded vs packed (module docstring)."""
    return _compare(QUICK if quick else DEFAULT)


def trainer_even_rows(quick: bool) -> dict:
    """The same on groups of even short samples (`EVEN`), where padding drops little and prompt
    sharing wins: what pack_rows costs there."""
    return _compare(dict(EVEN, groups=2, reps=2) if quick else EVEN)


def _compare(c: dict) -> dict:
    """padded / shared / packed tokens/s of `TBA.backward` on the batch `c` describes."""
    threads = torch.get_num_threads()
    set_process_defaults("cpu")  # as the trainer's process: one thread, freed memory kept
    torch.set_num_threads(1)
    prec = resolve(PrecisionConfig(dtype="fp32"), "cpu").apply()
    try:
        model = small_llama()
        batch, lens = long_tail_batch(c["groups"], c["k"], c["mean"], c["cap"], c["prompt"], SHAPE["vocab_size"], c["sigma"])
        warm = long_tail_batch(2, 2, 100, 300, (20, 40), SHAPE["vocab_size"])[0]
        algo = TBA(TBAConfig(), c["groups"], c["k"], 1.0, c["budget"])
        tokens = int((batch.prompt_lens + batch.comp_lens).sum())
        modes = ("padded", "shared", "packed")
        times: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(c["reps"] + 1):  # round 0 warms up, on a small batch
            for m in modes if rep % 2 == 0 else modes[::-1]:
                _set(model, m)
                model.zero_grad(set_to_none=True)
                t = time.perf_counter()
                algo.backward(model, batch if rep else warm, 0)
                if rep:
                    times[m].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    s = {m: statistics.median(v) for m, v in times.items()}
    return {"tokens_s_packed": tokens / s["packed"], "tokens_s_padded": tokens / s["padded"],
            "tokens_s_shared_prompts": tokens / s["shared"], "packed_over_padded": s["padded"] / s["packed"],
            "packed_over_shared_prompts": s["shared"] / s["packed"], "rows": len(lens), "tokens": tokens,
            "padded_tokens": len(lens) * int(batch.tokens.shape[1]),
            "lengths": (f"{c['groups']} prompts of {c['prompt'][0]}-{c['prompt'][1]} tokens x {c['k']} completions, "
                        f"lognormal(sigma {c['sigma']:g}) mean {c['mean']} capped at {c['cap']}: min {min(lens)}, median "
                        f"{int(statistics.median(lens))}, max {max(lens)}"),
            "step_s": s, "reps": c["reps"], "micro_batch_tokens": c["budget"], "algorithm": "TBA.backward",
            "model": SHAPE, "dtype": "fp32", "gemm": prec.gemm, "attention": prec.attention, "threads": 1,
            "cpu": cpu_info()["model"]}


def attention_candidates(quick: bool) -> dict:
    """ms of causal attention forward + backward over uneven rows packed into (1, H, N, hd), by
    candidate (module docstring), one thread, fp32, 4 query / 2 key-value heads of 64."""
    lengths = [300, 50, 80, 120, 20, 200, 40, 90] if quick else [3000, 500, 800, 1200, 200, 2000, 400, 900]
    H, Hkv, hd, R, T, N = 4, 2, 64, len(lengths), max(lengths), sum(lengths)
    cu = [sum(lengths[:i]) for i in range(R + 1)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, N, hd, generator=g).requires_grad_() for h in (H, Hkv, Hkv))
    doc = torch.repeat_interleave(torch.arange(R), torch.tensor(lengths))
    idx = torch.arange(N)
    pad = torch.zeros(R, T, dtype=torch.long)
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    pad[valid] = idx

    def rows_kernel(q, k, v):
        return torch.cat([causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cu, cu[1:])], 1)

    def rows_sdpa(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                         enable_gqa=True).transpose(1, 2) for a, b in zip(cu, cu[1:])], 1)

    def padded_kernel(q, k, v):
        y = causal_attention(*(x[0][:, pad].transpose(0, 1) for x in (q, k, v)))  # (R, T, H, hd)
        return y[valid][None]

    def block_diagonal_sdpa(q, k, v):
        m = (doc[:, None] == doc[None]) & (idx[:, None] >= idx[None])           # (N, N)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).transpose(1, 2)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    prec = resolve(PrecisionConfig(dtype="fp32"), "cpu").apply()
    out: dict = {"lengths": lengths, "heads": [H, Hkv, hd], "machine_attention": prec.attention,
                 "flex_attention": "not a candidate: no backward on CPU (torch 2.13)", "cpu": cpu_info()["model"]}
    try:
        for name, f in {"rows_kernel": rows_kernel, "rows_sdpa": rows_sdpa, "padded_kernel": padded_kernel,
                        "block_diagonal_sdpa": block_diagonal_sdpa}.items():
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                f(q, k, v).square().sum().backward()
                ts.append(time.perf_counter() - t)
            out[f"{name}_ms"] = 1e3 * statistics.median(ts[1:])
    finally:
        torch.set_num_threads(threads)
    return out


def _one_row(tokens: int, checkpointing: bool, attention: str) -> dict:
    """In a fresh process: one training pass (forward, backward) of one `tokens`-token row on the
    tiny model, loss on all but the first 100 tokens, attention `attention` (kernel | sdpa); its
    peak RSS."""
    torch.set_num_threads(1)
    resolve(PrecisionConfig(dtype="fp32", attention=attention), "cpu").apply()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = load_model("tiny", tokenizer=False)[0].float().train()
    model.checkpoint_layers, model.pack_rows = checkpointing, True
    x = torch.randint(3, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[:, :100] = False
    t = time.perf_counter()
    lp = token_logp(model, x, 1.0, mask)
    (-(lp * mask).sum() / mask.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_rss_gib": peak / 2**20, "before_model_gib": base / 2**20, "pass_s": time.perf_counter() - t}


def row_memory(tokens: int = 16384) -> dict:
    """Peak RSS of training one `tokens`-token row on the tiny model, without and with activation
    checkpointing, through our attention kernel and SDPA, each in a fresh process (module docstring)."""
    out = {"tokens": tokens, "model": "tiny (d64 x 2 layers, vocab 49152)", "dtype": "fp32", "threads": 1}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for attention in ("kernel", "sdpa"):
        for ckpt in (False, True):
            code = f"import json, bench._long_train as b; print(json.dumps(b._one_row({tokens}, {ckpt}, {attention!r})))"
            r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"row_memory child failed:\n{r.stderr[-2000:]}")
            out[f"{attention}_{'checkpointed' if ckpt else 'plain'}"] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


if __name__ == "__main__":  # python -m bench._long_train [--quick] [--even | --attention | --memory]
    quick = "--quick" in sys.argv
    what = {"--attention": lambda: attention_candidates(quick), "--memory": row_memory,
            "--even": lambda: trainer_even_rows(quick)}
    fn = next((f for a, f in what.items() if a in sys.argv), lambda: trainer_packed_vs_padded(quick))
    print(json.dumps(fn()))
