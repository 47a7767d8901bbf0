"""The model as the sampler's decode step runs it: merged projections and the layer body as two
pure functions per layer, compiled by torch.compile (or run eagerly: the same code).

Runs in the sampler's process (`common/engine/sampler/decode.py` calls `DecodeModel.step`). One decode
step (one new token per slot row b; d = the previous layer's MLP output, 0 before layer 0):
    attn_in    x = x + d;  h = rms_norm(x);  q|k|v = h Wqkv^T (+ b)     one GEMM: q/k/v merged
               q, k = rope(q_norm(q), k_norm(k), pos)                    (q/k norms: Qwen3)
               K[b, :, own_b] = k;  V[b, :, own_b] = v                   into the row's slot
    attention  the prompt part and the own part with their log-sum-exps (`decode_attention.py`)
    attn_out   o = merge(prompt, own);  x = x + o Wo^T;  h = rms_norm(x)
               d = (silu(g) * u) Wdown^T,  g|u = h Wgu^T                 one GEMM: gate/up merged
    tail       logits = rms_norm(x + d) Wlm^T;  the fp32 sampling tail (`sampling.py`)
Compiled, each piece is a handful of fused kernels around its GEMMs (add + norm, the q/k/v
split with RoPE and the cache write, the merge, SiLU x up); one compiled graph serves every
layer (weights are arguments) and every batch of two rows or more (the row dims are marked
dynamic), so a run compiles each piece at most twice (once more for a single row), and the
first, eager-run step of every CUDA-graph bucket warms it up before its capture
(`decode.GraphedDecode`).

The other families change the body through `Body` (constants of the compiled graph) and the
weights present: LayerNorm with bias where a norm has one (GPT-NeoX, GPT-2), the MLP ungated
(`gu` = up alone) with GELU, the parallel residual (the MLP reads the block's input: GPT-NeoX),
partial rotary (`apply_rope` rotates the table's width), learned positions added to the
embeddings and no RoPE (GPT-2), and Gemma 3's sandwich norms, scaled embeddings and the local
layers' own RoPE table. A Llama-family model runs exactly the graph above.

Merged weights: `merged([Wq, Wk, Wv])` is a view when the three lie back to back in memory (a
generator's weights bound to the weight store's flat slot, laid out in that order, and any model
whose loader put them so), else a packed copy, packed again by `refresh` after each weight
update (`Sampler.update_weights`). Either way the model keeps its Hugging Face layout.
With `packed` (CPU, bf16 weights: `precision.decode_gemm`), every decode GEMM's weight, the head's
too, is also reordered into oneDNN's blocked layout (`linear.pack`: a private copy, made again by
each `refresh`) and multiplied by `linear.packed_linear`: the same products without F.linear's
reorder of the weight on every call.
Shapes: B rows, D hidden, H query heads, Hkv key/value heads, G = H / Hkv, hd head dim.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as shape_config
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError

from common.engine.sampler import decode_attention
from common.engine.model.attention import merge
from common.engine.model.fused import activation, rms_norm
from common.engine.model.layers import apply_rope
from common.engine.model.linear import linear, pack, packed_linear
from common.engine.sampler.sampling import sample, scale_logits, uniforms


def merged(ts: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, bool]:
    """(torch.cat(ts), is_view): a view of their memory when they lie back to back in one
    storage (same dtype, contiguous), else a packed copy. (None, True) for all-None biases."""
    if all(t is None for t in ts):
        return None, True
    ts = [t.detach() for t in ts]
    t0 = ts[0]
    end, base = t0.data_ptr(), t0.untyped_storage().data_ptr()
    for t in ts:
        if (t.dtype != t0.dtype or not t.is_contiguous() or t.data_ptr() != end or t.shape[1:] != t0.shape[1:]
                or t.untyped_storage().data_ptr() != base):
            return torch.cat(ts), False
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in ts)
    view = torch.empty(0, dtype=t0.dtype, device=t0.device)
    view.set_(t0.untyped_storage(), t0.storage_offset(), (rows, *t0.shape[1:]))
    return view, True


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


@dataclass
class LayerWeights:
    """One layer's decode weights (merged where the module docstring says)."""
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gu: torch.Tensor
    gu_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None
    ln1_b: torch.Tensor | None = None      # LayerNorm biases (GPT-NeoX, GPT-2); None: RMSNorm
    ln2_b: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # Gemma 3's sandwich norms: on the attention's output (ln2 is
    post_mlp: torch.Tensor | None = None   # then pre_feedforward_layernorm) and on the MLP's output
    local: int = 0                         # 1: a sliding-window layer, its own RoPE table (Gemma 3)
    packed: bool = False                   # the GEMM weights are `linear.pack`ed (oneDNN's layout)


