"""Causal grouped-query attention of a full pass, forward and backward, for fp32 on CPU.

`common/engine/model/transformer.py` calls `causal_attention` in every full causal pass (no KV cache): the
trainer's forward and backward, the generators' reference and evaluation passes. On CPU in fp32
it runs the kernel below unless `common/engine/machine/precision.py` measured PyTorch's CPU flash kernel
(what F.scaled_dot_product_attention runs) faster on this machine (`precision.attention`), or the
row is so long that its score block would pass `MAX_SCORE_BYTES`; everywhere else (CUDA, bf16,
autocast) it is F.scaled_dot_product_attention.

Why a kernel of our own: the flash kernel's softmax spends most of its time in exp. Here the
scores are formed in base 2 (q pre-multiplied by log2(e) / sqrt(hd)), and torch.exp2 runs
several times faster than torch.exp on CPU; the rest is plain GEMMs at the machine's GEMM rate.
One (batch row b, kv head j) block at a time: the G = H / Hkv query heads that share kv head j
become G*T query rows ordered (t, g), and their scores S (G*T x T, fp32) stay in cache.
    S2   = (q log2(e) / sqrt(hd)) k^T + mask          mask 0 where key <= query, else -inf
    lse2 = m + log2(sum_k exp2(S2 - m)),  m = max_k S2  (log-sum-exp in base 2)
    P    = exp2(S2 - lse2),  O = P v
The backward is flash attention's: P recomputed from the saved lse2, then
    dV = P^T dO,  dP = dO v^T,  dS = P * (dP - rowsum(dP * P))   (gradient of the natural-log scores)
    dQ = dS k / sqrt(hd),  dK = dS^T q / sqrt(hd)  (= dS^T q2 ln 2)
GEMMs go through `common/engine/model/linear.py` (oneDNN or ATen, as the machine chose) with every
operand contiguous or the transpose of a contiguous block: oneDNN is very slow on other strides.
Forward and backward are custom ops, so a compiled block (`train.compile_blocks`) keeps them whole.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.engine.model.linear import cpu_fp32, linear

_LOG2E = 1.0 / math.log(2.0)
_enabled = True
# a (G*T x T) fp32 score block above this many bytes goes to the flash kernel instead, whose memory
# grows with T, not T^2: one 16k-token row of the tiny model peaks at 9.6 GiB through the kernel and
# 1.5 GiB through SDPA (bench/_long_train.py); 256 MiB is T = 4,730 at G = 3 (SmolLM2-135M)
MAX_SCORE_BYTES = 256 * 2**20


def set_kernel(enabled: bool) -> bool:
    """Use the kernel below (True) or the CPU flash kernel (False) for fp32 on CPU; returns the old setting."""
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    return old


def kernel_enabled() -> bool:
    return _enabled


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + causal mask) v. q (B, H, T, hd), k/v (B, Hkv, T, hd) with H a
    multiple of Hkv, any strides -> (B, T, H, hd), contiguous on the kernel's path."""
    G, T = q.shape[1] // k.shape[1], q.shape[2]
    if _enabled and cpu_fp32(q, k, v) and 4 * G * T * T <= MAX_SCORE_BYTES:
        return _forward_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return y.transpose(1, 2)


