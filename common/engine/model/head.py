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

Memory traffic, which is what the (n, V) elementwise work costs: the softmax runs in place, on
the CPU a few rows at a time (each block's max, exp and sum in cache: one read and one write of
the logits; on a GPU a chunk at once, `row_block`), is
left unnormalised (the division by the row sum joins the backward's one multiplication), and the
backward's GEMMs read dz and W through transposed views (`linear_dx`, `linear_dw`): no copies.

Precision: the GEMMs run in `dtype` (the autocast dtype when autocast is on, as `F.linear` would;
else the weight's), logsumexp / softmax / gradients of z in fp32; dW is accumulated in fp32 and
returned in the weight's dtype (fp32 master weights receive fp32 gradients). CPU fp32 GEMMs go
through `common/engine/model/linear.py` (oneDNN where this machine measured it faster).
Shapes: n positions, D hidden, V vocab.
"""
from __future__ import annotations

import torch

from common.engine.model.linear import linear, linear_dw, linear_dx

LOGIT_BUDGET_BYTES = 512 * 2**20  # fp32 logits held at once: chunk = budget // (V * 4) positions
_ROW_BLOCK_BYTES = 2 * 2**20  # logits one softmax step works on: a few rows, resident in cache


def default_chunk(vocab_size: int) -> int:
    return max(1, LOGIT_BUDGET_BYTES // (4 * vocab_size))


def _gemm_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


def row_block(n: int, V: int, device: torch.device) -> int:
    """Rows of logits per softmax step: a cache-sized block on the CPU; elsewhere the whole chunk
    (a GPU has no cache to fit, and each block costs ~10 kernel launches: with V = 49k, 2 MiB
    blocks of 10 rows made a training step's head thousands of launches)."""
    return max(1, _ROW_BLOCK_BYTES // (4 * V)) if torch.device(device).type == "cpu" else max(1, n)


def _exp_rows(z: torch.Tensor, targets: torch.Tensor, temperature: float, out: torch.Tensor,
              lse: torch.Tensor) -> torch.Tensor:
    """In place, a block of rows at a time (so every pass after a block's first read runs in
    cache): z <- exp(z / T - rowmax), the softmax up to each row's 1 / sum; writes the targets'
    log-probs into `out` and logsumexp(z / T) into `lse`; returns the rows' 1 / sum (c,)."""
    n, V = z.shape
    inv = torch.empty(n, dtype=torch.float32, device=z.device)
    rows = row_block(n, V, z.device)
    for r in range(0, n, rows):
        zb = z[r:r + rows]
        if temperature != 1:
            zb.div_(temperature)
        m = zb.amax(-1, keepdim=True)
        zy = zb.gather(-1, targets[r:r + rows, None])
        s = zb.sub_(m).exp_().sum(-1)  # one exp per logit; the division by s waits for the backward
        lse[r:r + rows] = m.squeeze(-1) + s.log()
        out[r:r + rows] = zy.squeeze(-1) - lse[r:r + rows]
        inv[r:r + rows] = s.reciprocal_()
    return inv


class _HeadLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int, dtype: torch.dtype, for_backward: bool):
        n = h.shape[0]
        w = weight.to(dtype)
        out = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        ctx.kept = None
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, n, chunk):
                z = linear(h[i:i + chunk].to(dtype), w).float()  # (c, V)
                inv = _exp_rows(z, targets[i:i + chunk], temperature, out[i:i + chunk], lse[i:i + chunk])
                if n <= chunk and for_backward:  # one chunk: keep its softmax for backward (no-grad
                    ctx.kept = (z, inv)  # passes, e.g. reference log-probs, skip it)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        h, weight, targets, lse = ctx.saved_tensors
        dt, T, chunk = ctx.dtype, ctx.temperature, ctx.chunk
        w = weight.to(dt)
        gh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        gw = None
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, h.shape[0], chunk):
                hc, y = h[i:i + chunk].to(dt), targets[i:i + chunk]
                if ctx.kept is not None:
                    e, inv = ctx.kept
                else:  # recompute this chunk's logits (the forward's log-probs are rewritten, unchanged)
                    e = linear(hc, w).float()
                    inv = _exp_rows(e, y, T, torch.empty_like(lse[i:i + chunk]), torch.empty_like(lse[i:i + chunk]))
                gc = g[i:i + chunk].float() / T
                # dlogp/dz = onehot(y) - softmax(z), times the incoming gradient and 1/T: one pass,
                # the softmax's division by the row sum folded into the same multiplication
                dz = e.mul_((-gc * inv)[:, None]).scatter_add_(-1, y[:, None], gc[:, None]).to(dt)  # (c, V)
                if gh is not None:
                    gh[i:i + chunk] = linear_dx(dz, w).to(h.dtype)  # (c, D) = (c, V) @ (V, D)
                if ctx.needs_input_grad[1]:
                    part = linear_dw(dz, hc).float()  # (V, D) = (V, c) @ (c, D), transposed views
                    gw = part if gw is None else gw.add_(part)
        ctx.kept = None
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
