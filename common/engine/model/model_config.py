"""`ModelConfig`: what the one decoder of `common/engine/model/transformer.py` is configured by, and its
translation from a Hugging Face config.json dict.

Every supported family is a setting of the same decoder, not a copy of it:
  Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral (no sliding window), Qwen2/2.5 (q/k/v
    bias), Qwen3 (per-head q/k RMSNorm): RMSNorm, sequential residual, full RoPE, gated SiLU MLP;
  GPT-NeoX (Pythia): LayerNorm with bias, parallel residual (`use_parallel_residual`), RoPE on the
    first `rotary_pct` of each head's dims, GELU (exact) MLP with biases, untied `embed_out`;
  GPT-2: LayerNorm with bias, sequential residual, learned absolute positions (`wpe`, a hard
    limit of n_positions), tanh GELU MLP with biases, tied embeddings;
  Gemma 3 (text): RMSNorm with the +1 weight, sandwich norms, q/k norms, GeGLU (tanh), embeddings
    scaled by sqrt(hidden), local sliding-window layers (own RoPE base) between global ones, run
    while a sequence fits the window (exact there; longer ones are refused).
Their checkpoints' names and fused layouts are mapped to our module names by
`common/engine/checkpoints/hf_layouts.py`. Anything else is refused here, with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt2", "gemma3_text")
# Hugging Face activation names -> ours (tanh GELU under its several names; the formulas agree)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


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
    rms_norm_eps: float = 1e-5          # epsilon of every norm (RMSNorm or LayerNorm)
    rope_theta: float = 10000.0         # RoPE base
    rope_scaling: dict | None = None    # llama3 scaling parameters (rope_type="llama3"), else None
    tie_word_embeddings: bool = False   # lm_head shares the embedding matrix
    qkv_bias: bool = False              # bias on q/k/v projections (Qwen2, Llama attention_bias, GPT-NeoX, GPT-2)
    o_bias: bool = False                # bias on the output projection (Llama attention_bias, GPT-NeoX, GPT-2)
    mlp_bias: bool = False              # bias on the MLP projections (Llama mlp_bias, GPT-NeoX, GPT-2)
    qk_norm: bool = False               # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 8192  # longest position the checkpoint was trained for (a hard limit with learned positions)
    norm: str = "rms"                   # "rms" (RMSNorm) or "layer" (LayerNorm with bias: GPT-NeoX, GPT-2)
    parallel_residual: bool = False     # x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX) instead of two residual steps
    positions: str = "rope"             # "rope" (rotary) or "learned" (absolute position embeddings added to the input: GPT-2)
    partial_rotary_factor: float = 1.0  # share of each head's dims that RoPE rotates, the rest pass (GPT-NeoX rotary_pct)
    gated_mlp: bool = True              # down(act(gate(x)) * up(x)) (Llama) or down(act(up(x))) (GPT-NeoX, GPT-2)
    hidden_act: str = "silu"            # MLP activation: "silu", "gelu" (exact, erf) or "gelu_tanh" (GPT-2's gelu_new)
    sandwich_norms: bool = False        # norms on the attention and MLP outputs too, before each residual add (Gemma 3)
    embed_scale: float = 1.0            # token embeddings times this (Gemma: sqrt(hidden_size))
    sliding_window: int | None = None   # window of the local layers (Gemma 3): exact below it, longer sequences refused
    local_layers: tuple = ()            # indices of the sliding-window layers, whose RoPE base is rope_local_theta
    rope_local_theta: float = 10000.0   # RoPE base of the local layers

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; NeoX's rotate-half within them)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Translate a Hugging Face config.json dict, refusing what we do not implement."""
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture model_type={mt!r} (architectures="
                             f"{hf.get('architectures')}); supported: {SUPPORTED_MODEL_TYPES}")
        if mt == "gpt2":
            return _gpt2(hf)
        if mt == "gemma3_text":
            return _gemma3(hf)
        if mt == "mistral" and hf.get("sliding_window") not in (None, 0):
            # Sliding-window attention is not implemented; exact only below the window.
            if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
                raise ValueError(f"mistral sliding_window={hf['sliding_window']} is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{mt}: use_sliding_window=True is not supported")
        # transformers >= 5 nests RoPE settings in rope_parameters; older configs use
        # top-level rope_theta + rope_scaling (GPT-NeoX: rotary_emb_base, rotary_pct).
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get(
            "rotary_pct", 0.25 if mt == "gpt_neox" else 1.0)))  # transformers' GPT-NeoX default is 0.25
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type={rtype!r}; supported: default, llama3")
        H, D = hf["num_attention_heads"], hf["hidden_size"]
        hd = hf.get("head_dim") or D // H
        if int(hd * partial) % 2:
            raise ValueError(f"{mt}: partial_rotary_factor={partial} of head_dim={hd} rotates an odd number of dims")
        act = ACTIVATIONS.get(hf.get("hidden_act", "silu"))
        if act is None:
            raise ValueError(f"{mt}: hidden_act={hf.get('hidden_act')!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        common = dict(model_type=mt, vocab_size=hf["vocab_size"], hidden_size=D,
                      intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
                      num_attention_heads=H, head_dim=hd, rope_theta=float(theta), partial_rotary_factor=float(partial),
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), hidden_act=act,
                      max_position_embeddings=hf.get("max_position_embeddings", 8192))
        if mt == "gpt_neox":
            if rtype != "default":
                raise ValueError(f"gpt_neox: rope_type={rtype!r} is not supported; supported: default")
            b = bool(hf.get("attention_bias", True))
            return cls(**common, num_key_value_heads=H, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), norm="layer",
                       parallel_residual=bool(hf.get("use_parallel_residual", True)), qkv_bias=b, o_bias=b,
                       mlp_bias=True, gated_mlp=False)
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            **common, num_key_value_heads=hf.get("num_key_value_heads") or H,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_scaling=rope if rtype == "llama3" else None,
            qkv_bias=(mt == "qwen2") or attn_bias, o_bias=attn_bias and mt in ("llama", "qwen3"),
            mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=(mt == "qwen3"),
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _gpt2(hf: dict) -> ModelConfig:
    """GPT-2's config.json (n_embd, n_layer, n_head, n_positions, ...): what changes its forward pass
    beyond the common settings is refused."""
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("gpt2: attention scaled other than by 1/sqrt(head_dim) (scale_attn_weights=False or "
                         "scale_attn_by_inverse_layer_idx=True) is not supported")
    if hf.get("add_cross_attention", False):
        raise ValueError("gpt2: add_cross_attention=True (an encoder-decoder setup) is not supported")
    act = ACTIVATIONS.get(hf.get("activation_function", "gelu_new"))
    if act is None:
        raise ValueError(f"gpt2: activation_function={hf.get('activation_function')!r} is not supported; "
                         f"supported: {sorted(ACTIVATIONS)}")
    D, H = hf["n_embd"], hf["n_head"]
    return ModelConfig(model_type="gpt2", vocab_size=hf["vocab_size"], hidden_size=D,
                       intermediate_size=hf.get("n_inner") or 4 * D, num_hidden_layers=hf["n_layer"],
                       num_attention_heads=H, num_key_value_heads=H, head_dim=D // H,
                       rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), qkv_bias=True, o_bias=True,
                       mlp_bias=True, max_position_embeddings=hf.get("n_positions", 1024), norm="layer",
                       positions="learned", gated_mlp=False, hidden_act=act)


