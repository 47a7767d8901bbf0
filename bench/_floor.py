"""The FLOP floor of one trainer micro-batch: the work counted from the shapes, and the time the
GEMMs alone take on this machine (shared by bench/trainer_floor.py and bench/trainer_step.py).

Work of a forward + backward over B rows x T tokens with n scored positions (the loss's
completion tokens), L layers, hidden D, heads H / Hkv of width hd, MLP width I, vocab V:
  linear     6 * (B*T) * L * (2*D*H*hd + 2*D*Hkv*hd + 3*D*I)   forward 2x, backward 4x (dX, dW)
  attention  7 * B * L * H * hd * T*(T+1)/2 * 2                  causal pairs only; forward QK^T and
                                                                PV, backward dV, dP, dQ, dK and the
                                                                recomputed QK^T (2 + 5 GEMMs)
  head       6 * n * D * V                                      on the scored positions only
The floor: every GEMM of the step timed alone at its own shape in `linear`'s layout (x W^T), on
the faster of this machine's two CPU fp32 GEMM backends (`common/engine/model/linear.py`) for each part,
and the attention's FLOPs at the rate of the fastest of those GEMMs. The backend the floor names
can differ from the step's: the step's dX and dW run as dY W and dY^T X, whose rates differ by
backend (BENCHMARKS.md, the AVX2 EPYC section). A step cannot beat it without fewer FLOPs or a faster GEMM; the
fraction reached (floor / measured) is what elementwise work, copies and the allocator cost.
Runs in the benchmark's own process, one thread.

`gemms_in_place(step)`: the other question, whether the step's GEMMs run at their own rate where
they stand (cold operands, the allocator, the layouts the step uses) or below it. One step runs
under a dispatch mode that times every GEMM call and runs the same call again at once on the same
operands (now warm in cache); the two times of each call are taken moments apart, so a machine
whose speed drifts over seconds (shared hosts: BENCHMARKS.md) cannot pass for a slow layout.
GEMMs inside the attention kernel are not seen (the floor counts attention apart).
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.engine.model.linear import linear, linear_dw, linear_dx, onednn_available, set_onednn
from common.engine.machine.cpu import backend_times


def work_args(ap) -> None:
    """The trainer-step benchmarks' shared flags: the model and the work of one micro-batch."""
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)


