"""The gated MLP and RMSNorm, forward and backward, elementwise work in cache-sized row blocks
(fp32 on CPU).

`common/engine/model/transformer.py` calls `mlp` and `rms_norm` in every process; this file's path runs for
fp32 CPU tensors outside torch.compile (a compiled block fuses the same work itself), the plain
expressions everywhere else (CUDA, bf16, autocast). Why: memory. Written as separate PyTorch
operations, their autograd keeps full-size intermediates for backward (silu(a) and h per MLP,
x r per RMSNorm); here only the inputs are kept and the backward recomputes the rest, each block
of rows going through every elementwise step while it is in cache, so the recomputation costs
no time (a training step's peak memory and speed: BENCHMARKS.md).

    MLP      y = h W_down^T,  h = silu(a) * b,  a = x W_gate^T,  b = x W_up^T,  silu(a) = a sigmoid(a)
             dh = dy W_down,  db = dh * silu(a),  da = silu'(a) (dh * b)   (silu's own backward)
             dW_gate = da^T x, dW_up = db^T x, dW_down = dy^T h,  dx = da W_gate + db W_up
    RMSNorm  y = w * x r,      r = 1 / sqrt(mean(x^2) + eps)   (per row; r saved, (rows, 1))
             dw = sum_rows(dy * x r),  dx = r (g - x r * mean(g * x r)),  g = dy * w
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from common.engine.model.linear import cpu_fp32, linear, linear_dw, linear_dx

_BLOCK = 1 << 16  # elements per row block and temporary (256 KB in fp32): several fit in L2
_enabled = True


def set_fused(enabled: bool) -> bool:
    """Run this file's blocked path where it applies (True) or always the plain expressions; returns the old setting."""
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    return old


def _fast_path(*xs: torch.Tensor) -> bool:
    return _enabled and cpu_fp32(*xs) and not torch.compiler.is_compiling()


def _blocks(n_rows: int, width: int):
    """Row ranges of about `_BLOCK` elements covering n_rows."""
    step = max(1, _BLOCK // max(width, 1))
    return ((r, min(r + step, n_rows)) for r in range(0, n_rows, step))


def activation(name: str):
    """The MLP activation a config names: silu, gelu (exact, erf) or gelu_tanh (GPT-2's gelu_new)."""
    if name == "gelu_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    return {"silu": F.silu, "gelu": F.gelu}[name]


def mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
        b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
        b_down: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """The gated MLP down(act(gate(x)) * up(x)); x (..., D), w_gate/w_up (I, D), w_down (D, I),
    optional biases (the blocked path is for SiLU and no biases)."""
    if act == "silu" and b_gate is None and b_up is None and b_down is None and _fast_path(x, w_gate, w_up, w_down):
        return _MLP.apply(x, w_gate, w_up, w_down)
    return linear(activation(act)(linear(x, w_gate, b_gate)) * linear(x, w_up, b_up), w_down, b_down)


def plain_mlp(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None, w_down: torch.Tensor,
              b_down: torch.Tensor | None, act: str) -> torch.Tensor:
    """The ungated MLP down(act(up(x))) of GPT-NeoX and GPT-2, as plain operations (no blocked
    path: one elementwise op between the GEMMs leaves little for it to save)."""
    return linear(activation(act)(linear(x, w_up, b_up)), w_down, b_down)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps); the reference normalises in fp32 and scales in x's dtype
    (as transformers does: it matters in bf16)."""
    if _fast_path(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        x2 = x.reshape(-1, x.shape[-1])                                    # (M, D)
        a, b = linear(x2, w_gate), linear(x2, w_up)                        # (M, I) each
        h = torch.empty_like(a)
        for r0, r1 in _blocks(*a.shape):
            torch.mul(F.silu(a[r0:r1]), b[r0:r1], out=h[r0:r1])
        ctx.save_for_backward(x2, a, b, w_gate, w_up, w_down)              # not h nor silu(a): recomputed
        ctx.shape = x.shape
        return linear(h, w_down).view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, a, b, w_gate, w_up, w_down = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])                                  # (M, D)
        dh = linear_dx(dy, w_down)                                         # (M, I)
        h, da, db = torch.empty_like(a), torch.empty_like(a), torch.empty_like(b)
        for r0, r1 in _blocks(*a.shape):
            ar, br, g = a[r0:r1], b[r0:r1], dh[r0:r1]
            s = F.silu(ar)
            torch.mul(s, br, out=h[r0:r1])
            torch.mul(g, s, out=db[r0:r1])
            torch.ops.aten.silu_backward.grad_input(g * br, ar, grad_input=da[r0:r1])
        del dh
        need = ctx.needs_input_grad  # a frozen base (LoRA elsewhere in the model) takes no weight gradient
        dw_down = linear_dw(dy, h) if need[3] else None
        del h
        dw_gate = linear_dw(da, x) if need[1] else None
        dw_up = linear_dw(db, x) if need[2] else None
        dx = linear_dx(da, w_gate).add_(linear_dx(db, w_up))
        return dx.view(ctx.shape), dw_gate, dw_up, dw_down


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1])                                    # (rows, D)
        y, r = torch.empty_like(x2), x2.new_empty(x2.shape[0], 1)
        for r0, r1 in _blocks(*x2.shape):
            xr = x2[r0:r1]
            torch.rsqrt(xr.pow(2).mean(-1, keepdim=True).add_(eps), out=r[r0:r1])
            torch.mul(xr * r[r0:r1], weight, out=y[r0:r1])
        ctx.save_for_backward(x2, weight, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        dy = dy.reshape(x.shape)
        dx = torch.empty_like(x)
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for r0, r1 in _blocks(*x.shape):
            xn = x[r0:r1] * r[r0:r1]                                       # x r
            g = dy[r0:r1] * weight
            if dw is not None:
                dw.add_((dy[r0:r1] * xn).sum(0))
            c = (g * xn).mean(-1, keepdim=True)
            torch.mul(g.sub_(xn.mul_(c)), r[r0:r1], out=dx[r0:r1])
        return dx.view(ctx.shape), dw, None