def _gemma3(hf: dict) -> ModelConfig:
    """Gemma 3's text model: RMSNorm whose stored weight w scales by 1 + w (mapped at load,
    `hf_layouts.py`), sandwich norms, q/k norms, GeGLU (tanh), embeddings times sqrt(hidden), and
    sliding-window local layers (their own RoPE base) between global ones. The local layers are
    exact while a sequence fits their window, so that is the longest sequence run; the rest is refused."""
    H, D = hf["num_attention_heads"], hf["hidden_size"]
    hd = hf.get("head_dim") or D // H
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"gemma3_text: {key}={hf[key]} (logit soft-capping) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text: use_bidirectional_attention=True (an encoder) is not supported")
    if hf.get("query_pre_attn_scalar", hd) != hd:
        raise ValueError(f"gemma3_text: query_pre_attn_scalar={hf['query_pre_attn_scalar']} differs from head_dim={hd}: "
                         f"attention scaled other than by 1/sqrt(head_dim) is not supported")
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0
                                      else "sliding_attention" for i in range(L)]
    rope = hf.get("rope_parameters") or {}
    full = rope.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
    local = rope.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    for kind, r in (("full_attention", full), ("sliding_attention", local)):
        if r.get("rope_type", r.get("type", "default")) != "default":
            raise ValueError(f"gemma3_text: {kind} rope_type={r.get('rope_type', r.get('type'))!r} is not supported; "
                             f"supported: default")
    act = ACTIVATIONS.get(hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act is None:
        raise ValueError(f"gemma3_text: hidden_activation={hf.get('hidden_activation')!r} is not supported")
    local_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return ModelConfig(model_type="gemma3_text", vocab_size=hf["vocab_size"], hidden_size=D,
                       intermediate_size=hf["intermediate_size"], num_hidden_layers=L, num_attention_heads=H,
                       num_key_value_heads=hf.get("num_key_value_heads") or H, head_dim=hd,
                       rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(full.get("rope_theta", 1e6)),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                       qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)),
                       qk_norm=True, max_position_embeddings=hf.get("max_position_embeddings", 131072), hidden_act=act,
                       sandwich_norms=True, embed_scale=float(D) ** 0.5,
                       sliding_window=hf.get("sliding_window") if local_layers else None, local_layers=local_layers,
                       rope_local_theta=float(local.get("rope_theta", 1e4)))
