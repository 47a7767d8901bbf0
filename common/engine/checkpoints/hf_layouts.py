"""Hugging Face checkpoint layouts of the families whose tensor names or shapes differ from our
module names, mapped at load (`hf_io.py`) and back at save (`hf_save.py`).

Runs wherever a checkpoint is read or written. Our modules keep Llama's names for every family
(separate q_proj / k_proj / v_proj, up_proj / down_proj, `model.norm`, `lm_head`), so a fused or
transposed checkpoint tensor is split or transposed here, once, at load:
  GPT-NeoX   gpt_neox.{embed_in, final_layer_norm, layers.i.*}, embed_out (the untied head);
             attention.query_key_value (3D, D) holds q, k, v per head: rows ordered [H, 3, hd]
             (head-major), so q is rows [h, 0, :] of every head h; attention.dense = o_proj,
             mlp.dense_h_to_4h / dense_4h_to_h = up_proj / down_proj.
  GPT-2      [transformer.]{wte, wpe, ln_f, h.i.*}; every projection is a Conv1D whose weight is
             stored transposed, (in, out): attn.c_attn (D, 3D) holds q | k | v along its columns,
             attn.c_proj = o_proj, mlp.c_fc / c_proj = up_proj / down_proj; the head is tied to wte.
  Gemma 3   Llama's names; every RMSNorm weight is stored as w for a scale of 1 + w, so 1 is
             added at load (in fp32) and taken off at save.
The Llama-shaped families (llama, mistral, qwen2, qwen3) load as they are. Buffers some
checkpoints saved (causal-mask `attn.bias` / `masked_bias`, `rotary_emb.inv_freq`) are skipped.
At save the inverse maps give the names and layouts transformers writes for that model type.
"""
from __future__ import annotations

import re

import torch

COPY, TRANSPOSED, QKV_HEADS, QKV_COLUMNS = "copy", "transposed", "qkv_heads", "qkv_columns"

# (checkpoint name, our name, how the tensor is stored) per family; {i} layer, {p} weight|bias,
# {x} q|k|v (one fused checkpoint tensor, three of ours)
_RULES = {
    "gpt_neox": [
        ("gpt_neox.embed_in.weight", "model.embed_tokens.weight", COPY),
        ("gpt_neox.final_layer_norm.{p}", "model.norm.{p}", COPY),
        ("embed_out.weight", "lm_head.weight", COPY),
        ("lm_head.weight", "lm_head.weight", COPY),  # the name transformers >= 5 uses in memory
        ("gpt_neox.layers.{i}.input_layernorm.{p}", "model.layers.{i}.input_layernorm.{p}", COPY),
        ("gpt_neox.layers.{i}.post_attention_layernorm.{p}", "model.layers.{i}.post_attention_layernorm.{p}", COPY),
        ("gpt_neox.layers.{i}.attention.query_key_value.{p}", "model.layers.{i}.self_attn.{x}_proj.{p}", QKV_HEADS),
        ("gpt_neox.layers.{i}.attention.dense.{p}", "model.layers.{i}.self_attn.o_proj.{p}", COPY),
        ("gpt_neox.layers.{i}.mlp.dense_h_to_4h.{p}", "model.layers.{i}.mlp.up_proj.{p}", COPY),
        ("gpt_neox.layers.{i}.mlp.dense_4h_to_h.{p}", "model.layers.{i}.mlp.down_proj.{p}", COPY),
    ],
    "gpt2": [
        ("transformer.wte.weight", "model.embed_tokens.weight", COPY),
        ("transformer.wpe.weight", "model.embed_positions.weight", COPY),
        ("transformer.ln_f.{p}", "model.norm.{p}", COPY),
        ("transformer.h.{i}.ln_1.{p}", "model.layers.{i}.input_layernorm.{p}", COPY),
        ("transformer.h.{i}.ln_2.{p}", "model.layers.{i}.post_attention_layernorm.{p}", COPY),
        ("transformer.h.{i}.attn.c_attn.{p}", "model.layers.{i}.self_attn.{x}_proj.{p}", QKV_COLUMNS),
        ("transformer.h.{i}.attn.c_proj.{p}", "model.layers.{i}.self_attn.o_proj.{p}", TRANSPOSED),
        ("transformer.h.{i}.mlp.c_fc.{p}", "model.layers.{i}.mlp.up_proj.{p}", TRANSPOSED),
        ("transformer.h.{i}.mlp.c_proj.{p}", "model.layers.{i}.mlp.down_proj.{p}", TRANSPOSED),
        ("lm_head.weight", "lm_head.weight", COPY),  # untied GPT-2 heads only (a tied one is not loaded)
    ],
}
# checkpoint tensors that are no weights of ours: RoPE and causal-mask buffers old checkpoints saved
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias|attn\.bias|attn\.masked_bias)")
_FIELDS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)", "x": r"(?P<x>[qkv])"}


def _regex(template: str) -> re.Pattern:
    out = re.escape(template)
    for k, v in _FIELDS.items():
        out = out.replace(re.escape("{" + k + "}"), v)
    return re.compile(out)


_COMPILED = {mt: [(_regex(hf), _regex(ours), hf, ours, kind) for hf, ours, kind in rules]
             for mt, rules in _RULES.items()}


# Gemma's RMSNorm scales by 1 + w: its stored w is our weight minus one (every norm, q/k norms too)
_PLUS_ONE = re.compile(r".*norm\.weight")


def is_mapped(model_type: str) -> bool:
    """Whether this family's checkpoints need a map (else names and shapes are ours)."""
    return model_type in _RULES or model_type == "gemma3_text"


