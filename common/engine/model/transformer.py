"""Our own compact decoder: one decoder, configured per family (`common/engine/model/model_config.py`):
the Llama family (Llama 2/3 incl. llama3 RoPE scaling, SmolLM2, Mistral without sliding window),
Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), GPT-NeoX / Pythia (LayerNorm, parallel
residual, partial rotary, GELU MLP), GPT-2 (LayerNorm, learned positions, tanh-GELU MLP) and
Gemma 3 (sandwich norms, scaled embeddings, local layers with their own RoPE base).

Used by every process: the trainer (full causal forward for log-probs) and the generators
(the KV-cache sampler in `common/engine/sampler/sampler.py`). Module names follow Hugging Face's Llama
names (separate q/k/v and gate/up projections), so a Llama-family state dict loads without a name
map; other families' names and fused tensors are mapped at load and back at save
(`common/engine/checkpoints/hf_layouts.py`). The model knows no file format: the loader
(`common/engine/checkpoints/hf_io.py`) builds it and fills its weights from outside, and `hf_save.py` reads
them back out. Attention of full causal passes is `causal_attention.py`, the MLP and RMSNorm are
`fused.py` (CPU fp32 kernels there; the plain PyTorch expressions elsewhere), RoPE and the
norms `layers.py`. What a family changes is a branch on the config at build time or a cheap
Python test on shapes in the forward: a Llama-family model runs the code it always ran.

Shapes: B batch, T tokens, D hidden, H query heads, Hkv key/value heads, hd head dim,
S cache length, V vocab.

Three ways to call `Transformer.forward` / `hidden`:
  forward(tokens)                   full causal pass, logits (B, T, V)
  forward(tokens, targets=y, temperature=T)
                                    full causal pass, log-probs (B, T) of y[:, t] under
                                    softmax(logits[:, t] / T) where y >= 0 (0 elsewhere), without
                                    a (B, T, V) logits tensor (`common/engine/model/head.py`); how
                                    targets line up with tokens is `common/contracts/ops.py`'s business
  forward(tokens, cache=c, pos=p)   the sampler's passes: K/V go to the cache and attention
                                    runs through it, in the mode the sampler set (prefill a
                                    prompt, prefill a continuation, or decode one token per
                                    row); p (B, T) are absolute positions (`common/engine/kv/static_cache.py`)
  forward(tokens, targets=y, temperature=T, prefix_lens=p)
                                    the same log-probs, rows whose first p[b] tokens are equal
                                    running them once, packed without padding, when that runs
                                    fewer tokens (`common/engine/model/prefix.py`)
  forward(tokens, targets=y, ...) with `pack_rows` set
                                    the same log-probs, the rows packed end to end without
                                    padding, attention per row (`common/engine/model/packing.py`)
A block attends through what it is given: nothing (causal over each row), the sampler's cache, or
a packed layout; the last two by `attend(layer, q, k, v)`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from common.engine.model.causal_attention import causal_attention
from common.engine.model.fused import activation, mlp, plain_mlp
from common.engine.model.head import head_logp
from common.engine.model.layers import RMSNorm, apply_rope, make_norm, rope_inv_freq
from common.engine.model.linear import Linear
from common.engine.model.model_config import ModelConfig
from common.engine.model.packing import packed_logp


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.hd, self.layer_idx = H, Hkv, hd, layer_idx
        self.local = layer_idx in cfg.local_layers  # a sliding-window layer: the local RoPE base (Gemma 3)
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
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
        if isinstance(cos, tuple):  # (global, local) tables (Gemma 3)
            cos, sin = cos[self.local], sin[self.local]
        if cos is not None:  # None: learned absolute positions, added to the input (GPT-2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            y = causal_attention(q, k, v)  # (B, T, H, hd)
        else:  # the sampler's cache stores k/v and attends in the mode it was given (kv/static_cache.py)
            y = cache.attend(self.layer_idx, q, k, v).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, self.H * self.hd))


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)) (Llama); plain: down(act(up(x))) (GPT-NeoX, GPT-2: no gate_proj).
    With LoRA adapters on its projections (`unfused`, set by lora.py) each goes through its module."""
    unfused = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, I, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        if cfg.gated_mlp:
            self.gate_proj = Linear(D, I, bias=b)
        self.up_proj, self.down_proj = Linear(D, I, bias=b), Linear(I, D, bias=b)
        self.act = cfg.hidden_act

    def forward(self, x):
        u, d = self.up_proj, self.down_proj
        if self.unfused:  # the fused paths read the weights alone; an adapter's update comes with its module
            if hasattr(self, "gate_proj"):
                return d(activation(self.act)(self.gate_proj(x)) * u(x))
            return d(activation(self.act)(u(x)))
        if not hasattr(self, "gate_proj"):
            return plain_mlp(x, u.weight, u.bias, d.weight, d.bias, self.act)
        g = self.gate_proj
        return mlp(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias, self.act)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.parallel = cfg.parallel_residual
        if cfg.sandwich_norms:  # Gemma 3: post_attention_layernorm normalises the attention's output
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = make_norm(cfg), make_norm(cfg)

    def forward(self, x, cos, sin, cache=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, cache)
        if self.parallel:  # GPT-NeoX: both branches read the block's input
            return x + a + self.mlp(self.post_attention_layernorm(x))
        if hasattr(self, "post_feedforward_layernorm"):
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The `model.` submodule of a Hugging Face causal LM: embeddings, blocks, final norm."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.positions == "learned":  # GPT-2: one row per position, added to the token embeddings
            self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg)


def call_block(layer: Block, x, cos, sin, layout=None):
    """One block of a full causal pass (no cache; attention through `layout` when packed)."""
    return layer(x, cos, sin, layout)


