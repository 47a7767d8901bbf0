"""Our own compact decoder for the Llama family (Llama 2/3 incl. llama3 RoPE scaling, SmolLM2,
Mistral without sliding window), Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Used by every process: the trainer (full causal forward for log-probs) and the generators
(the KV-cache sampler in `common/engine/sampler.py`). Module names follow Hugging Face's so that a
checkpoint's state dict loads without a name map. The model knows no file format: the loader
(`common/engine/hf_io.py`) builds it and fills its weights from outside, and `hf_save.py` reads
them back out. Attention of full causal passes is `causal_attention.py`, the MLP and RMSNorm are
`fused.py` (CPU fp32 kernels there; the plain PyTorch expressions elsewhere).

Shapes: B batch, T tokens, D hidden, H query heads, Hkv key/value heads, hd head dim,
S cache length, V vocab.

Three ways to call `Transformer.forward` / `hidden`:
  forward(tokens)                   full causal pass, logits (B, T, V)
  forward(tokens, targets=y, temperature=T)
                                    full causal pass, log-probs (B, T) of y[:, t] under
                                    softmax(logits[:, t] / T) where y >= 0 (0 elsewhere), without
                                    a (B, T, V) logits tensor (`common/engine/head.py`); how
                                    targets line up with tokens is `common/ops.py`'s business
  forward(tokens, cache=c, pos=p)   the sampler's passes: K/V go to the cache and attention
                                    runs through it, in the mode the sampler set (prefill a
                                    prompt, prefill a continuation, or decode one token per
                                    row); p (B, T) are absolute positions (`common/engine/kv_cache.py`)
  forward(tokens, targets=y, temperature=T, prefix_lens=p)
                                    the same log-probs, rows whose first p[b] tokens are equal
                                    running them once, packed without padding, when that runs
                                    fewer tokens (`common/engine/prefix.py`)
A block attends through what it is given: nothing (causal over each row), the sampler's cache, or
a packed layout; the last two by `attend(layer, q, k, v)`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from common.engine.causal_attention import causal_attention
from common.engine.fused import mlp, rms_norm
from common.engine.head import head_logp
from common.engine.linear import Linear
from common.engine.prefix import packed_logp

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    model_type: str = "llama"           # one of SUPPORTED_MODEL_TYPES
    vocab_size: int = 32000             # V
    hidden_size: int = 576              # D
    intermediate_size: int = 1536       # MLP width
    num_hidden_layers: int = 30         # L
    num_attention_heads: int = 9        # H
    num_key_value_heads: int = 3        # Hkv (grouped-query attention when < H)
    head_dim: int = 64                  # hd
    rms_norm_eps: float = 1e-5          # RMSNorm epsilon
    rope_theta: float = 10000.0         # RoPE base
    rope_scaling: dict | None = None    # llama3 scaling parameters (rope_type="llama3"), else None
    tie_word_embeddings: bool = False   # lm_head shares the embedding matrix
    qkv_bias: bool = False              # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False                # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False              # bias on the MLP projections (Llama mlp_bias)
    qk_norm: bool = False               # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 8192  # longest position the checkpoint was trained for

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Translate a Hugging Face config.json dict, refusing what we do not implement."""
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture model_type={mt!r} (architectures="
                             f"{hf.get('architectures')}); supported: {SUPPORTED_MODEL_TYPES}")
        if mt == "mistral" and hf.get("sliding_window") not in (None, 0):
            # Sliding-window attention is not implemented; exact only below the window.
            if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
                raise ValueError(f"mistral sliding_window={hf['sliding_window']} is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{mt}: use_sliding_window=True is not supported")
        # transformers >= 5 nests RoPE settings in rope_parameters; older configs use
        # top-level rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type={rtype!r}; supported: default, llama3")
        H = hf["num_attention_heads"]
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=mt, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=H, num_key_value_heads=hf.get("num_key_value_heads") or H,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // H,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if rtype == "llama3" else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or attn_bias, o_bias=attn_bias and mt in ("llama", "qwen3"),
            mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=(mt == "qwen3"),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(hd/2,) inverse frequencies, with Llama-3 frequency-dependent scaling when configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
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
    """x (B, nh, T, hd); cos/sin (B, 1, T, hd). Hugging Face's rotate-half convention."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # under autocast x is bf16, the tables fp32
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.hd, self.layer_idx = H, Hkv, hd, layer_idx
        self.q_proj = Linear(D, H * hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(H * hd, D, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd)
        k = self.k_proj(x).view(B, T, self.Hkv, self.hd)
        v = self.v_proj(x).view(B, T, self.Hkv, self.hd).transpose(1, 2)  # (B, Hkv, T, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, hd)
        if cache is None:
            y = causal_attention(q, k, v)  # (B, T, H, hd)
        else:  # the sampler's cache stores k/v and attends in the mode it was given (kv_cache.py)
            y = cache.attend(self.layer_idx, q, k, v).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, self.H * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, I, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj = Linear(D, I, bias=b), Linear(D, I, bias=b)
        self.down_proj = Linear(I, D, bias=b)

    def forward(self, x):
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return mlp(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The `model.` submodule of a Hugging Face causal LM: embeddings, blocks, final norm."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def call_block(layer: Block, x, cos, sin, layout=None):
    """One block of a full causal pass (no cache; attention through `layout` when packed)."""
    return layer(x, cos, sin, layout)


@functools.cache
def compiled_block():
    """`call_block` through torch.compile: one function for every block of every model (the block is
    an argument, its parameters graph inputs), dynamic shapes (micro-batches vary), so L blocks and
    new batch shapes reuse one compiled graph per grad mode. Inside it CPU GEMMs run on ATen
    (`common/engine/linear.py`)."""
    return torch.compile(call_block, dynamic=True)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, hf_config: dict | None = None):
        super().__init__()
        self.cfg = cfg
        self.hf_config = dict(hf_config or {})  # kept verbatim so save_pretrained round-trips
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._rope_cache: tuple | None = None  # (cos, sin) tables (P, hd), grown on demand
        # Mixed precision (trainer): fp32 weights, forward passes under autocast to this dtype.
        # None = run in the weights' dtype (generators hold bf16 or fp32 weights directly).
        self.compute_dtype: torch.dtype | None = None
        self.kv_dtype: torch.dtype | None = None  # the sampler's KV cache dtype; None = the weights'
        self.decode_graphs = False  # a Sampler built without cuda_graphs= (evaluation) captures its decode on CUDA
        self.decode_compile: bool | None = None  # a Sampler built without compile= compiles its decode body (None: on CUDA)
        # Trainer option: recompute each block's activations in backward instead of keeping them
        # (memory ~ one block's activations plus each block's input; ~1/3 more compute).
        self.checkpoint_layers = False
        # Trainer option: full causal passes run each block through one torch.compile'd function
        # (`compiled_block`): RMSNorm, RoPE, SiLU and the residual adds fused around the GEMMs.
        self.compile_blocks = False
        # `common.ops.token_logp` hands this model the rows' prompt lengths (`forward(...,
        # prefix_lens=)`: each distinct prompt run once, `common/engine/prefix.py`); False: every
        # row in full; None: on the CPU only (on CUDA the packed pass's masked attention cost as
        # much device time as the fewer tokens saved, BENCHMARKS.md)
        self.share_prompts: bool | None = None

    def tie_weights(self):
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, pos: torch.Tensor, bound: int | None = None):
        """cos, sin (B, 1, T, hd) for integer positions pos (B, T). `bound` > every position
        spares a host sync (a captured CUDA step must not read pos back)."""
        cos, sin = self.rope_tables(bound if bound is not None else int(pos.max()) + 1, pos.device)
        dt = self.lm_head.weight.dtype
        return cos[pos].unsqueeze(1).to(dt), sin[pos].unsqueeze(1).to(dt)

    def rope_tables(self, need: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 cos, sin tables (P, hd) for positions 0..P-1, P >= need (built, or grown, on demand)."""
        c = self._rope_cache
        if c is None or c[0].shape[0] < need or c[0].device != torch.device(device):
            P = max(need, 2048)
            inv = rope_inv_freq(self.cfg).to(device)
            ang = torch.outer(torch.arange(P, device=device, dtype=torch.float32), inv)
            ang = torch.cat((ang, ang), dim=-1)  # (P, hd)
            c = self._rope_cache = (ang.cos(), ang.sin())
        return c

    def autocast(self):
        """Context for forward passes: autocast to `compute_dtype` when it differs from the
        weights' dtype (log-softmax and losses run outside it, in fp32: `common/ops.py`)."""
        dt = self.compute_dtype
        return torch.autocast(self.device.type, dtype=dt, enabled=dt is not None and dt != self.dtype)

    def hidden(self, tokens, cache=None, pos=None, max_pos: int | None = None, layout=None):
        """Final-norm hidden states (B, T, D). pos (B, T): absolute positions for RoPE
        (default 0..T-1); max_pos: a bound on them, if the caller knows one. With `cache`,
        attention runs through it; with `layout` (a `SharedPrefixes`), the pass runs its packed
        tokens, (1, N, D) out (see the module docstring)."""
        if layout is not None:
            tokens, pos, max_pos = layout.tokens[None], layout.pos[None], layout.max_pos
        B, T = tokens.shape
        if pos is None:
            pos, max_pos = torch.arange(T, device=tokens.device).expand(B, T), T
        cos, sin = self.rope(pos, max_pos)
        x = self.model.embed_tokens(tokens)
        recompute = self.checkpoint_layers and cache is None and torch.is_grad_enabled()
        # compiled blocks see plain rows only: a layout object would be a new guard every micro-batch
        run = compiled_block() if self.compile_blocks and cache is None and layout is None else call_block
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(run, layer, x, cos, sin, layout, use_reentrant=False)
            elif cache is None:
                x = run(layer, x, cos, sin, layout)
            else:
                x = layer(x, cos, sin, cache=cache)
        return self.model.norm(x)

    def forward(self, tokens, cache=None, pos=None, targets=None, temperature: float = 1.0,
                prefix_lens: torch.Tensor | None = None):
        """Logits (B, T, V); or with `targets` (B, T) int64, log-probs (B, T) fp32 of targets[:, t]
        at position t under softmax(logits / temperature), 0 where targets[:, t] < 0; with
        `prefix_lens` (B,) too, rows sharing their first prefix_lens tokens run them once (module
        docstring). The sampler uses `hidden` and applies the head to the last position."""
        if targets is not None and prefix_lens is not None and cache is None:
            lp = packed_logp(self, tokens, targets, prefix_lens, temperature)
            if lp is not None:
                return lp
        h = self.hidden(tokens, cache=cache, pos=pos)
        if targets is None:
            return self.lm_head(h)
        sel = targets >= 0
        lp = head_logp(h[sel], self.lm_head.weight, targets[sel], temperature)  # (n,) chunked over positions
        return torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)

    @property
    def device(self):
        return self.lm_head.weight.device

    @property
    def dtype(self):
        return self.lm_head.weight.dtype
