"""common/engine/checkpoints/tiny_model.py: the tiny random model of the default architecture (`--model=tiny`),
built locally, loadable by us and by transformers, the same for the same seed."""
from __future__ import annotations

import json

import torch

from common.engine.checkpoints import hf_io
from common.engine.checkpoints.hf_io import load_model, resolve_checkpoint
from common.engine.checkpoints.tiny_model import SHAPE, build_tiny
from tests.tiny import save_hf, tokenizer


def test_build_tiny_writes_a_complete_directory_transformers_loads(tmp_path):
    state = torch.random.get_rng_state()
    d = build_tiny(tmp_path / "m", vocab_size=97, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's seeded RNG is left alone
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert {k: cfg[k] for k in SHAPE} == SHAPE and cfg["vocab_size"] == 97
    ours, tok = load_model(str(d))
    assert tok is None  # no base directory: no tokenizer, rewards see token ids
    w = ours.model.embed_tokens.weight
    assert abs(w.std().item() - 0.02) < 0.002  # transformers' Llama initialisation
    import transformers  # lazy: slow import, this test only
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    x = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        assert torch.allclose(ours(x), hf(x).logits, atol=1e-5)
    (tmp_path / "again").mkdir()  # an empty folder made for it (tempfile.mkdtemp) is filled
    again = load_model(str(build_tiny(tmp_path / "again", vocab_size=97, seed=3)), tokenizer=False)[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def test_tiny_resolves_to_one_build_with_the_default_models_tokenizer(tmp_path, monkeypatch):
    """`--model=tiny`: built once in the cache from the default model's config and tokenizer (a
    stand-in default model here, so the test needs no conversion), then found there."""
    base = tmp_path / "default"
    save_hf("llama_tied", base)
    tokenizer().save_pretrained(base)
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the machine's Hugging Face cache plays no part either

    def no_snapshot(*a, **k):
        raise FileNotFoundError("not in this test's Hugging Face cache")
    monkeypatch.setattr(hf_io, "_snapshot", no_snapshot)
    monkeypatch.setattr(hf_io, "default_model_dir", lambda name=None: base)
    d = resolve_checkpoint("tiny")
    assert d.parent == tmp_path / "cache" / "models"
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint("tiny") == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    model, tok = load_model("tiny")
    assert tok is not None and len(tok) == 97 and model.cfg.vocab_size == 97
    assert model.cfg.hidden_size == SHAPE["hidden_size"] and model.cfg.num_hidden_layers == SHAPE["num_hidden_layers"]
    assert tok.chat_template  # the base's chat template came along
