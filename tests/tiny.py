"""Tiny random Hugging Face checkpoints for tests (built locally, never downloaded)."""
from __future__ import annotations

import torch

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (transformers config class name, extra kwargs)
ARCHS = {
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "llama3_untied": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=500000.0,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, head_dim=8)),
    "qwen2_bias": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3_qknorm": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16, use_sliding_window=False)),
}


_SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_NEOX = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, **_SPECIAL)
# the other families, each with its own config keys: name -> (config class name, kwargs)
FAMILIES = {
    # GPT-NeoX (Pythia): parallel residual with rotary on a quarter of each head (4 of 16 dims), as Pythia
    "neox_parallel_rot25": ("GPTNeoXConfig", dict(_NEOX, use_parallel_residual=True, rotary_pct=0.25)),
    "neox_sequential_rot100": ("GPTNeoXConfig", dict(_NEOX, use_parallel_residual=False, rotary_pct=1.0)),
    # GPT-2: learned positions, tied head; 64 positions so that the limit is reachable in a test
    "gpt2": ("GPT2Config", dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, **_SPECIAL)),
    # Gemma 3 (text): two local layers (RoPE base 10) around a global one (base 10,000), 64-token window
    "gemma3": ("Gemma3TextConfig", dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                        sliding_window=64, max_position_embeddings=256,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                         "full_attention": {"rope_type": "default", "rope_theta": 1e4}},
                                        **_SPECIAL)),
}


def hf_model(arch: str, seed: int = 0):
    """A random transformers model of the named tiny architecture (ARCHS or FAMILIES), fp32, eval mode."""
    import transformers
    cls_name, extra = FAMILIES[arch] if arch in FAMILIES else ARCHS[arch]
    cfg = getattr(transformers, cls_name)(**(extra if arch in FAMILIES else {**BASE, **extra}))
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # biases init to zero and norms to one by default: make them matter
        for n, p in m.named_parameters():
            if n.endswith("bias") or "norm" in n or ".ln_" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m


def save_hf(arch: str, path, seed: int = 0):
    m = hf_model(arch, seed)
    m.save_pretrained(path)
    return m


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def tokenizer(vocab_size: int = BASE["vocab_size"]):
    """A word-level tokenizer over the tiny vocabulary: ids 0 <pad>, 1 <|im_start|> (bos),
    2 <|im_end|> (eos, end of turn), then words "w3".."w{V-1}"; with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(3, vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
