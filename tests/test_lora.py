"""LoRA (common/engine/model/lora.py, common/engine/checkpoints/peft_io.py, `--train.lora.*`): fresh
adapters are the base and alone train; the base with the adapters off, and merged, are what they say,
the weights restored bit for bit; PEFT loads our adapters onto transformers' model with our logits
(Llama, Qwen2, Qwen3, GPT-NeoX's fused qkv, GPT-2's Conv1D) and we read PEFT's; a generator folds the
published adapters into its base and swaps the base back for a reference pass; a run trains, publishes
and checkpoints adapters and resumes; the memory plan knows LoRA; what is not supported is refused."""
import json

import pytest
import torch

import run_gsm8k
from common.contracts.config import ConfigError
from common.engine.checkpoints.hf_io import load_model
from common.engine.checkpoints.peft_io import attach_lora, load_adapter, save_adapter
from common.engine.model.lora import LoRAConfig, Merger, adapter_state, adapters, adapters_off, add_lora, merged
from common.plan.preflight import plan_of
from common.runtime.shared.weights import WeightStore
from common.runtime.step import make_optimizer
from tests import tiny

TOKENS = torch.tensor([[5, 9, 17, 3, 44, 60, 21, 8], [7, 7, 30, 12, 2, 90, 15, 33]])
ALL = ("attn", "mlp")


def _model(tmp_path, arch="llama_tied", seed=0):
    d = tmp_path / arch
    if not d.exists():
        tiny.save_hf(arch, d, seed=seed)
    return load_model(str(d), tokenizer=False)[0].float(), d


