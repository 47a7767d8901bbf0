"""A tiny random model of the default architecture, for trying things in seconds: `--model=tiny`.

Runs wherever a model is resolved: `hf_io.resolve_checkpoint("tiny")` builds it once (about a
second, after the default model's one-time conversion, whose config and tokenizer it takes) into
the model cache (~/.cache/asyncrl/models/), never downloads anything, and every later process
finds it there. Benchmarks build their own with `build_tiny` (no tokenizer, a small vocabulary).

What it is: SmolLM2-135M-Instruct's architecture (Llama: tied embeddings, grouped-query
attention, RoPE theta 1e5), its tokenizer, vocabulary and chat template, at width 64 with 2
layers (3.3M parameters, 3.1M of them the 49,152 x 64 embedding), every weight drawn from
N(0, 0.02) with a fixed seed (norms 1), as transformers initialises a Llama. It has learnt
nothing: its completions are near-uniform random tokens that run to `gen.max_new_tokens`, its
rewards are ~0. It is for seeing a whole run (logs, checkpoints, evaluation, plots, a notebook)
in under a minute and for checking code, never for results.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from common.engine.checkpoints.hf_save import save_pretrained
from common.engine.model.transformer import Transformer
from common.engine.model.model_config import ModelConfig

TINY = "tiny"  # the name `--model` / `load_model` take for it
SHAPE = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
# SmolLM2-135M's config.json less its sizes: the architecture when no base directory is given
BASE = {"model_type": "llama", "vocab_size": 49152, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "attention_bias": False, "mlp_bias": False}
INIT_STD = 0.02


def tiny_dir_name(seed: int = 0, **shape) -> str:
    """The cache entry's name: the shape and seed it was built with."""
    s = {**SHAPE, **shape}
    return f"tiny-smollm2-d{s['hidden_size']}-l{s['num_hidden_layers']}-seed{seed}"


def build_tiny(out_dir, base_dir=None, vocab_size: int | None = None, seed: int = 0, **shape) -> Path:
    """Write a random model of the default architecture at `SHAPE` (or `shape`'s sizes) as a
    complete Hugging Face directory at `out_dir`, atomically; returns it. `base_dir`: a model
    directory whose config (less its sizes) and tokenizer it takes (the default model's, for
    `--model=tiny`); without one, `BASE` and no tokenizer (a reward then sees token ids).
    `vocab_size` overrides the vocabulary (without a tokenizer: e.g. 97 for a toy task)."""
    cfg = dict(BASE)
    tok = None
    if base_dir is not None:
        cfg = {k: v for k, v in json.loads((Path(base_dir) / "config.json").read_text()).items()
               if k not in ("architectures", "dtype", "torch_dtype", "transformers_version")}
        from transformers import AutoTokenizer  # lazy: slow import, needed once per build
        tok = AutoTokenizer.from_pretrained(str(base_dir))
    cfg.update(SHAPE, **shape)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # the modules' own init draws from the global RNG: leave it as it was
        model = Transformer(ModelConfig.from_hf(cfg), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=g)
    model.tie_weights()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        save_pretrained(model, tmp, tokenizer=tok)
        if (out / "config.json").exists():  # another process built it meanwhile: keep theirs
            shutil.rmtree(tmp)
        else:
            if out.is_dir():
                out.rmdir()  # an empty folder made for it (a non-empty one is an error, never overwritten)
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
