"""The FLOP floor of one trainer micro-batch: the work counted from the shapes, and the time the
GEMMs alone take on this machine (shared by bench/trainer_floor.py and bench/trainer_step.py).

Work of a forward + backward over B rows x T tokens with n scored positions (the loss's
completion tokens), L layers, hidden D, heads H / Hkv of width hd, MLP width I, vocab V:
  linear     6 * (B*T) * L * (2*D*H*hd + 2*D*Hkv*hd + 3*D*I)   forward 2x, backward 4x (dX, dW)
  attention  7 * B * L * H * hd * T*(T+1)/2 * 2                  causal pairs only; forward QK^T and
                                                                PV, backward dV, dP, dQ, dK and the
                                                                recomputed QK^T (2 + 5 GEMMs)
  head       6 * n * D * V                                      on the scored positions only
The floor: every GEMM of the step timed alone at its own shape, on the faster of this machine's
two CPU fp32 GEMM backends (`common/engine/linear.py`), and the attention's FLOPs at the rate of
the fastest of those GEMMs. A step cannot beat it without fewer FLOPs or a faster GEMM; the
fraction reached (floor / measured) is what elementwise work, copies and the allocator cost.
Runs in the benchmark's own process, one thread.
"""
from __future__ import annotations

import time

import torch

from common.engine.linear import linear, onednn_available, set_onednn


def work_args(ap) -> None:
    """The trainer-step benchmarks' shared flags: the model and the work of one micro-batch."""
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)


def step_flops(cfg, rows: int, tokens: int, scored: int) -> dict[str, float]:
    """FLOPs of one forward + backward by part (module docstring); `cfg` a ModelConfig."""
    D, H, Hkv, hd, I, L = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.num_hidden_layers)
    M = rows * tokens
    pairs = rows * tokens * (tokens + 1) // 2
    return {"linear": 6.0 * M * L * (2 * D * H * hd + 2 * D * Hkv * hd + 3 * D * I),
            "attention": 7.0 * 2 * pairs * L * H * hd,
            "head": 6.0 * scored * D * cfg.vocab_size}


def _gemm_shapes(cfg, M: int, n: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """part -> [(m, k, nout, count)]: every GEMM of a step as linear(x (m, k), w (nout, k)),
    forward (x W^T), dX (dY W) and dW (dY^T X), `count` times each per step."""
    D, H, Hkv, hd, I, L, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size)
    lin = []
    for k, nout, count in [(D, H * hd, 1), (D, Hkv * hd, 2), (H * hd, D, 1), (D, I, 2), (I, D, 1)]:
        lin += [(M, k, nout, count * L), (M, nout, k, count * L), (nout, M, k, count * L)]
    return {"linear": lin, "head": [(n, D, V, 1), (n, V, D, 1), (V, n, D, 1)]}


def _time_gemm(m: int, k: int, nout: int, reps: int) -> float:
    """Best-of-`reps` seconds of linear(x (m, k), w (nout, k)) on the current backend."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(nout, k, generator=g)
    linear(x, w)  # warm-up: kernel creation
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        linear(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def gemm_floor(cfg, rows: int, tokens: int, scored: int, reps: int = 3) -> dict:
    """The floor of one forward + backward (module docstring): seconds by part, the total, the best
    GEMM rate seen (GFLOP/s) and which backend won each part. fp32, the current thread count."""
    flops = step_flops(cfg, rows, tokens, scored)
    backends = [True, False] if onednn_available() else [False]
    old = set_onednn(True)
    out, best_rate = {"parts_s": {}, "backend": {}}, 0.0
    try:
        for part, shapes in _gemm_shapes(cfg, rows * tokens, scored).items():
            per = {}
            for on in backends:
                set_onednn(on)
                s = 0.0
                for m, k, nout, count in shapes:
                    t = _time_gemm(m, k, nout, reps)
                    best_rate = max(best_rate, 2 * m * k * nout / t)
                    s += count * t
                per["onednn" if on else "aten"] = s
            win = min(per, key=per.get)
            out["parts_s"][part], out["backend"][part] = per[win], win
    finally:
        set_onednn(old)
    out["parts_s"]["attention"] = flops["attention"] / best_rate
    out["floor_s"] = sum(out["parts_s"].values())
    out["gemm_gflops_best"] = best_rate / 1e9
    out["tflop"] = sum(flops.values()) / 1e12
    out["flops"] = flops
    return out