def step_flops(cfg, rows: int, tokens: int, scored: int, packed: tuple[int, int] | None = None) -> dict[str, float]:
    """FLOPs of one forward + backward by part (module docstring); `cfg` a ModelConfig. `packed`:
    (tokens run, attention pairs) of a packed micro-batch instead of rows x tokens in full."""
    D, H, Hkv, hd, I, L = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.num_hidden_layers)
    M, pairs = packed or (rows * tokens, rows * tokens * (tokens + 1) // 2)
    mlp = 3 if cfg.gated_mlp else 2  # gate, up, down; or up, down (GPT-NeoX, GPT-2)
    return {"linear": 6.0 * M * L * (2 * D * H * hd + 2 * D * Hkv * hd + mlp * D * I),
            "attention": 7.0 * 2 * pairs * L * H * hd,
            "head": 6.0 * scored * D * cfg.vocab_size}


def _weights(cfg, M: int, n: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """part -> [(m, k, nout, count)]: every weight's forward GEMM of a step as linear(x (m, k),
    w (nout, k)), `count` such weights per step."""
    D, H, Hkv, hd, I, L, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size)
    up = 2 if cfg.gated_mlp else 1  # gate and up, or up alone (GPT-NeoX, GPT-2)
    lin = [(M, k, nout, count * L) for k, nout, count in [(D, H * hd, 1), (D, Hkv * hd, 2), (H * hd, D, 1),
                                                          (D, I, up), (I, D, 1)]]
    return {"linear": lin, "head": [(n, D, V, 1)]}


def _gemm_shapes(cfg, M: int, n: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """part -> [(m, k, nout, count)]: every GEMM of a step as linear(x (m, k), w (nout, k)),
    forward (x W^T), dX (dY W) and dW (dY^T X), `count` times each per step."""
    return {part: [s for m, k, nout, c in ws for s in ((m, k, nout, c), (m, nout, k, c), (nout, m, k, c))]
            for part, ws in _weights(cfg, M, n).items()}


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


def gemm_floor(cfg, rows: int, tokens: int, scored: int, reps: int = 3, packed: tuple[int, int] | None = None) -> dict:
    """The floor of one forward + backward (module docstring): seconds by part, the total, the best
    GEMM rate seen (GFLOP/s) and which backend won each part. fp32, the current thread count.
    `packed` (tokens run, attention pairs): the floor of a packed micro-batch's work instead."""
    flops = step_flops(cfg, rows, tokens, scored, packed)
    backends = [True, False] if onednn_available() else [False]
    old = set_onednn(True)
    out, best_rate = {"parts_s": {}, "backend": {}}, 0.0
    try:
        for part, shapes in _gemm_shapes(cfg, packed[0] if packed else rows * tokens, scored).items():
            per = {"onednn" if on else "aten": 0.0 for on in backends}
            for m, k, nout, count in shapes:
                for on in backends:  # both backends at one shape moments apart: drift hits them alike
                    set_onednn(on)
                    t = _time_gemm(m, k, nout, reps)
                    best_rate = max(best_rate, 2 * m * k * nout / t)
                    per["onednn" if on else "aten"] += count * t
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


def backend_ab(cfg, rows: int, tokens: int, scored: int, pairs: int = 7) -> dict:
    """The step's GEMMs in the layouts the step runs them (forward x W^T through `linear`, dX = dY W
    through `linear_dx`, dW = dY^T X through `linear_dw`), oneDNN and ATen alternating call by
    call, `pairs` times each: seconds per step on each backend (medians times counts), and the
    median per-call ratio for each GEMM. What the floor's forward-layout timing cannot say: which
    backend the step itself should run. Needs oneDNN."""
    if not onednn_available():
        raise RuntimeError("backend_ab: this PyTorch has no oneDNN linear (nothing to compare)")
    g = torch.Generator().manual_seed(0)
    total, by_gemm = {"onednn": 0.0, "aten": 0.0}, {}
    for part, ws in _weights(cfg, rows * tokens, scored).items():
        for i, (m, k, nout, count) in enumerate(ws):
            x, w, dy = (torch.randn(*s, generator=g) for s in ((m, k), (nout, k), (m, nout)))
            for name, fn in (("fwd", lambda: linear(x, w)), ("dx", lambda: linear_dx(dy, w)),
                             ("dw", lambda: linear_dw(dy, x))):
                t = backend_times(fn, pairs)
                total["onednn"] += count * statistics.median(t[True])
                total["aten"] += count * statistics.median(t[False])
                by_gemm[f"{part}[{i}] {m}x{k}->{nout} {name}"] = _sig(statistics.median(
                    [a / b for a, b in zip(t[True], t[False])]))
    return {"onednn_s": _sig(total["onednn"]), "aten_s": _sig(total["aten"]),
            "onednn_over_aten": _sig(total["onednn"] / total["aten"]), "by_gemm_onednn_over_aten": by_gemm}


def _sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits: a small model's GEMMs on a fast backend (AMX) take under
    half a millisecond per step, which rounding to 3 decimals would report as 0.0 seconds."""
    return float(f"{x:.{digits}g}")


def frac_of_floor(floors: list[dict], times: list[float]) -> float:
    """The median over reps of each rep's floor / step seconds: `floors[i]` (a `gemm_floor` result)
    measured beside `times[i]`, so a machine whose speed drifts between reps moves both alike."""
    return statistics.median(f["floor_s"] / t for f, t in zip(floors, times, strict=True))


def _gemm_flops(func, args) -> float | None:
    """FLOPs of one GEMM call, or None if `func` is not one of the step's GEMMs (functional overloads
    only: an in-place or out= GEMM run twice would change its result)."""
    name, t = func.name(), [a for a in args if torch.is_tensor(a)]
    if name in ("aten::mm", "aten::bmm") and func._overloadname == "default":
        return 2.0 * t[0].numel() * t[1].shape[-1]                   # (.., m, k) @ (.., k, n)
    if name == "aten::addmm" and func._overloadname == "default":
        return 2.0 * t[1].numel() * t[2].shape[-1]
    if name in ("mkldnn::_linear_pointwise", "asyncrl::onednn_linear"):
        return 2.0 * t[0].numel() * t[1].shape[0]                    # x (.., K), w (N, K)
    if name == "asyncrl::onednn_linear_dx":
        return 2.0 * t[0].numel() * t[1].shape[1]                    # dY (.., N), W (N, K)
    if name == "asyncrl::onednn_linear_dw":
        return 2.0 * t[0].numel() * t[1].shape[-1]                   # dY (.., N), X (.., K)
    return None


class _GemmTimer(TorchDispatchMode):
    """Times each GEMM call, then runs it again at once (`gemms_in_place`)."""
    def __init__(self):
        super().__init__()
        self.by_shape = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # key -> [calls, in place s, again s, FLOPs]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flops = _gemm_flops(func, args)
        if flops is None:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        t1 = time.perf_counter()
        func(*args, **kwargs)
        t2 = time.perf_counter()
        ts = [a for a in args if torch.is_tensor(a)]
        key = (func.name(), tuple(tuple(a.shape) for a in ts), tuple(tuple(a.stride()) for a in ts))
        rec = self.by_shape[key]
        rec[0] += 1
        rec[1] += t1 - t0
        rec[2] += t2 - t1
        rec[3] += flops
        return out


def gemms_in_place(step, top: int = 12) -> dict:
    """Run `step()` once with every GEMM timed where it stands and again at once (module docstring).
    Returns the totals (s, FLOPs), in_place / again, and the `top` shapes by time, each as
    [op, shapes, strides, calls, in place s, again s, GFLOP/s in place]."""
    timer = _GemmTimer()
    with timer:
        step()
    recs = sorted(timer.by_shape.items(), key=lambda kv: -kv[1][1])
    in_place, again = sum(r[1] for _, r in recs), sum(r[2] for _, r in recs)
    return {"in_place_s": in_place, "again_s": again, "in_place_over_again": in_place / max(again, 1e-12),
            "flops": sum(r[3] for _, r in recs), "calls": sum(r[0] for _, r in recs),
            "by_shape": [[k[0], k[1], k[2], r[0], round(r[1], 3), round(r[2], 3), round(r[3] / r[1] / 1e9, 1)]
                         for k, r in recs[:top]]}