def _randomise(model, seed=1):
    """Adapters that change the model (B is 0 at the start)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, a in adapters(model).values():
            a.B.copy_(torch.randn(a.B.shape, generator=g) * 0.2)
            a.A.copy_(torch.randn(a.A.shape, generator=g) * 0.2)


def _logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens).float()


def test_fresh_adapters_are_the_base_and_alone_train(tmp_path):
    model, _ = _model(tmp_path)
    base = _logits(model)
    names = add_lora(model, LoRAConfig(rank=4, targets=ALL))
    assert len(names) == 2 * 7 and model.model.layers[0].mlp.unfused  # 2 layers x 7 projections
    assert torch.equal(_logits(model), base)  # B = 0
    model.train()
    _randomise(model)
    model(TOKENS).float().logsumexp(-1).mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == set(adapter_state(model)) and len(trained) == 2 * len(names)
    opt = make_optimizer(model, 1e-3, 0.0)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trained)
    opt.step()
    assert set(opt.state) == {p for p in model.parameters() if p.requires_grad}  # state for the adapters only


def test_adapters_off_is_the_base_and_merged_is_the_adapted_model(tmp_path):
    model, _ = _model(tmp_path)
    base = _logits(model)
    add_lora(model, LoRAConfig(rank=4, alpha=8, targets=ALL))
    _randomise(model)
    adapted = _logits(model)
    assert (adapted - base).abs().max() > 1e-2
    with adapters_off(model):
        assert torch.equal(_logits(model), base)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with merged(model):
        assert torch.allclose(_logits(model), adapted, atol=1e-5, rtol=1e-5)  # W + (alpha / r) B A
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # restored bit for bit
    assert torch.equal(_logits(model), adapted)


PEFT_TARGETS = {"llama_tied": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "qwen2_bias": ["q_proj", "v_proj", "up_proj"], "qwen3_qknorm": ["q_proj", "k_proj", "down_proj"],
                "neox_parallel_rot25": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                "gpt2": ["c_attn", "c_proj", "c_fc"]}


def _hf(arch, d):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def _close(ours, theirs):
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-5 * scale, float((ours - theirs).abs().max() / scale)


@pytest.mark.parametrize("arch", list(PEFT_TARGETS))
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ALL])
def test_peft_loads_our_adapters_with_our_logits(tmp_path, arch, targets):
    from peft import PeftModel
    model, d = _model(tmp_path, arch)
    add_lora(model, LoRAConfig(rank=4, alpha=16, targets=targets))
    _randomise(model)
    save_adapter(model, tmp_path / "adapter", base_model=str(d))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] >= 4
    theirs = PeftModel.from_pretrained(_hf(arch, d), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        _close(_logits(model), theirs(TOKENS).logits.float())


@pytest.mark.parametrize("arch", list(PEFT_TARGETS))
def test_we_read_a_peft_adapter_with_its_logits(tmp_path, arch):
    from peft import LoraConfig, get_peft_model
    model, d = _model(tmp_path, arch)
    torch.manual_seed(3)
    peft = get_peft_model(_hf(arch, d), LoraConfig(r=4, lora_alpha=12, target_modules=PEFT_TARGETS[arch],
                                                   init_lora_weights=False))  # random A and B
    peft.save_pretrained(str(tmp_path / "theirs"))
    names = load_adapter(model, tmp_path / "theirs")
    assert names and all(p.requires_grad == (".lora." in n) for n, p in model.named_parameters())
    with torch.no_grad():
        _close(_logits(model), peft.eval()(TOKENS).logits.float())


def test_a_generator_folds_the_published_adapters_into_its_base(tmp_path):
    trainer, d = _model(tmp_path)
    base = _logits(trainer)
    cfg = LoRAConfig(rank=4, targets=ALL)
    add_lora(trainer, cfg)
    store = WeightStore({n: (p.shape, torch.float32) for n, p in adapter_state(trainer).items()})
    gen = load_model(str(d), tokenizer=False)[0].float()
    attach_lora(gen, cfg, freeze=False)
    merger = Merger(gen)
    for version in (1, 2):  # two publishes: each folded into the base as loaded, never into the last merge
        _randomise(trainer, seed=version)
        store.publish(adapter_state(trainer), version)
        assert store.load_into(gen, subset=True) == version
        merger.merge()
        _close(_logits(gen), _logits(trainer))  # the adapters disabled: the weights carry them
    with merger.pristine():
        assert torch.equal(_logits(gen), base)  # the reference: the base's weights swapped back
    _close(_logits(gen), _logits(trainer))
    assert store.nbytes == 4 * sum(p.numel() for p in adapter_state(trainer).values())


def _run(tmp_path, *argv):
    return run_gsm8k.main(["--model=tiny", "--data.eval_size=4", "--data.eval_max_new_tokens=8", "--gen.n=2",
                           "--gen.max_new_tokens=8", "--train.prompts_per_step=2", "--train.min_buffer=4",
                           "--precision.dtype=fp32", f"--run_root={tmp_path / 'runs'}", *argv])


def test_a_lora_run_trains_publishes_and_checkpoints_adapters_and_resumes(tmp_path):
    """TBA with k = 2 (the reference from each generator's own base, its adapters' weights swapped out),
    a checkpoint every step exporting both the PEFT adapter and the merged model, then a resume."""
    argv = ["--name=l", "--train.lora.rank=4", "--train.lora.targets=attn", "--train.lora.export=both"]
    last = _run(tmp_path, *argv, "--train.steps=2", "--train.checkpoint_every=1", "--train.lr=1e-3")
    assert last["version"] == 1 and "eval_accuracy" in last
    ck = tmp_path / "runs" / "l" / "checkpoints" / "step_000002"
    conf = json.loads((ck / "adapter" / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"] and conf["r"] == 4
    assert (ck / "adapter" / "adapter_model.safetensors").is_file() and (ck / "model" / "config.json").is_file()
    full = load_model(str(ck / "model"), tokenizer=False)[0].float()  # the merged model, an ordinary checkpoint
    assert not adapters(full)
    _run(tmp_path, *argv, "--train.steps=3", "--resume")  # the adapters and their AdamW state read back
    rows = [json.loads(x) for x in (tmp_path / "runs" / "l" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 3


def test_an_adapter_only_checkpoint_has_no_model_folder(tmp_path):
    """The default export: PEFT's files alone (the base is the run's --model)."""
    _run(tmp_path, "--name=a", "--algo=areal", "--train.lora.rank=2", "--train.steps=1", "--data.eval_size=0")
    ck = tmp_path / "runs" / "a" / "checkpoints" / "step_000001"
    assert (ck / "adapter" / "adapter_config.json").is_file() and not (ck / "model").exists()


def test_the_memory_plan_knows_lora():
    argv = ["--preset=areal_long", "--model=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "--gen.max_new_tokens=8192"]
    full = plan_of(run_gsm8k.make_config(argv), gpus=[80e9])
    lora = plan_of(run_gsm8k.make_config(argv + ["--train.lora.rank=16"]), gpus=[80e9])
    assert not full.fits and lora.fits, (full.report(), lora.report())
    assert any(s == "--train.lora.rank=16" for s, _ in full.fixes)
    what = [x.what for x in lora.lines]
    assert any(w.startswith("LoRA adapters (rank 16)") for w in what) and any(w.startswith("frozen base") for w in what)
    assert not any(w.startswith("fp32 weights, grads, AdamW") for w in what)


def test_what_lora_does_not_support_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--train.trainer_devices=2: must be 1 with --train.lora"):
        run_gsm8k.make_config(["--train.lora.rank=4", "--train.trainer_devices=2"])
    with pytest.raises(ConfigError, match=r"--train.record=True: must be false with --train.lora"):
        run_gsm8k.make_config(["--train.lora.rank=4", "--train.record=true"])
    with pytest.raises(ConfigError, match=r"--train.lora.targets"):
        run_gsm8k.make_config(["--train.lora.rank=4", "--train.lora.targets=qkv"])
