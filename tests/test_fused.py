"""The blocked MLP and RMSNorm (common/engine/model/fused.py) against their plain PyTorch expressions
in float64, forward and backward, with row counts that leave a partial last block; the paths
other inputs take; and what the blocked path saves for backward."""
import pytest
import torch
import torch.nn.functional as F

import common.engine.model.fused as fused
from common.engine.model.fused import mlp, rms_norm, set_fused
from common.engine.model.linear import linear, onednn_available, set_onednn


def _mlp_ref(x, wg, wu, wd):
    return F.silu(x @ wg.t()) * (x @ wu.t()) @ wd.t()


def _rms_ref(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _check(fn, ref, inputs, dy, rtol):
    """fn in fp32 vs ref in fp64 on the same values: output and every input's gradient."""
    y = fn(*inputs)
    grads = torch.autograd.grad(y, inputs, dy)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    y_ref = ref(*ref_in)
    ref_grads = torch.autograd.grad(y_ref, ref_in, dy.double())
    for got, want in [(y, y_ref), *zip(grads, ref_grads)]:
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.fixture(params=[False, True] if onednn_available() else [False], ids=lambda on: "onednn" if on else "aten")
def gemm(request, monkeypatch):
    old = set_onednn(request.param)
    monkeypatch.setattr(fused, "_BLOCK", 64)  # many row blocks even at these sizes, the last one partial
    yield
    set_onednn(old)


@pytest.mark.parametrize("lead", [(3, 7), (1,), (2, 1)])
def test_mlp_matches_the_plain_expression(gemm, lead):
    x, wg, wu, wd = _leaves((*lead, 12), (20, 12), (20, 12), (12, 20))
    dy = torch.randn(*lead, 12)
    _check(mlp, lambda x, wg, wu, wd: _mlp_ref(x, wg, wu, wd), [x, wg, wu, wd], dy, rtol=2e-6)


@pytest.mark.parametrize("lead", [(3, 7), (1,), (5, 2)])
def test_rms_norm_matches_the_plain_expression(gemm, lead):
    x, w = _leaves((*lead, 24), (24,))
    dy = torch.randn(*lead, 24)
    _check(lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: _rms_ref(x, w, 1e-5), [x, w], dy, rtol=2e-6)


def test_the_blocked_path_runs_and_keeps_fewer_tensors_for_backward(gemm):
    x, wg, wu, wd = _leaves((4, 10, 12), (32, 12), (32, 12), (12, 32))

    def saved_bytes(enabled):
        old, seen = set_fused(enabled), {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = rms_norm(mlp(x, wg, wu, wd), wd[:, 0], 1e-5)
        finally:
            set_fused(old)
        return y, sum(seen.values()), type(y.grad_fn).__name__

    y_fused, fused_bytes, fused_fn = saved_bytes(True)
    y_plain, plain_bytes, plain_fn = saved_bytes(False)
    assert fused_fn == "_RMSNormBackward" and plain_fn != fused_fn
    assert torch.equal(y_fused, y_plain)  # the forward is the same arithmetic, block by block
    act = 4 * 10 * 32 * 4  # one (rows x I) fp32 activation
    assert plain_bytes - fused_bytes >= 2 * act  # silu(a) and h (MLP) are not kept


def test_bf16_and_autocast_take_the_plain_expressions():
    x, wg, wu, wd = (t.detach() for t in _leaves((2, 3, 8), (16, 8), (16, 8), (8, 16)))
    xb, wgb, wub, wdb = (t.bfloat16() for t in (x, wg, wu, wd))
    assert torch.equal(mlp(xb, wgb, wub, wdb), F.linear(F.silu(F.linear(xb, wgb)) * F.linear(xb, wub), wdb))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x, wg, wu, wd)
        want = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    w = torch.randn(8)
    assert torch.equal(rms_norm(xb, w, 1e-5), w * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True)
                                                                                 + 1e-5)).bfloat16())


def test_biases_take_the_plain_expression():
    x, wg, wu, wd = (t.detach() for t in _leaves((2, 3, 8), (16, 8), (16, 8), (8, 16)))
    bg, bu, bd = torch.randn(16), torch.randn(16), torch.randn(8)
    y = mlp(x, wg, wu, wd, bg, bu, bd)  # as the model's Linear modules compute it (common/engine/model/linear.py)
    assert torch.equal(y, linear(F.silu(linear(x, wg, bg)) * linear(x, wu, bu), wd, bd))
