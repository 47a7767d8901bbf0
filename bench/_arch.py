"""Random models of a published model's shape for the benchmarks (`--arch`): the engine's speed on
another family, measured on the same work as the default model's figures, nothing downloaded.

transformers builds the model from its config class with its own random initialisation, once, into
`$ASYNCRL_CACHE/bench_models/<name>` (later runs reuse it). Such a model has no tokenizer: the
sampler benchmark tokenises its prompts with the default model's (SmolLM2's 49,152 ids fit every
shape here), so prompts and lengths are the default model's workload.
"""
from __future__ import annotations

import argparse

import torch

from common.engine.hf_io import DEFAULT_MODEL, cache_root, has_tokenizer, load_tokenizer, resolve_checkpoint

# name -> (transformers config class, its kwargs): the published configs' shapes
SHAPES = {
    "pythia-160m": ("GPTNeoXConfig", dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                          intermediate_size=3072, max_position_embeddings=2048, rotary_pct=0.25,
                                          rotary_emb_base=10000, use_parallel_residual=True, hidden_act="gelu",
                                          layer_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "gpt2-124m": ("GPT2Config", dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                                     bos_token_id=50256, eos_token_id=50256)),
}


def add_arch_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arch", choices=sorted(SHAPES), default=None,
                    help="instead of --model: a random model of this published shape, built locally (bench/_arch.py)")


def arch_dir(name: str) -> str:
    """The checkpoint directory of a random `name`-shaped model (built on first use)."""
    import transformers  # lazy: slow import, benchmarks with --arch only
    d = cache_root() / "bench_models" / name
    if not (d / "config.json").exists():
        cls, kw = SHAPES[name]
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw), dtype=torch.float32)
        tmp = d.with_name(d.name + ".tmp")
        m.save_pretrained(tmp)
        tmp.rename(d)
    return str(d)


def prompt_tokenizer(model: str):
    """The model's tokenizer, or the default model's for a random model without one."""
    path = resolve_checkpoint(model)
    return load_tokenizer(path if has_tokenizer(path) else resolve_checkpoint(DEFAULT_MODEL))
