"""Log-probabilities from the output head without holding a (tokens x vocab) logits tensor.

Runs inside `Transformer.forward(tokens, targets=...)` (trainer, generators' reference pass,
evaluation). For n selected positions with hidden states h (n, D), head weight W (V, D) and
target ids y (n,):

    logp_i = z_i[y_i] - logsumexp(z_i),   z_i = (h_i W^T) / T      (fp32 from the GEMM's output)

Tokens are processed `chunk` at a time, so the forward holds one (chunk, V) block of logits.
The backward (the fused linear + cross-entropy idea) recomputes each chunk's logits and forms
dz = g * (onehot(y) - softmax(z)) / T, then dh = dz W and dW += dz^T h chunk by chunk. When all
n positions fit one chunk the softmax is kept from the forward instead (no recompute: the same
cost as an unchunked head, and the memory of one chunk).

Precision: the GEMMs run in `dtype` (the autocast dtype when autocast is on, as `F.linear` would;
else the weight's), logsumexp / softmax / gradients of z in fp32; dW is accumulated in fp32 and
returned in the weight's dtype (fp32 master weights receive fp32 gradients). CPU fp32 GEMMs go
through `common/engine/linear.py` (oneDNN where this machine measured it faster).
Shapes: n positions, D hidden, V vocab.
"""
from __future__ import annotations

import torch

from common.engine.linear import linear, onednn_enabled

LOGIT_BUDGET_BYTES = 512 * 2**20  # fp32 logits held at once: chunk = budget // (V * 4) positions


def default_chunk(vocab_size: int) -> int:
    return max(1, LOGIT_BUDGET_BYTES // (4 * vocab_size))


def _gemm_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


class _HeadLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int, dtype: torch.dtype, for_backward: bool):
        n = h.shape[0]
        w = weight.to(dtype)
        out = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        probs = None
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, n, chunk):
                z = linear(h[i:i + chunk].to(dtype), w).float()  # (c, V)
                if temperature != 1:
                    z = z / temperature
                lse[i:i + chunk] = torch.logsumexp(z, -1)
                out[i:i + chunk] = z.gather(-1, targets[i:i + chunk, None]).squeeze(-1) - lse[i:i + chunk]
                if n <= chunk and for_backward:  # one chunk: keep its softmax for backward (no-grad
                    probs = z.sub_(lse[:, None]).exp_()  # passes, e.g. reference log-probs, skip it)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.probs, ctx.temperature, ctx.chunk, ctx.dtype = probs, temperature, chunk, dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        h, weight, targets, lse = ctx.saved_tensors
        dt, T, chunk = ctx.dtype, ctx.temperature, ctx.chunk
        w = weight.to(dt)
        # dh = dz W and dW = dz^T h: cuBLAS and ATen's CPU fp32 GEMM (MKL) take the transposed
        # views as they are (and dW accumulates in place); oneDNN's op (`linear`, where this CPU
        # measured it faster) and CPU bf16 want contiguous operands, so W^T is copied once there
        views = w.is_cuda or (dt == torch.float32 and not onednn_enabled())
        w_t = None if views else w.t().contiguous()  # (D, V)
        gh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, h.shape[0], chunk):
                hc = h[i:i + chunk].to(dt)
                if ctx.probs is not None:
                    p = ctx.probs
                else:
                    z = linear(hc, w).float()
                    if T != 1:
                        z = z / T
                    p = z.sub_(lse[i:i + chunk, None]).exp_()  # softmax(z), (c, V)
                gc = g[i:i + chunk].float()
                # dlogp/dz = onehot(y) - softmax(z); times the incoming gradient and 1/T
                dz = p.mul_(-gc[:, None]).scatter_add_(-1, targets[i:i + chunk, None], gc[:, None])
                if T != 1:
                    dz = dz / T
                dz = dz.to(dt)
                if gh is not None:
                    gh[i:i + chunk] = (dz @ w if views else linear(dz, w_t)).to(h.dtype)  # (c, D)
                if gw is not None and views and dt == torch.float32:
                    gw.addmm_(dz.t(), hc)  # (V, D) += (V, c) @ (c, D)
                elif gw is not None:
                    gw += (dz.t() @ hc if views else linear(dz.t().contiguous(), hc.t().contiguous())).float()  # (V, D)
        ctx.probs = None
        return gh, (gw.to(weight.dtype) if gw is not None else None), None, None, None, None, None


def head_logp(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
              chunk: int | None = None) -> torch.Tensor:
    """log softmax(h W^T / T)[targets]: h (n, D), weight (V, D), targets (n,) int64 -> (n,) fp32.
    Differentiable in h and weight; `chunk` positions at a time (default: `default_chunk(V)`)."""
    if h.shape[0] == 0:
        return (h.sum(-1) + weight.sum() * 0).float()  # (0,), still connected to the graph
    chunk = chunk or default_chunk(weight.shape[0])
    for_backward = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _HeadLogp.apply(h, weight, targets, float(temperature), int(chunk), _gemm_dtype(h, weight), for_backward)
