"""`Linear`: nn.Linear whose CPU fp32 GEMMs can run on oneDNN instead of ATen's F.linear.

Whether they do is decided per machine by `common/engine/precision.py` (measured at start, `gemm`
auto|onednn|aten) and set in every process with `set_onednn`; the numbers below are from the
machine where oneDNN won. On an Intel Xeon (MKL takes its AVX-512 kernels there) F.linear won.

Every process uses it through `common/engine/model.py`: the generators' sampler, reference and eval
passes, and the trainer's forward and backward. Why: PyTorch's CPU `F.linear` calls MKL
sgemm, and MKL picks its AVX2 kernels on AMD CPUs even when they have AVX-512. oneDNN chooses kernels
by CPU feature flags, so on the AVX-512 dev box (AMD EPYC Zen 5) it runs 2.3x faster:
measured 1 thread, fp32, (128 x 576) @ (576 x 1536): 96 GFLOP/s through F.linear vs 222
GFLOP/s through oneDNN; the (576 x 49152) lm_head at one row, 7.3 ms vs 4.5 ms. Results are
ordinary fp32 (max error vs fp64 3e-6, same order as MKL's 1.4e-6); nothing is down-converted.

Also at one row (batch-1 decode), where the weights stream from DRAM: SmolLM2's 30 layers of
GEMVs take 27.3 ms through F.linear and 21.1 ms through oneDNN (20 GB/s vs 15.5 GB/s). (With
the matrix hot in cache, MKL's GEMV is the faster one, 19 vs 28 us at 576 x 576: a benchmark
that repeats one small matrix misleads here.)

Routing (`bench/sampler.py --ablate-onednn` prints the effect):
  - every CPU fp32 call with at least one row;
  - when a gradient is needed, through `_OneDNNLinear`, whose backward also runs its two GEMMs
    on oneDNN (oneDNN's op has no autograd formula of its own). A SmolLM2 forward + backward
    over 4 x 250 tokens: 9.3-10.7 s through F.linear, 5.8-6.5 s this way; gradients agree to
    6e-6 relative. Its backward makes transient contiguous copies of W^T, dY^T and X^T (for the
    lm_head dY^T is tokens x V floats, as big as the logits' gradient);
  - never on CUDA, for other dtypes (bf16 F.linear already runs on oneDNN), or under autocast
    (F.linear is where autocast casts to bf16; the oneDNN op has no autocast rule).
`set_onednn(False)` turns it off (for A/B benchmarks and bisecting numerical questions).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_enabled = _AVAILABLE


def set_onednn(enabled: bool) -> bool:
    """Route CPU fp32 GEMMs to oneDNN (True) or F.linear (False); returns the old setting."""
    global _enabled
    old, _enabled = _enabled, bool(enabled) and _AVAILABLE
    return old


def onednn_enabled() -> bool:
    return _enabled


def onednn_available() -> bool:
    return _AVAILABLE


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN x @ weight^T + bias: x (..., K), weight (N, K) -> (..., N)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with all three GEMMs on oneDNN: dX = dY W, dW = dY^T X, db = sum dY."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])  # (M, N)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm(gy, weight.t().contiguous())  # (..., K) = dY W
        if ctx.needs_input_grad[1]:
            gw = _mm(gy2.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous())  # (N, K) = dY^T X
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.sum(0)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x (..., K), weight (N, K) -> (..., N)."""
    if (_enabled and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel() > 0
            and not torch.is_autocast_enabled("cpu")):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return _OneDNNLinear.apply(x, weight, bias)
        return _mm(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) that calls `linear`."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