@functools.cache
def compiled_block():
    """`call_block` through torch.compile: one function for every block of every model (the block is
    an argument, its parameters graph inputs), dynamic shapes (micro-batches vary), so L blocks and
    new batch shapes reuse one compiled graph per grad mode. Inside it CPU GEMMs run on ATen
    (`common/engine/model/linear.py`)."""
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
        self.decode_overlap = False  # a Sampler built without overlap= launches a step before recording the last
        # Trainer option: recompute each block's activations in backward instead of keeping them
        # (memory ~ one block's activations plus each block's input; ~1/3 more compute).
        self.checkpoint_layers = False
        # Trainer option: full causal passes run each block through one torch.compile'd function
        # (`compiled_block`): RMSNorm, RoPE, SiLU and the residual adds fused around the GEMMs.
        self.compile_blocks = False
        # `common.contracts.ops.token_logp` hands this model the rows' prompt lengths (`forward(...,
        # prefix_lens=)`: each distinct prompt run once, `common/engine/model/prefix.py`); False: every
        # row in full; None: on the CPU only (on CUDA the packed pass's masked attention cost as
        # much device time as the fewer tokens saved, BENCHMARKS.md)
        self.share_prompts: bool | None = None
        # Trainer option (`train.pack_rows`): log-prob passes run their rows packed end to end, no
        # padding, attention per row (`common/engine/model/packing.py`)
        self.pack_rows = False

    def tie_weights(self):
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model runs: a hard limit with learned positions (GPT-2), the
        window with sliding-window layers (Gemma 3: exact below it), else None (RoPE extends past
        the trained length; quality is the user's call)."""
        if self.cfg.positions == "learned":
            return self.cfg.max_position_embeddings
        return self.cfg.sliding_window if self.cfg.local_layers else None

    def check_positions(self, n: int, what: str = "this pass") -> None:
        """Refuse a sequence of n positions beyond `max_positions`, saying why."""
        lim = self.max_positions
        if lim is not None and n > lim:
            why = ("its position embeddings end there" if self.cfg.positions == "learned" else
                   "its sliding-window layers are exact only within their window")
            raise ValueError(f"a {self.cfg.model_type} model runs at most {lim} positions ({why}); {what} needs {n}")

    def rope(self, pos: torch.Tensor, bound: int | None = None):
        """cos, sin (B, 1, T, rotary_dim) for integer positions pos (B, T); with local layers of their
        own base (Gemma 3) each is a (global, local) pair; (None, None) with learned positions.
        `bound` > every position spares a host sync (a captured CUDA step must not read pos back)."""
        if self.cfg.positions == "learned":
            return None, None
        tables = self.rope_tables(bound if bound is not None else int(pos.max()) + 1, pos.device)
        dt = self.lm_head.weight.dtype
        out = [t[pos].unsqueeze(1).to(dt) for t in tables]
        if len(out) == 2:
            return out[0], out[1]
        return (out[0], out[2]), (out[1], out[3])  # (global, local) pairs: each layer takes its own

    def rope_tables(self, need: int, device) -> tuple[torch.Tensor, ...]:
        """The fp32 cos, sin tables (P, rotary_dim) for positions 0..P-1, P >= need (built, or grown,
        on demand); with local layers of their own base (Gemma 3) the local layers' cos, sin follow."""
        c = self._rope_cache
        if c is None or c[0].shape[0] < need or c[0].device != torch.device(device):
            P, tables = max(need, 2048), []
            # one base, or (Gemma 3) the global layers' and the local layers' bases
            for theta in (self.cfg.rope_theta,) + ((self.cfg.rope_local_theta,) if self.cfg.local_layers else ()):
                inv = rope_inv_freq(self.cfg, theta).to(device)
                ang = torch.outer(torch.arange(P, device=device, dtype=torch.float32), inv)
                ang = torch.cat((ang, ang), dim=-1)  # (P, rotary_dim)
                tables += [ang.cos(), ang.sin()]
            c = self._rope_cache = tuple(tables)
        return c

    def autocast(self):
        """Context for forward passes: autocast to `compute_dtype` when it differs from the
        weights' dtype (log-softmax and losses run outside it, in fp32: `common/contracts/ops.py`)."""
        dt = self.compute_dtype
        return torch.autocast(self.device.type, dtype=dt, enabled=dt is not None and dt != self.dtype)

    def hidden(self, tokens, cache=None, pos=None, max_pos: int | None = None, layout=None):
        """Final-norm hidden states (B, T, D). pos (B, T): absolute positions for RoPE
        (default 0..T-1); max_pos: a bound on them, if the caller knows one. With `cache`,
        attention runs through it; with `layout` (`SharedPrefixes`, `PackedRows`), the pass runs its packed
        tokens, (1, N, D) out (see the module docstring)."""
        if layout is not None:
            tokens, pos, max_pos = layout.tokens[None], layout.pos[None], layout.max_pos
        B, T = tokens.shape
        if pos is None:
            pos, max_pos = torch.arange(T, device=tokens.device).expand(B, T), T
        cos, sin = self.rope(pos, max_pos)
        x = self.model.embed_tokens(tokens)
        if self.cfg.embed_scale != 1.0:  # Gemma: the scale rounded to the embeddings' dtype, as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        if self.max_positions is not None:  # a hard limit (learned positions, sliding windows)
            self.check_positions(max_pos if max_pos is not None else int(pos.max()) + 1)
        if self.cfg.positions == "learned":
            x = x + self.model.embed_positions(pos)
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
        docstring); with `pack_rows` set, the rows run packed. The sampler uses `hidden` and applies
        the head to the last position."""
        if targets is not None and cache is None and (prefix_lens is not None or self.pack_rows):
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
