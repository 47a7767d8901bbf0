"""`Linear`: nn.Linear whose CPU fp32 GEMMs can run on oneDNN instead of ATen's F.linear.

Every process uses it through `common/engine/model.py`: the generators' sampler, reference and
eval passes, and the trainer's forward and backward. Why it exists: PyTorch's CPU `F.linear`
calls MKL sgemm, and MKL may pick its AVX2 kernels on AMD CPUs that have AVX-512, while oneDNN
chooses kernels by CPU feature flags. Which one is faster depends on the machine, so
`common/engine/precision.py` measures both at start (`gemm` auto|onednn|aten) and every process
calls `set_onednn` with the choice (figures per machine: BENCHMARKS.md, "Precision per machine").
Results are ordinary fp32: nothing is down-converted. At one row (batch-1 decode) weights stream
from DRAM, so a benchmark that repeats one small, cache-hot matrix misleads.

Routing (`bench/sampler.py --ablate-onednn` prints the effect):
  - every CPU fp32 call with at least one row;
  - when a gradient is needed, through `_OneDNNLinear`, whose backward also runs its two GEMMs
    on oneDNN (oneDNN's op has no autograd formula of its own). Its backward makes transient
    contiguous copies of W^T, dY^T and X^T (for the lm_head dY^T is tokens x V floats, as big
    as the logits' gradient);
  - never on CUDA, for other dtypes (bf16 F.linear already runs on oneDNN), under autocast
    (F.linear is where autocast casts to bf16; the oneDNN op has no autocast rule), or inside
    torch.compile (`train.compile_blocks`: the custom backward does not trace; ATen's does).
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
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return _OneDNNLinear.apply(x, weight, bias)
        return _mm(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) that calls `linear`."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
