"""The decoder's small parts: RoPE (its tables' frequencies and the rotation, whole or partial)
and the two norms (RMSNorm; LayerNorm with bias for GPT-NeoX and GPT-2).

Used by `common/engine/model/transformer.py` (every process) and the sampler's decode body
(`common/engine/sampler/decode_model.py`). Shapes: B batch, nh heads, T tokens, hd head dim, r the dims
RoPE rotates (hd, or GPT-NeoX's rotary_pct of it).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.engine.model.fused import rms_norm
from common.engine.model.model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """(rotary_dim/2,) inverse frequencies of base `theta` (default cfg.rope_theta), with Llama-3
    frequency-dependent scaling when configured."""
    hd = cfg.rotary_dim  # the head's dims RoPE rotates (all but for partial rotary, GPT-NeoX)
    inv = 1.0 / ((theta or cfg.rope_theta) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    s = cfg.rope_scaling
    if s:  # llama3: long wavelengths divided by `factor`, short kept, smooth in between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hd); cos/sin (B, 1, T, r), r <= hd: the first r dims rotate (Hugging Face's
    rotate-half convention within them), the rest pass unchanged (partial rotary, GPT-NeoX)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # under autocast x is bf16, the tables fp32
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with bias (GPT-NeoX, GPT-2): one ATen kernel, forward and backward."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """A block's or the final norm, of the kind the config names."""
    return (LayerNorm if cfg.norm == "layer" else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)
