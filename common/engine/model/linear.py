"""`Linear`: nn.Linear whose CPU fp32 GEMMs can run on oneDNN instead of ATen's F.linear.

Every process uses it through `common/engine/model/transformer.py`: the generators' sampler, reference and
eval passes, and the trainer's forward and backward. Why it exists: PyTorch's CPU `F.linear`
calls MKL sgemm, and MKL may pick its AVX2 kernels on AMD CPUs that have AVX-512, while oneDNN
chooses kernels by CPU feature flags. Which one is faster depends on the machine, so
`common/engine/machine/precision.py` measures both at start on the trainer's GEMMs (`gemm` auto|onednn|aten;
`common/engine/machine/cpu.py`) and every process
calls `set_onednn` with the choice (figures per machine: BENCHMARKS.md, "Precision per machine").
Results are ordinary fp32: nothing is down-converted. At one row (batch-1 decode) weights stream
from DRAM, so a benchmark that repeats one small, cache-hot matrix misleads.

Routing (`bench/sampler.py --ablate-onednn` prints the effect):
  - every CPU fp32 call with at least one row;
  - when a gradient is needed, and inside torch.compile (`train.compile_blocks`), through the
    custom op `asyncrl::onednn_linear`, whose backward runs its two GEMMs on oneDNN too (oneDNN's
    op has no autograd formula of its own), on transposed views of W, dY and X (no copies);
    compile sees the three as opaque ops, so a compiled block keeps oneDNN's GEMMs;
  - never on CUDA, for other dtypes (bf16 F.linear already runs on oneDNN), or under autocast
    (F.linear is where autocast casts to bf16; the oneDNN op has no autocast rule).
`set_onednn(False)` turns it off (for A/B benchmarks and bisecting numerical questions).

Packed weights (`pack`, `packed_linear`): the sampler's CPU bf16 decode GEMMs on a weight reordered
once into oneDNN's blocked layout, instead of F.linear, which reorders it on every call (the
decode step's GEMMs are small in M, so that reorder is a large part of each). Used where
`precision.decode_gemm` picks it (measured per machine: `common/engine/machine/cpu.py`).
"""
from __future__ import annotations

from typing import Optional

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


def bf16_packing_available() -> bool:
    """Whether this PyTorch can pack bf16 weights for oneDNN (`pack`) on this CPU."""
    return _AVAILABLE and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """A bf16 weight (N, K) reordered into oneDNN's blocked layout for `packed_linear` (a new tensor,
    shape (N, K), opaque strides: read it only through `packed_linear`). `rows`: a typical M, a
    hint to oneDNN; any M runs."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


@torch.library.custom_op("asyncrl::packed_linear", mutates_args=())
def _packed_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x W^T + b, W from `pack`. An op of its own because inductor lowers oneDNN's op only for
    weights frozen into the graph, and the decode body takes its weights as arguments."""
    return _mm(x, weight, bias)


@_packed_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W^T + b -> (..., N) for W = pack(W (N, K)); no gradient. Eagerly oneDNN's op
    itself, inside torch.compile the custom op around it."""
    return _packed_op(x, weight, bias) if torch.compiler.is_compiling() else _mm(x, weight, bias)


def _mm_dx(gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN dY W (`linear`'s input gradient), W read through a transposed view."""
    return _mm(gy, weight.t())


def _mm_dw(gy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """oneDNN dY^T X (`linear`'s weight gradient) over every leading dim, both read transposed."""
    return _mm(gy.reshape(-1, gy.shape[-1]).t(), x.reshape(-1, x.shape[-1]).t())


# The trainer's path, as custom ops: opaque to torch.compile (so `train.compile_blocks` keeps the
# oneDNN GEMMs and fuses only what lies between them), with an autograd formula whose two GEMMs
# are custom ops too. Decode and other no-grad eager calls skip the op's dispatch: `_mm` direct.
@torch.library.custom_op("asyncrl::onednn_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x W^T + b on oneDNN."""
    return _mm(x, weight, bias)


@torch.library.custom_op("asyncrl::onednn_linear_dx", mutates_args=())
def _dx_op(gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dX = dY W: (..., N) x (N, K) -> (..., K). A transposed view, not a copy: oneDNN reads strides."""
    return _mm_dx(gy, weight)


@torch.library.custom_op("asyncrl::onednn_linear_dw", mutates_args=())
def _dw_op(gy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X: (M, N)^T x (M, K) -> (N, K), over every leading dim of gy and x (views, no copies)."""
    return _mm_dw(gy, x)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_dx_op.register_fake
def _(gy, weight):
    return gy.new_empty((*gy.shape[:-1], weight.shape[1]))


@_dw_op.register_fake
def _(gy, x):
    return gy.new_empty((gy.shape[-1], x.shape[-1]))


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, gy):
    """dX = dY W, dW = dY^T X, db = sum dY, each only where needed."""
    x, weight = ctx.saved_tensors
    gx = _dx_op(gy, weight) if ctx.needs_input_grad[0] else None
    gw = _dw_op(gy, x) if ctx.needs_input_grad[1] else None
    gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb


_linear_op.register_autograd(_backward, setup_context=_setup)


def cpu_fp32(*xs: torch.Tensor) -> bool:
    """Whether these tensors are computed in plain fp32 on CPU: all CPU fp32, no CPU autocast (which
    would cast inside F.linear). Where the CPU fp32 paths (this file, causal_attention.py, fused.py) apply."""
    return all(x.device.type == "cpu" and x.dtype == torch.float32 for x in xs) and not torch.is_autocast_enabled("cpu")


def _onednn_for(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a GEMM of these operands goes to oneDNN (module docstring: routing)."""
    return _enabled and a.numel() > 0 and cpu_fp32(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x (..., K), weight (N, K) -> (..., N)."""
    if _onednn_for(x, weight):
        if torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
            return _linear_op(x, weight, bias)
        return _mm(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_dx(gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dY W, `linear`'s input gradient, for code with its own backward (head.py, fused.py):
    (M, N) x (N, K) -> (M, K), W read through a transposed view (never copied)."""
    return _mm_dx(gy, weight) if _onednn_for(gy, weight) else gy @ weight


def linear_dw(gy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dY^T X, `linear`'s weight gradient: (M, N), (M, K) -> (N, K), both passed as transposed views
    (no copy of ours; oneDNN itself copies a transposed first operand: BENCHMARKS.md)."""
    return _mm_dw(gy, x) if _onednn_for(gy, x) else gy.t() @ x


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) that calls `linear`, plus its LoRA adapter's
    update where one hangs on it (`lora`, common/engine/model/lora.py)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        lora = self._modules.get("lora")  # a dict lookup: no adapter costs nothing
        return y + lora(x) if lora is not None and lora.enabled else y
