"""The CPU fp32 causal attention kernel (common/engine/model/causal_attention.py) against a float64
reference written out from the definition, forward and backward, through both GEMM backends;
its custom ops' registration (torch.library.opcheck); and which path each input takes."""
import math

import pytest
import torch
import torch.nn.functional as F

from common.engine.model.causal_attention import _forward_op, causal_attention, set_kernel
from common.engine.model.linear import onednn_available, set_onednn


def _reference(q, k, v):
    """softmax(q k^T / sqrt(hd) + causal) v in float64, kv heads repeated per query head."""
    H, Hkv, T, hd = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k, v = (x.double().repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)  # (B, T, H, hd)


def _close(got, want, rel=3e-6):
    """Max |error| within `rel` of the tensor's largest entry: fp32 sums over T keys, as SDPA's
    own error against the same reference (measured 0.9-1.4e-6 of the largest entry for both)."""
    assert got.shape == want.shape
    err, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * max(scale, 1.0), (err, scale)


def _inputs(B, H, Hkv, T, hd, seed=0):
    """q/k/v as the model hands them over: (B, heads, T, hd) views of (B, T, heads, hd) memory."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, h, hd, generator=g).mul_(2).transpose(1, 2).requires_grad_() for h in (H, Hkv, Hkv)]


@pytest.mark.parametrize("onednn", [False, True] if onednn_available() else [False])
@pytest.mark.parametrize("B,H,Hkv,T,hd", [(2, 9, 3, 37, 64), (1, 4, 4, 16, 8), (3, 6, 2, 1, 16), (2, 8, 1, 64, 32)])
def test_matches_the_definition_forward_and_backward(B, H, Hkv, T, hd, onednn):
    old = set_onednn(onednn)
    try:
        q, k, v = _inputs(B, H, Hkv, T, hd)
        dy = torch.randn(B, T, H, hd, generator=torch.Generator().manual_seed(1))
        y = causal_attention(q, k, v)
        assert y.shape == (B, T, H, hd) and y.dtype == torch.float32 and y.is_contiguous()
        grads = torch.autograd.grad(y, (q, k, v), dy)
        ref = _reference(q, k, v)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dy.double())
        _close(y, ref)
        for got, want in zip(grads, ref_grads):
            _close(got, want)
    finally:
        set_onednn(old)


def test_the_switch_selects_sdpa_and_both_agree():
    q, k, v = _inputs(2, 6, 2, 20, 16)
    ours = causal_attention(q, k, v)
    assert "asyncrl_causal_attention" in type(ours.grad_fn).__name__
    old = set_kernel(False)
    try:
        sdpa = causal_attention(q, k, v)
    finally:
        set_kernel(old)
    assert torch.equal(sdpa, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2))
    _close(ours, sdpa.double())


def test_bf16_and_autocast_take_sdpa():
    q, k, v = _inputs(1, 4, 2, 8, 16)
    qb, kb, vb = (x.detach().bfloat16() for x in (q, k, v))
    want = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.equal(causal_attention(qb, kb, vb), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 inputs under autocast: SDPA decides the casts
        y = causal_attention(q, k, v)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert y.dtype == want.dtype and torch.equal(y, want)


def test_custom_ops_are_registered_correctly():
    """Schema, fake (meta) kernel and autograd registration as torch.compile relies on them."""
    q, k, v = (x.transpose(1, 2) for x in _inputs(2, 4, 2, 6, 8))
    torch.library.opcheck(_forward_op, (q, k, v))


def test_rows_past_the_score_budget_take_the_flash_kernel(monkeypatch):
    """A row whose (G*T x T) fp32 score block would pass MAX_SCORE_BYTES goes to SDPA (memory linear
    in T), the same attention; shorter rows keep the kernel."""
    import common.engine.model.causal_attention as ca
    calls = []
    real = ca._forward_op
    monkeypatch.setattr(ca, "_forward_op", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    monkeypatch.setattr(ca, "MAX_SCORE_BYTES", 4 * 3 * 40 * 40)  # G = 3: rows up to 40 tokens
    old = ca.set_kernel(True)
    try:
        g = torch.Generator().manual_seed(0)
        for T in (40, 41):
            q, k, v = torch.randn(1, 6, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
            torch.testing.assert_close(ca.causal_attention(q, k, v), want, atol=1e-5, rtol=1e-5)
    finally:
        ca.set_kernel(old)
    assert calls == [40]