@dataclass(frozen=True)
class Body:
    """What a family changes in the layer body (constants of the compiled graph)."""
    act: str = "silu"           # the MLP activation (`fused.activation`)
    gated: bool = True          # gu = [gate | up] (Llama), or up alone (GPT-NeoX, GPT-2)
    parallel: bool = False      # the MLP reads the block's input, not x + attention (GPT-NeoX)


def _lin(x, w, b, packed: bool):
    """x W^T + b through F.linear / oneDNN (`linear`), or on a packed weight (`linear.packed_linear`)."""
    return packed_linear(x, w, b) if packed else linear(x, w, b)


def _norm(x, w, b, eps: float):
    """RMSNorm, or LayerNorm where the norm has a bias (GPT-NeoX, GPT-2)."""
    return rms_norm(x, w, eps) if b is None else F.layer_norm(x, w.shape, w, b, eps)


def attn_in(x, d, w: LayerWeights, eps: float, cos_t, sin_t, pos, kc, vc, own, q_rows, H: int, Hkv: int):
    """x, d (B, D) -> x + d (B, D), q_own (B, G, Hkv, hd), q_prompt (E*n, G, Hkv, hd) in the cache's
    dtype; writes the rows' k/v at `own` (B,): their slots' column of a static cache's kc/vc
    (max_batch, Hkv, cols, hd), or their token of a paged cache's kc (tokens, 2, Hkv, hd), vc None."""
    x = x + d
    B, hd = x.shape[0], kc.shape[-1]
    qkv = _lin(_norm(x, w.ln1, w.ln1_b, eps), w.qkv, w.qkv_b, w.packed)            # (B, (H + 2 Hkv) hd)
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q, k, v = q.view(B, H, hd), k.view(B, Hkv, hd), v.view(B, Hkv, hd)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    dt = x.dtype
    if cos_t is not None:  # None: learned positions, added to the embeddings (GPT-2)
        cos, sin = cos_t[pos].to(dt).unsqueeze(1), sin_t[pos].to(dt).unsqueeze(1)  # (B, 1, rotary_dim), as Transformer.rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if vc is None:  # paged (`kv/paged_cache.py`), a constant of the compiled graph: K and V side by side, one write
        kc[own] = torch.stack((k, v), 1).to(kc.dtype)
    else:
        rows = torch.arange(B, device=x.device)
        kc[rows, :, own] = k.to(kc.dtype)
        vc[rows, :, own] = v.to(vc.dtype)
    q = q.view(B, Hkv, H // Hkv, hd).transpose(1, 2).to(kc.dtype).contiguous()  # (B, G, Hkv, hd): heads h = j*G + g
    return x, q, q[q_rows]


def attn_out(x, o_s, l_s, o_p, l_p, back_e, back_i, w: LayerWeights, eps: float, body: Body = Body()):
    """The merge of the two attention parts (row b reads its prompt part at entry back_e[b], query
    back_i[b]), the output projection, and the MLP: -> x (B, D) after attention, d (B, D) the MLP's output."""
    B = x.shape[0]
    o = merge(o_p[back_e, back_i], l_p[back_e, back_i], o_s, l_s)       # (B, G, Hkv, hd)
    o = _lin(o.transpose(1, 2).reshape(B, -1).to(x.dtype), w.o, w.o_b, w.packed)  # heads back in h = j*G + g order
    if w.post_attn is not None:
        o = rms_norm(o, w.post_attn, eps)
    h = _norm(x if body.parallel else x + o, w.ln2, w.ln2_b, eps)
    x = x + o
    a = _lin(h, w.gu, w.gu_b, w.packed)
    if body.gated:
        g, u = a.chunk(2, dim=-1)
        d = _lin(activation(body.act)(g) * u, w.down, w.down_b, w.packed)
    else:
        d = _lin(activation(body.act)(a), w.down, w.down_b, w.packed)
    return x, (d if w.post_mlp is None else rms_norm(d, w.post_mlp, eps))


def tail(x, d, norm_w, norm_b, eps: float, head_w, temp, greedy, top_k, top_p, key, own, any_filtered: bool,
         any_greedy: bool, packed: bool = False):
    """The last norm, the head, and the draw: tokens (B,) and their log-probs (B,) under the fp32
    logits / T_eff (`sampling.sample`). The uniform is token own + 1 of each sample's random stream
    (token 0 came from the prefill). `packed`: head_w is `linear.pack`ed."""
    logits = _lin(_norm(x + d, norm_w, norm_b, eps), head_w, None, packed)
    u = uniforms(key, own + 1)
    return sample(scale_logits(logits, temp), greedy, top_k, top_p, u, any_filtered, any_greedy)


# A shape inductor fails to compile (a torch bug: a single-row recompile failed so on torch 2.11's
# Triton codegen) runs that piece eagerly, the same math, with a warning, instead of ending the run;
# piece name -> those shapes. Tests assert it stays empty.
EAGER_SHAPES: dict[str, set] = {}
_COMPILE_ERRORS = (BackendCompilerFailed, InductorError)


def _shapes(args) -> tuple:
    """What a compiled piece's graph depends on: tensor shapes and plain values (weights by type)."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a if isinstance(a, (bool, int, float, str))
                 else type(a).__name__ for a in args)


@functools.cache
def _compiled(fn):
    """`fn` through torch.compile: default mode (no CUDA graphs of its own: the capture is
    `GraphedDecode`'s), one graph for the whole piece. Shared by every sampler of the process.
    The caller marks the row dims dynamic (`_dynamic`); shapes are traced without duck sizing (rows
    that happen to equal another size, the cache's slot count at a full batch, stay a symbol of
    their own), so one compile serves every batch of two rows or more, and one more a single row
    (sizes 0 and 1 are specialised). Not size-oblivious: with `backed_size_oblivious`, inductor's
    Triton codegen fails on the single-row recompile (torch 2.11, CantSplit on an H100). A compile
    that fails anyway falls back to eager for its shapes (`EAGER_SHAPES`)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(fn, fullgraph=True)
    failed = EAGER_SHAPES.setdefault(fn.__name__, set())

    @functools.wraps(fn)
    def run(*args):
        if not failed or _shapes(args) not in failed:  # the key only once a shape has failed: not per call
            try:
                with shape_config.patch(use_duck_shape=False):
                    return compiled(*args)
            except _COMPILE_ERRORS as e:  # raised while compiling, before the graph ran: nothing written yet
                key = _shapes(args)
                failed.add(key)
                warnings.warn(f"decode: torch.compile failed on {fn.__name__} at shapes {key} "
                              f"({type(e).__name__}: {str(e)[:300]}); these shapes run eagerly", RuntimeWarning)
        return fn(*args)
    return run


def _dynamic(*marks) -> None:
    """(tensor, dims...) pairs: mark those dims dynamic for the compiled pieces."""
    for t, *dims in marks:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)


class DecodeModel:
    """A `Transformer`'s weights laid out for decode, and the step through them."""

    def __init__(self, model, compile: bool = False, flash: bool = False, packed: bool = False):
        self.model, self.cfg, self.compile = model, model.cfg, compile
        self.flash = flash  # decode attention through the flash kernel (`decode_attention.py`), else dense
        self.packed_gemm = packed  # GEMM weights in oneDNN's layout (module docstring; CPU bf16 only)
        self.generation = 0  # bumped when a weight's address changes (captured graphs must be dropped)
        self._ptrs: tuple | None = None
        self.refresh()

    def _sources(self):
        """Per layer: the parameters each merged weight is made of, in order."""
        for blk in self.model.model.layers:
            a, m = blk.self_attn, blk.mlp
            gu = [m.gate_proj, m.up_proj] if hasattr(m, "gate_proj") else [m.up_proj]  # ungated: up alone
            yield blk, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], \
                [p.weight for p in gu], [p.bias for p in gu]

    @torch.no_grad()
    def refresh(self) -> None:
        """After a weight load: packed copies are packed again in place (captured graphs keep their
        addresses); if a parameter's storage moved (e.g. bound to the weight store), everything is
        rebuilt and `generation` moves on. oneDNN-packed weights are new tensors: always rebuilt."""
        ptrs = tuple(p.data_ptr() for p in self.model.parameters())
        if ptrs == self._ptrs and not self.packed_gemm:
            for dst, src in self.packed:
                torch.cat([t.detach() for t in src], out=dst)
            return
        self._ptrs, self.generation, self.layers = ptrs, self.generation + 1, []
        self.packed: list[tuple[torch.Tensor, list]] = []  # (packed copy, its parts): re-packed by `refresh`
        for blk, *srcs in self._sources():
            out = []
            for src in srcs:
                t, is_view = merged(src)
                out.append(t)
                if not is_view and not self.packed_gemm:
                    self.packed.append((t, src))
            qkv, qkv_b, gu, gu_b = out
            a, m = blk.self_attn, blk.mlp
            qn = getattr(a, "q_norm", None)
            sandwich = hasattr(blk, "post_feedforward_layernorm")  # Gemma 3: ln2 is the pre-MLP norm
            ln2 = blk.pre_feedforward_layernorm if sandwich else blk.post_attention_layernorm
            self.layers.append(LayerWeights(
                blk.input_layernorm.weight.detach(), qkv, qkv_b, None if qn is None else qn.weight.detach(),
                None if qn is None else a.k_norm.weight.detach(), a.o_proj.weight.detach(), _d(a.o_proj.bias),
                ln2.weight.detach(), gu, gu_b, m.down_proj.weight.detach(), _d(m.down_proj.bias),
                ln1_b=_d(getattr(blk.input_layernorm, "bias", None)), ln2_b=_d(getattr(ln2, "bias", None)),
                post_attn=blk.post_attention_layernorm.weight.detach() if sandwich else None,
                post_mlp=blk.post_feedforward_layernorm.weight.detach() if sandwich else None, local=int(a.local)))
            if self.packed_gemm:
                w = self.layers[-1]
                w.qkv, w.o, w.gu, w.down, w.packed = pack(w.qkv), pack(w.o), pack(w.gu), pack(w.down), True
        self.head = pack(self.model.lm_head.weight) if self.packed_gemm else self.model.lm_head.weight.detach()

    def _fn(self, fn):
        return _compiled(fn) if self.compile else fn

    def step(self, cache, tok, pos, own, q_rows, back, entry_plen, shape, temp, greedy, top_k, top_p, key,
             any_filtered: bool, any_greedy: bool):
        """One decode step over rows 0..B-1: tokens (B,) at positions pos (B,) written at slot columns
        own (B,); returns the next tokens (B,) and their log-probs (B,)."""
        cfg, m = self.cfg, self.model
        p = decode_attention.plan(cache, own, entry_plen, back, shape, self.flash)
        learned = cfg.positions == "learned"  # GPT-2: position embeddings, no RoPE
        tables = (None, None) if learned else m.rope_tables(cache.max_seq_len, tok.device)  # (global[, local]) cos, sin
        x = m.model.embed_tokens(tok)                                         # (B, D)
        if cfg.embed_scale != 1.0:  # Gemma, as Transformer.hidden
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if learned:
            x = x + m.model.embed_positions(pos)
        body = Body(cfg.hidden_act, cfg.gated_mlp, cfg.parallel_residual)
        d = torch.zeros_like(x)  # layer 0 adds nothing: one graph for every layer
        f_in, f_out = self._fn(attn_in), self._fn(attn_out)
        H, Hkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
        mark = _dynamic if self.compile else (lambda *_: None)  # rows B, query rows E*n, entries E and n
        mark((pos, 0), (own, 0), (p.write, 0), (q_rows, 0), (p.back_e, 0), (p.back_i, 0))
        for i, w in enumerate(self.layers):
            cos_t, sin_t = tables[2 * w.local:2 * w.local + 2]  # the layer's RoPE table (None: learned positions)
            mark((x, 0), (d, 0))
            x, q_own, q_prompt = f_in(x, d, w, eps, cos_t, sin_t, pos, *cache.decode_stores(i), p.write, q_rows, H, Hkv)
            o_s, l_s, o_p, l_p = decode_attention.attend(cache, i, q_own, q_prompt, p)
            mark((x, 0), (o_s, 0), (l_s, 0), (o_p, 0, 1), (l_p, 0, 1))
            x, d = f_out(x, o_s, l_s, o_p, l_p, p.back_e, p.back_i, w, eps, body)
        mark((x, 0), (d, 0), (temp, 0), (greedy, 0), (top_k, 0), (top_p, 0), (key, 0))
        norm = m.model.norm
        return self._fn(tail)(x, d, norm.weight, _d(getattr(norm, "bias", None)), eps, self.head, temp, greedy,
                              top_k, top_p, key, own, any_filtered, any_greedy, self.packed_gemm)