def _rows(x: torch.Tensor, Hkv: int, scale: float | None = None) -> torch.Tensor:
    """(B, T, H, hd) -> (B, Hkv, T*G, hd) contiguous, the rows of kv head j ordered (t, g), times `scale`."""
    B, T, H, hd = x.shape
    out = x.new_empty(B, Hkv, T, H // Hkv, hd)
    src = x.view(B, T, Hkv, H // Hkv, hd).permute(0, 2, 1, 3, 4)  # (B, Hkv, T, G, hd) view
    out.copy_(src) if scale is None else torch.mul(src, scale, out=out)
    return out.view(B, Hkv, T * (H // Hkv), hd)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """(B, T, Hkv, hd) -> (B, Hkv, T, hd) contiguous: each (b, j) block a plain matrix for the GEMMs."""
    return x.transpose(1, 2).contiguous()


def _mask(T: int, device) -> torch.Tensor:
    """(T, 1, T) additive causal mask, 0 / -inf, broadcast over the G heads of a row."""
    hidden = torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)
    return torch.zeros(T, 1, T, device=device).masked_fill_(hidden.unsqueeze(1), float("-inf"))


@torch.library.custom_op("asyncrl::causal_attention", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, hd), k/v (B, T, Hkv, hd) -> out (B, T, H, hd), lse2 (B, Hkv, T*G, 1) fp32."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q2 = _rows(q, Hkv, _LOG2E / math.sqrt(hd))                  # (B, Hkv, T*G, hd)
    k, v = _heads(k), _heads(v)                                 # (B, Hkv, T, hd)
    out, lse = q.new_empty(B, T, H, hd), q.new_empty(B, Hkv, T * G, 1)
    mask = _mask(T, q.device)
    for b in range(B):
        for j in range(Hkv):
            s = linear(q2[b, j], k[b, j])                       # (T*G, T) scores S2
            s.view(T, G, T).add_(mask)
            m = s.amax(-1, keepdim=True)
            s.sub_(m).exp2_()                                   # unnormalised P, in cache
            denom = s.sum(-1, keepdim=True)
            o = linear(s, v[b, j].t())                          # (T*G, hd), unnormalised
            torch.div(o.view(T, G, hd), denom.view(T, G, 1), out=out[b, :, j * G:(j + 1) * G])
            torch.add(m, denom.log2_(), out=lse[b, j])
    return out, lse


@torch.library.custom_op("asyncrl::causal_attention_backward", mutates_args=())
def _backward_op(go: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dO (B, T, H, hd) and the forward's inputs and lse2 -> dq, dk, dv in the inputs' shapes."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    c = 1.0 / math.sqrt(hd)
    q2, go2 = _rows(q, Hkv, _LOG2E * c), _rows(go, Hkv)         # (B, Hkv, T*G, hd)
    kh, vh = _heads(k), _heads(v)                               # (B, Hkv, T, hd)
    dq, dk, dv = q.new_empty(B, T, H, hd), k.new_empty(B, T, Hkv, hd), v.new_empty(B, T, Hkv, hd)
    mask = _mask(T, q.device)
    for b in range(B):
        for j in range(Hkv):
            qb, kb, vb, gb = q2[b, j], kh[b, j], vh[b, j], go2[b, j]
            p = linear(qb, kb)                                  # (T*G, T) S2 again
            p.view(T, G, T).add_(mask)
            p.sub_(lse[b, j]).exp2_()                           # P, normalised
            dp = linear(gb, vb)                                 # (T*G, T)
            ds = torch._softmax_backward_data(dp, p, -1, torch.float32)  # P * (dP - rowsum(dP * P))
            dv[b, :, j].copy_(linear(gb.t(), p.t()).t())        # (P^T dO), formed as (dO^T P)^T: faster on oneDNN
            torch.mul(linear(ds, kb.t()).view(T, G, hd), c, out=dq[b, :, j * G:(j + 1) * G])
            torch.mul(linear(qb.t(), ds.t()).t(), math.log(2.0), out=dk[b, :, j])
    return dq, dk, dv


@_forward_op.register_fake
def _(q, k, v):
    B, T, H, hd = q.shape
    return q.new_empty(B, T, H, hd), q.new_empty(B, k.shape[2], T * (H // k.shape[2]), 1)


@_backward_op.register_fake
def _(go, q, k, v, lse):
    # contiguous, as the op allocates them (empty_like would copy the strides of a transposed q,
    # as partial rotary's concatenation produces)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _backward(ctx, go, _glse):
    q, k, v, lse = ctx.saved_tensors
    return _backward_op(go, q, k, v, lse)


_forward_op.register_autograd(_backward, setup_context=_setup)
