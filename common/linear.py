"""`Linear`: nn.Linear whose CPU fp32 inference runs on oneDNN's GEMM instead of MKL's.

Every process uses it through `common/model.py` (generators' sampler, reference and eval
passes, the trainer's no-grad passes). Why: PyTorch's CPU `F.linear` calls MKL sgemm, and
MKL picks its AVX2 kernels on AMD CPUs even when they have AVX-512. oneDNN chooses kernels
by CPU feature flags, so on the AVX-512 dev box (AMD EPYC Zen 5) it runs 2.3x faster:
measured 1 thread, fp32, (128 x 576) @ (576 x 1536): 96 GFLOP/s through F.linear vs 222
GFLOP/s through oneDNN; the (576 x 49152) lm_head at one row, 7.3 ms vs 4.5 ms. Results are
ordinary fp32 (max error vs fp64 3e-6, same order as MKL's 1.4e-6); nothing is down-converted.

Routing rules (all measured, `bench/sampler.py` prints the effect):
  - only when no gradient is needed: oneDNN's op has no autograd kernel, so training
    forwards keep F.linear;
  - only for >= 4 rows or wide outputs (the lm_head): for 1-3 rows and small matrices MKL's
    GEMV is as fast or faster (576 x 576 at one row: 19 us vs 28 us);
  - never on CUDA or for other dtypes (F.linear is already the right kernel there).
`set_onednn(False)` turns it off (for A/B benchmarks and bisecting numerical questions).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_enabled = _AVAILABLE
MIN_ROWS = 4             # below this many rows MKL's GEMV is at least as fast (see above)
WIDE_OUT = 8192          # ... except for outputs this wide (the lm_head), where oneDNN wins at 1 row


def set_onednn(enabled: bool) -> bool:
    """Route CPU fp32 inference GEMMs to oneDNN (True) or F.linear (False); returns the old setting."""
    global _enabled
    old, _enabled = _enabled, bool(enabled) and _AVAILABLE
    return old


def onednn_enabled() -> bool:
    return _enabled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x (..., K), weight (N, K) -> (..., N)."""
    if _enabled and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        rows = x.numel() // x.shape[-1]
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias))
        if not needs_grad and rows > 0 and (rows >= MIN_ROWS or weight.shape[0] >= WIDE_OUT):
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) that calls `linear`."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