def to_ours(cfg, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """Our (name, tensor) pairs for checkpoint tensor `name` of a `cfg.model_type` model: [] for a
    buffer to skip, None for a name the family's layout does not know. A fused tensor whose size
    the config contradicts raises ValueError naming it."""
    mt = cfg.model_type
    if mt == "gemma3_text" and _PLUS_ONE.fullmatch(name):
        return [(name, t.float() + 1)]  # in fp32: 1 + w rounded once, to the dtype the model loads in
    if mt not in _RULES:
        return [] if name.endswith("rotary_emb.inv_freq") else [(name, t)]
    if mt == "gpt2" and name.startswith(("wte.", "wpe.", "ln_f.", "h.")):
        name = "transformer." + name  # the hub's original GPT-2 files have no prefix
    for hf_re, _, _, ours, kind in _COMPILED[mt]:
        m = hf_re.fullmatch(name)
        if m is None:
            continue
        f = m.groupdict()
        if kind == COPY:
            return [(ours.format(**f), t)]
        if kind == TRANSPOSED:
            return [(ours.format(**f), t.t().contiguous() if t.dim() == 2 else t)]
        return [(ours.format(**f, x=x), part) for x, part in zip("qkv", _split_qkv(cfg, name, t, kind))]
    return [] if _IGNORED.fullmatch(name) else None


def _split_qkv(cfg, name: str, t: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """q, k, v (each (H*hd, D), or (H*hd,) for a bias) of a fused checkpoint tensor."""
    H, hd, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    want = (3 * H * hd, D) if kind == QKV_HEADS else (D, 3 * H * hd)
    want = want if t.dim() == 2 else (3 * H * hd,)
    if tuple(t.shape) != want:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, config.json implies {want}")
    if kind == QKV_COLUMNS:  # Conv1D (D, 3D): q | k | v along the output columns
        w = t.t() if t.dim() == 2 else t
        return [p.contiguous() for p in w.chunk(3, dim=0)]
    per_head = t.view(H, 3, hd, *t.shape[1:])  # rows ordered (head, q|k|v, dim)
    return [per_head[:, j].reshape(H * hd, *t.shape[1:]).contiguous() for j in range(3)]


def to_hf(cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> the checkpoint names and layouts transformers writes for `cfg.model_type`
    (the same dict for Llama-shaped families). A tied head is the caller's to drop first."""
    mt = cfg.model_type
    if mt == "gemma3_text":
        return {k: (t.float() - 1).to(t.dtype) if _PLUS_ONE.fullmatch(k) else t for k, t in state.items()}
    if mt not in _RULES:
        return dict(state)
    out, fused = {}, {}
    for key, t in state.items():
        for _, our_re, hf, _, kind in _COMPILED[mt]:
            m = our_re.fullmatch(key)
            if m is None:
                continue
            f = m.groupdict()
            name = hf.format(**{k: v for k, v in f.items() if k != "x"})
            if kind == COPY:
                out[name] = t
            elif kind == TRANSPOSED:
                out[name] = t.t().contiguous() if t.dim() == 2 else t
            else:
                fused.setdefault(name, {})[f["x"]] = t
            break
        else:
            raise ValueError(f"{mt}: no checkpoint name for tensor {key!r}")
    for name, parts in fused.items():
        q, k, v = (parts[x] for x in "qkv")
        if name.endswith("query_key_value.weight") or name.endswith("query_key_value.bias"):
            H, hd = cfg.num_attention_heads, cfg.head_dim
            out[name] = torch.stack([p.view(H, hd, *p.shape[1:]) for p in (q, k, v)], 1).reshape(-1, *q.shape[1:])
        else:
            w = torch.cat([q, k, v], 0)
            out[name] = w.t().contiguous() if w.dim() == 2 else w
    return out


def hf_module(cfg, name: str) -> tuple[str, str, str | None]:
    """The transformers module holding our projection `name` (e.g. model.layers.0.self_attn.q_proj),
    how its weight is stored there (COPY, TRANSPOSED, QKV_HEADS, QKV_COLUMNS) and, in a fused one,
    which of q, k, v ours is (else None). LoRA adapters are named by it (peft_io.py)."""
    mt = cfg.model_type
    if mt not in _RULES:
        return name, COPY, None
    for _, our_re, hf, _, kind in _COMPILED[mt]:
        m = our_re.fullmatch(name + ".weight")
        if m is not None:
            f = {k: v for k, v in m.groupdict().items() if k not in ("x", "p")}
            return hf.format(**f, p="weight")[:-len(".weight")], kind, m.groupdict().get("x")
    raise ValueError(f"{mt}: no checkpoint module for {name!r}")


def hf_config(cfg) -> dict:
    """A config.json dict for a GPT-NeoX or GPT-2 model built from a `ModelConfig` alone (tests,
    benchmarks): the keys transformers' config class of that type reads."""
    if cfg.model_type not in ("gpt2", "gpt_neox"):
        raise ValueError(f"{cfg.model_type}: build the model from its config.json to save it")
    if cfg.model_type == "gpt2":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "silu": "silu"}[cfg.hidden_act]
        return {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_hidden_layers, "n_head": cfg.num_attention_heads, "n_inner": cfg.intermediate_size,
                "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.rms_norm_eps,
                "activation_function": act, "tie_word_embeddings": cfg.tie_word_embeddings}
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "silu": "silu"}[cfg.hidden_act]
    return {"model_type": "gpt_neox", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "layer_norm_eps": cfg.rms_norm_eps,
            "rotary_pct": cfg.partial_rotary_factor, "rotary_emb_base": cfg.rope_theta,
            "use_parallel_residual": cfg.parallel_residual, "hidden_act": act, "attention_bias": cfg.qkv_bias,
            "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings}
