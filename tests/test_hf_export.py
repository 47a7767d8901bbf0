"""What we write, the ecosystem loads: complete Hugging Face directories for every architecture.

Per architecture: save through our writer, check config.json (architectures, no stray fields)
and generation_config.json, load with AutoModelForCausalLM (same logits), and generate through
`transformers.pipeline("text-generation")` with the saved generation config (same greedy tokens
as our sampler, stopping at the saved EOS). Plus the repair of a directory written before.
"""
import json

import pytest
import torch

from common.engine.checkpoints.hf_io import load_model
from common.engine.checkpoints.hf_save import ARCHITECTURES, repair_hf_dir, save_pretrained
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from tests.tiny import ARCHS, CHAT_TEMPLATE, save_hf, tokenizer

STRAY = ("id2label", "label2id", "problem_type", "_name_or_path", "torch_dtype", "quantization_config")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_saved_directory_loads_and_generates_in_transformers(arch, tmp_path):
    import transformers
    save_hf(arch, tmp_path / "src")
    ours, _ = load_model(str(tmp_path / "src"), tokenizer=False)
    with torch.no_grad():  # trained weights, so transformers must read ours
        for p in ours.parameters():
            p.add_(0.02 * torch.randn_like(p))
    tok = tokenizer()
    out = tmp_path / "out"
    save_pretrained(ours, out, tokenizer=tok, stop_token_ids=(7,), sampling={"temperature": 0.7, "top_p": 0.9})

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURES[ours.cfg.model_type]] and cfg["dtype"] == "float32"
    assert not [k for k in cfg if k in STRAY or k.startswith("_")]
    gen = json.loads((out / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [2, 7] and gen["bos_token_id"] == 1 and gen["pad_token_id"] == 0
    assert gen["do_sample"] is True and gen["temperature"] == 0.7 and gen["top_p"] == 0.9
    assert transformers.AutoTokenizer.from_pretrained(str(out)).chat_template == CHAT_TEMPLATE  # template saved

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCHITECTURES[ours.cfg.model_type]
    x = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=1e-4)

    # the tokenizer object is passed in because transformers maps model_type qwen2 to its BPE
    # tokenizer class, which cannot rebuild our tiny word-level one (real checkpoints are BPE)
    pipe = transformers.pipeline("text-generation", model=str(out), tokenizer=tok, dtype=torch.float32)
    assert pipe.model.generation_config.eos_token_id == gen["eos_token_id"]
    prompt = "w5 w17 w33 w40"
    got = pipe(prompt, max_new_tokens=24, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    want = Sampler(ours, max_batch=1, max_seq_len=64).generate(
        [ids], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(2, 7)))[0]
    assert got[len(ids):] == want.tokens  # greedy agrees, and stops at the same saved EOS


def test_repair_completes_an_old_directory_once(tmp_path):
    import transformers
    save_hf("llama_tied", tmp_path)
    tokenizer().save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    # what the first conversion of the default model wrote: no architectures, classifier fields
    cfg.update(architectures=None, id2label={"0": "LABEL_0", "1": "LABEL_1"}, label2id={"LABEL_0": 0, "LABEL_1": 1},
               problem_type=None, _model_name_or_path="Smollm2", torch_dtype="float32")
    cfg.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    assert repair_hf_dir(tmp_path) is True
    fixed = json.loads((tmp_path / "config.json").read_text())
    assert fixed["architectures"] == ["LlamaForCausalLM"] and not [k for k in fixed if k in STRAY]
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2
    assert repair_hf_dir(tmp_path) is False  # complete now: left alone
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(m).__name__ == "LlamaForCausalLM"
    ours, _ = load_model(str(tmp_path), tokenizer=False)  # and we still read it
    assert ours.cfg.tie_word_embeddings
