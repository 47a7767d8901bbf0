"""Attention that also returns its log-sum-exp, and the merge of two partial attentions.

Used by the sampler's KV cache (`common/engine/kv_cache.py`, generator processes) to attend to a
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


def attend_lse_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_lse` from plain matmuls (CUDA and anything without the CPU kernel), captured into
    the sampler's CUDA graphs. Grouped-query attention without copying K/V per query head: the
    G = H / Hkv query heads that share a key/value head become G x Tq query rows against it.
    The GEMMs run in the inputs' dtype (bf16 on GPU) with fp32 accumulation; scores, softmax and
    lse are fp32 (scores are (Tq x Tk) per head, never a copy of the cache)."""
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * Tq, hd)                                  # heads h = j*G + g share kv head j
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * (hd ** -0.5)    # (B, Hkv, G*Tq, Tk)
    s = s.view(B, Hkv, G, Tq, Tk)
    if mask is not None:
        s = s + mask.float().unsqueeze(2)                               # (B|1, 1, 1, Tq, Tk) over the G heads
    if causal:
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)                                        # (B, Hkv, G, Tq)
    p = (s - lse.unsqueeze(-1)).exp().to(v.dtype).view(B, Hkv, G * Tq, Tk)
    out = torch.matmul(p, v).view(B, H, Tq, hd)                         # (B, Hkv, G*Tq, hd) -> (B, H, Tq, hd)
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
