"""Attention that also returns its log-sum-exp, and the merge of two partial attentions.

Used by the sampler's KV cache (`common/engine/kv/static_cache.py`, generator processes) to attend to a
shared prompt and to a sample's own tokens separately and combine the two exactly
(the "cascade" / flash-decoding merge): for key sets A and B with softmax normalisers
lse_A, lse_B (log-sum-exp of the scaled scores),
    lse = logaddexp(lse_A, lse_B)
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B,
which equals attention over A u B.
Shapes: B batch, H query heads, Hkv key/value heads (H a multiple of Hkv), Tq queries,
Tk keys, hd head dim.
"""
from __future__ import annotations

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(hd) + mask) v and its log-sum-exp.

    q (B, H, Tq, hd), k/v (B, Hkv, Tk, hd) (grouped-query when Hkv < H), mask: additive float
    in q's dtype broadcastable to (B, 1, Tq, Tk), or None; causal: query i sees keys <= i
    (Tq == Tk). Returns out (B, H, Tq, hd) in q's dtype and lse (B, H, Tq) in fp32.
    Every query must see at least one key (an all -inf row gives NaN)."""
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        # PyTorch's CPU flash kernel (what F.scaled_dot_product_attention runs on CPU), called
        # directly because it also returns the log-sum-exp; it needs a float mask.
        out, lse = _CPU_FLASH(q, k, v, is_causal=causal, attn_mask=mask)
        return out, lse.float()
    return attend_lse_gqa(q, k, v, mask, causal)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (..., m, k) x (..., k, n) -> (..., m, n) in fp32 from inputs of any float dtype, with
    no rounding of the product to the inputs' dtype. On CUDA (and meta) one GEMM with fp32
    output (`bmm(..., out_dtype=float32)`: bf16 operands, fp32 accumulate and store, no fp32
    copy of the operands); elsewhere the operands are upcast (the CPU reaches this path only in
    tests, where it stands in for the GPU's numerics)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.matmul(a, b)
    if a.device.type == "cpu":
        return torch.matmul(a.float(), b.float())
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])  # (batch, m, k): views when a is contiguous
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])  # (batch, k, n): a transposed view stays one
    return torch.bmm(a3, b3, out_dtype=torch.float32).view(*batch, a.shape[-2], b.shape[-1])


def attend_lse_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_lse` from plain matmuls (CUDA and anything without the CPU kernel), captured into
    the sampler's CUDA graphs. Grouped-query attention without copying K/V per query head: the
    G = H / Hkv query heads that share a key/value head become G x Tq query rows against it.
    Both GEMMs take the inputs' dtype (bf16 on GPU) and return fp32 (`matmul_f32`), so scores,
    softmax, lse and the weighted sum are never rounded to bf16. As in flash attention, the
    probabilities enter the second GEMM unnormalised, exp(s - max) in v's dtype (the dominant
    one is exactly 1), and the fp32 result is divided by their fp32 sum. Scores are (Tq x Tk) per
    head, never a copy of the cache."""
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * Tq, hd)                                  # heads h = j*G + g share kv head j
    s = matmul_f32(qg, k.transpose(-1, -2)).mul_(hd ** -0.5)            # (B, Hkv, G*Tq, Tk) fp32
    s = s.view(B, Hkv, G, Tq, Tk)
    if mask is not None:
        s = s + mask.float().unsqueeze(2)                               # (B|1, 1, 1, Tq, Tk) over the G heads
    if causal:
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)                                        # (B, Hkv, G, Tq, 1)
    p = (s - m).exp_()                                                  # unnormalised, in (0, 1]: the max is exactly 1
    denom = p.sum(-1)                                                   # (B, Hkv, G, Tq)
    lse = m.squeeze(-1) + denom.log()
    pv = matmul_f32(p.to(v.dtype).view(B, Hkv, G * Tq, Tk), v)          # (B, Hkv, G*Tq, hd) fp32
    out = (pv.view(B, Hkv, G, Tq, hd) / denom.unsqueeze(-1)).view(B, H, Tq, hd).to(q.dtype)
    return out, lse.view(B, H, Tq)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the two partial results.
    out (..., hd), lse (...) -> (..., hd)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = (lse_a - lse).exp_().unsqueeze(-1)
    wb = (lse_b - lse).exp_().unsqueeze(-1)
    return (out_a.float() * wa + out_b.float() * wb).to(out_a.dtype)


def additive_mask(visible: torch.Tensor, dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive float mask (0 / -inf) in `dtype`."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
