"""Writing complete Hugging Face model directories: what transformers, vLLM and TRL load.

Runs wherever a model is saved: the trainer (every checkpoint and the final model), the
default model's one-time conversion (`common/engine/checkpoints/hf_io.py`), tests. A directory holds
  config.json             built through transformers' own config class for the model type, so
                          it holds exactly the fields transformers writes itself, with
                          `architectures` = the *ForCausalLM class (vLLM and TRL pick the model
                          class from it) and `dtype`;
  generation_config.json  bos / pad, EOS = every stop token the project samples with (the chat
                          template's end-of-turn included), and, for a trained policy, the
                          sampling settings it was trained at (its distribution is
                          softmax(logits / T), so T is part of the policy);
  model.safetensors       or shards + model.safetensors.index.json, under the names and in the
                          layouts of the model type (`common/engine/checkpoints/hf_layouts.py`: GPT-NeoX's
                          fused query_key_value, GPT-2's transposed Conv1D weights);
  tokenizer files and the chat template, when a tokenizer is given.
`repair_hf_dir` brings a directory written before this (architectures null, stray classifier
fields, no generation config) up to date in place; `load_model` runs it on the default
model's cache entry.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from common.engine.checkpoints.hf_layouts import hf_config, is_mapped, to_hf

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gpt_neox": "GPTNeoXForCausalLM", "gpt2": "GPT2LMHeadModel", "gemma3_text": "Gemma3ForCausalLM"}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>")  # chat templates' turn ends
_NOT_CONFIG = ("quantization_config", "torch_dtype", "dtype", "architectures", "transformers_version")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def complete_config(d: dict, dtype: str) -> dict:
    """A config.json dict as transformers writes it, from any config dict of a supported type:
    private keys (`_name_or_path`), quantisation leftovers and fields equal to the base
    class's defaults (e.g. a classification head's id2label) are dropped; `architectures` set."""
    from transformers import AutoConfig  # lazy: slow import
    d = {k: v for k, v in d.items() if not k.startswith("_") and k not in _NOT_CONFIG}
    mt = d.pop("model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(f"cannot write a config for model_type={mt!r}; supported: {tuple(ARCHITECTURES)}")
    cfg = AutoConfig.for_model(mt, **d)
    cfg.architectures = [ARCHITECTURES[mt]]
    cfg.dtype = dtype
    return json.loads(cfg.to_json_string(use_diff=True))


def model_config_dict(model) -> dict:
    """The model's original config dict when it was loaded from one, else one built from cfg."""
    c = model.cfg
    if model.hf_config:
        return dict(model.hf_config)
    if is_mapped(c.model_type):
        return hf_config(c)
    d = {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
         "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
         "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
         "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
         "tie_word_embeddings": c.tie_word_embeddings, "max_position_embeddings": c.max_position_embeddings,
         "hidden_act": "silu", "mlp_bias": c.mlp_bias}
    if c.model_type in ("llama", "qwen3"):
        d["attention_bias"] = c.o_bias
    if c.rope_scaling:
        d["rope_scaling"] = dict(c.rope_scaling)
    return d


def tokenizer_stop_ids(tokenizer) -> tuple[int, ...]:
    """EOS and the chat template's end-of-turn tokens the tokenizer knows (sorted, unique)."""
    ids = {tokenizer.eos_token_id}
    for t in END_OF_TURN:
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return tuple(sorted(i for i in ids if i is not None))


def generation_config(cfg: dict, stop_token_ids=(), sampling: dict | None = None) -> dict:
    """generation_config.json: special tokens from `cfg`, EOS widened to `stop_token_ids`, and
    `sampling` (temperature, top_p, top_k) when given (do_sample on; greedy otherwise)."""
    from transformers import GenerationConfig  # lazy: slow import
    eos = cfg.get("eos_token_id")
    eos = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    eos += [int(i) for i in stop_token_ids if int(i) not in eos]
    g = GenerationConfig(bos_token_id=cfg.get("bos_token_id"), pad_token_id=cfg.get("pad_token_id", eos[0] if eos else None),
                         eos_token_id=(eos[0] if len(eos) == 1 else eos) or None)
    if sampling and sampling.get("temperature", 0) > 0:
        g.do_sample, g.temperature = True, float(sampling["temperature"])
        g.top_p, g.top_k = float(sampling.get("top_p", 1.0)), int(sampling.get("top_k", 0)) or None
    return g.to_diff_dict()


def save_pretrained(model, path, max_shard_bytes: int = 5 * 2**30, tokenizer=None, stop_token_ids=(),
                    sampling: dict | None = None) -> None:
    """Write a complete model directory (module docstring) into `path`. Stop tokens: the given
    ones plus, with a tokenizer, its EOS and end-of-turn tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # LoRA adapters are no weights of the base: a model with adapters saves its base (inside
    # `lora.merged(model)`, the merged weights); the adapters go to peft_io.save_adapter
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if ".lora." not in k}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses aliased tensors; HF re-ties on load
    state = to_hf(model.cfg, state)  # the family's own names and fused layouts (hf_layouts.py)
    shards, cur, size = [], {}, 0
    for k, v in state.items():
        nb = v.numel() * v.element_size()
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + nb
    shards.append(cur)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, sh in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(path / name), metadata=meta)
            weight_map.update({k: name for k in sh})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = complete_config(model_config_dict(model), str(model.dtype).replace("torch.", ""))
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
        stop_token_ids = tuple(stop_token_ids) + tokenizer_stop_ids(tokenizer)
    gen = generation_config(cfg, stop_token_ids, sampling)
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def repair_hf_dir(path) -> bool:
    """Complete an existing model directory in place (config.json as transformers writes it,
    generation_config.json from the config and the tokenizer's stop tokens). Returns True if
    anything was rewritten; a complete directory is left untouched."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    changed = False
    if not cfg.get("architectures") or any(k.startswith("_") or k in ("id2label", "torch_dtype") for k in cfg):
        cfg = complete_config(cfg, cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        _atomic_write(path / "config.json", json.dumps(cfg, indent=2) + "\n")
        changed = True
    if not (path / "generation_config.json").exists():
        stops = ()
        if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer  # lazy: slow import
            stops = tokenizer_stop_ids(AutoTokenizer.from_pretrained(str(path)))
        _atomic_write(path / "generation_config.json", json.dumps(generation_config(cfg, stops), indent=2) + "\n")
        changed = True
    if changed:
        print(f"[asyncrl] completed the Hugging Face files of {path} (architectures, generation_config.json)")
    return changed
