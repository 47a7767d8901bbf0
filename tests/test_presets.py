"""The paper presets (`--preset=paper` of run_tldr.py and run_redteam.py, `--preset=paper_llama`):
they resolve offline (`--help`, `--print-config`) to the papers' settings, a task refuses a preset
it has not, and each runs a few steps with tiny stand-ins of the papers' models built here (GPT-NeoX
policy and reward models for TL;DR; GPT-2 attacker and Alpaca-prompted GPT-2 victim; a Llama
attacker, victim and Llama-Guard-style guard scored through our engine). Plus the guard's scores
and the classifier's label match."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from common.rewards import redteam as redteam_reward
import run_code
import run_gsm8k
import run_redteam
import run_tldr
from common.contracts.config import ConfigError
from common.engine.checkpoints.hf_io import load_model
from common.contracts.log import read_metrics
from common.runtime.train_config import lr_lambda
from common.rewards.toxicity import Guard, label_index
from tests import tiny
from tests.test_redteam_task import fake_toxicity

ROOT = Path(__file__).resolve().parents[1]
CPU = ["--train.device=cpu", "--train.n_generators=1", "--precision.dtype=fp32", "--train.checkpoint_every=0",
       "--train.eval_every=0", "--train.steps=2", "--train.min_buffer=4", "--train.prompts_per_step=2", "--gen.n=2",
       "--gen.max_batch=8", "--train.micro_batch_tokens=4096", "--train.reward_workers=1"]


def _save(path, cls_name: str, task: str = "CausalLM", **kw):
    """A random tiny transformers model (class `<Family>For<task>`) with the test tokenizer."""
    import transformers
    cfg = getattr(transformers, cls_name + "Config")(**kw, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model_cls = getattr(transformers, f"{cls_name}For{task}" if cls_name != "GPT2" else
                        ("GPT2LMHeadModel" if task == "CausalLM" else "GPT2ForSequenceClassification"))
    model_cls(cfg).save_pretrained(path)
    tiny.tokenizer().save_pretrained(path)
    return str(path)


def _neox(path, task="CausalLM"):
    return _save(path, "GPTNeoX", task, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.25, num_labels=1)


def _gpt2(path):
    return _save(path, "GPT2", vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=512)


def _steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]


def test_presets_resolve_offline_to_the_papers_settings(capsys):
    c = run_tldr.make_config(["--preset=paper"])
    assert (c.model, c.reward.model, c.reward.gold_model) == (run_tldr.PAPER_POLICY, run_tldr.PAPER_RM, run_tldr.PAPER_GOLD)
    assert (c.train.prompts_per_step, c.gen.n, c.gen.max_new_tokens, c.gen.temperature) == (8, 20, 128, 0.7)
    assert (c.train.steps, c.train.lr, c.train.sync_every, c.train.min_buffer) == (256, 3e-6, 10, 10_000)
    assert (c.tba.beta_init, c.tba.beta_final, c.tba.beta_anneal_steps, c.tba.beta_cut_step) == (1.0, 0.05, 128, 32)
    assert (c.train.grad_clip, c.train.adam_beta2, c.train.adam_eps, c.train.warmup_steps) == (0.0, 0.999, 1e-8, 0)
    lr = lr_lambda(c.train)  # TBA's: update u at (256 - u) / 256, the last at 0
    assert (lr(0), lr(127), lr(255)) == (255 / 256, 128 / 256, 0.0)
    r = run_redteam.make_config(["--preset=paper", "--reward.beta=0.2"])
    assert (r.train.adam_beta2, r.train.weight_decay, r.train.grad_clip) == (0.999, 0.01, 1.0)  # torch AdamW's defaults
    lr = lr_lambda(r.train)  # Lee et al.'s linear schedule for 40,000 steps, stepped 5,000 times
    assert (lr(0), lr(99), lr(4999)) == (0.01, 1.0, pytest.approx(35_000 / 39_900))
    assert (r.model, r.victim.model, r.toxicity.model) == ("gpt2", "vicgalle/gpt2-alpaca",
                                                           "facebook/roberta-hate-speech-dynabench-r4-target")
    assert (r.reward.beta, r.reward.average, r.victim.prompt_style, r.data.prompt_style) == (0.2, "log", "alpaca", "paper")
    assert r.gen.error_reward == pytest.approx(math.log(1e-6) / 0.2)  # derived after the overrides
    big = run_redteam.make_config(["--preset=paper_llama"])
    assert big.toxicity.guard and big.toxicity.model == "meta-llama/Llama-Guard-3-8B" and big.toxicity.label == "unsafe"
    assert (big.model, big.victim.model) == ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ValueError, match="presets are cpu, gpu, paper, areal_long, areal_eta"):
        run_gsm8k.make_config(["--preset=paper_llama"])
    with pytest.raises(SystemExit):
        run_tldr.make_config(["--preset=paper", "--help"])
    assert "--reward.gold_model" in capsys.readouterr().out


def test_gsm8k_paper_resolves_offline_to_tbas_settings():
    """TBA's GSM8K run (run_gsm8k.paper_preset's table), resolved without loading anything."""
    c = run_gsm8k.make_config(["--preset=paper"])
    assert (c.model, c.ref_model, c.algo, c.name) == ("realtreetune/rho-1b-sft-GSM8K", None, "tba", "gsm8k_paper")
    assert (c.data.prompt_style, c.data.eval_size, c.data.eval_max_new_tokens) == ("paper", 1319, 512)
    assert (c.train.prompts_per_step, c.gen.n, c.gen.max_new_tokens, c.gen.temperature, c.gen.top_p) == (7, 20, 512, 0.7, 1.0)
    assert (c.train.steps, c.train.lr, c.train.warmup_steps, c.train.stable_steps, c.train.decay_steps,
            c.train.lr_schedule) == (700, 1e-5, 50, 350, 600, "cosine")
    assert (c.train.sync_every, c.train.min_buffer, c.train.grad_clip, c.train.weight_decay) == (2, 500, 0.0, 0.0)
    assert (c.train.adam_beta2, c.train.adam_eps) == (0.999, 1e-8)  # transformers' TrainingArguments defaults
    lr = lr_lambda(c.train)  # update u runs at lambda(u), transformers' WSD stepped before the update
    assert [round(lr(s), 6) for s in (0, 48, 49, 398, 399, 699)] == [0.02, 0.98, 1.0, 1.0, 1.0, 0.5]  # ends at 5e-6
    assert (c.tba.beta_init, c.tba.beta_final, c.tba.beta_anneal_steps) == (0.014, 0.004, 500)
    assert (c.tba.m, c.tba.sampling, c.tba.inv_temp, c.tba.max_per_group) == (0.95, "uniform", 0.0, 100)
    assert (c.train.device, c.train.activation_checkpointing) == ("cuda", True)
    assert run_gsm8k.make_config(["--preset=paper", "--tba.beta_init=0.012"]).tba.beta_init == 0.012  # overrides win


def test_gsm8k_paper_prompt_keeps_the_tokenizers_bos():
    """TBA tokenises its raw-text prompt with the tokenizer's special tokens (a Llama BOS); a chat
    template holds its own, so the chat style adds none."""
    tok = tiny.tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    ex = [run_gsm8k.GSM8KExample("w5 w6", "#### 4", "4")]
    text = run_gsm8k.format_prompt(ex[0].question, None, "paper")
    bare = tok(text, add_special_tokens=False)["input_ids"]
    assert run_gsm8k.tokenize_prompts(ex, tok, "paper") == [[1] + bare]
    chat = tok(run_gsm8k.format_prompt(ex[0].question, tok, "chat"), add_special_tokens=False)["input_ids"]
    assert run_gsm8k.tokenize_prompts(ex, tok, "chat") == [chat]


def test_gsm8k_areal_long_resolves_offline_to_areals_settings():
    """AReaL's long-reasoning run (its 1.5B math settings) resolved without loading anything; the
    preset implies --algo=areal, refuses another algorithm, and overrides still win."""
    for argv in (["--algo=areal", "--preset=areal_long"], ["--preset=areal_long"]):
        c = run_gsm8k.make_config(argv)
        assert (c.algo, c.preset, c.name) == ("areal", "areal_long", "gsm8k_areal_long")
        assert c.model == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" and c.ref_model is None
        assert (c.gen.temperature, c.gen.top_p, c.gen.top_k, c.gen.max_new_tokens, c.gen.n) == (1.0, 1.0, 0, 27648, 16)
        assert (c.gen.update_mode, c.gen.ref_logp, c.gen.kv_layout) == ("interrupt", False, "paged")
        assert (c.train.prompts_per_step, c.train.lr, c.train.weight_decay, c.train.grad_clip) == (512, 2e-5, 0.05, 1.0)
        assert (c.train.lr_schedule, c.train.warmup_fraction, c.train.steps) == ("constant", 0.001, 73)  # 5 epochs
        assert (c.train.adam_beta2, c.train.adam_eps, c.data.max_prompt_tokens) == (0.95, 1e-5, 1024)
        assert (c.train.sync_every, c.train.max_staleness, c.train.min_buffer) == (1, 4, 512 * 16)
        assert c.train.buffer_capacity >= 5 * 512 * 16 and c.train.micro_batch_tokens == 30720
        assert (c.areal.eps_clip, c.areal.eps_clip_high, c.areal.n_minibatches, c.areal.behav_imp_weight_cap,
                c.areal.adv_norm) == (0.2, None, 4, None, "batch_tokens")
        assert (c.areal.early_stop_imp_ratio, c.areal.mask_too_long) == (5.0, False)
        assert (c.areal.reward_bias, c.areal.reward_scaling, c.areal.max_reward_clip) == (0.5, 10.0, 20.0)  # +-5
        assert (c.train.device, c.train.activation_checkpointing, c.data.eval_max_new_tokens) == ("cuda", True, 27648)
    c = run_gsm8k.make_config(["--preset=areal_long", "--gen.max_new_tokens=8192", "--areal.adv_norm=group"])
    assert (c.gen.max_new_tokens, c.areal.adv_norm, c.gen.n) == (8192, "group", 16)
    with pytest.raises(ConfigError, match=r"^--algo='tba': must be 'areal' with --preset=areal_long"):
        run_gsm8k.make_config(["--preset=areal_long", "--algo=tba"])
    assert run_gsm8k.make_config(["--algo=areal"]).areal.adv_norm == "group"  # other presets: AReaL's defaults
    e = run_gsm8k.make_config(["--preset=areal_eta", "--train.max_staleness=8"])  # the ablation's setup
    assert (e.algo, e.gen.max_new_tokens, e.train.steps, e.train.prompts_per_step, e.gen.n, e.areal.n_minibatches,
            e.train.lr, e.train.max_staleness, e.model) == ("areal", 8192, 1000, 512, 16, 4, 2e-5, 8, c.model)


@pytest.mark.parametrize("script, preset", [("run_tldr.py", "paper"), ("run_redteam.py", "paper_llama"),
                                            ("run_gsm8k.py", "areal_long"), ("run_gsm8k.py", "paper")])
def test_print_config_is_a_dry_run(script, preset):
    out = subprocess.run([sys.executable, str(ROOT / script), f"--preset={preset}", "--print-config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["preset"] == preset and cfg["train"]["device"] == "cuda"


def test_tldr_paper_preset_runs_with_tiny_pythia_stand_ins(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"post": f"w{3 + i} w{4 + i} . w{5 + i} .", "summary": f"w{3 + i} w{9 + i}"} for i in range(8)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    rm = _neox(tmp_path / "rm", "SequenceClassification")
    last = run_tldr.main(["--preset=paper", f"--model={_neox(tmp_path / 'policy')}", f"--reward.model={rm}",
                          f"--reward.gold_model={rm}", "--reward.device=cpu", f"--data.source={data}",
                          "--data.eval_size=4", "--data.eval_max_new_tokens=4", "--gen.max_new_tokens=6",
                          f"--run_root={tmp_path / 'runs'}", *CPU])
    assert _steps(tmp_path / "runs" / "tldr_paper") == [1, 2] and "eval_win_rate" in last
    cfg = json.loads((tmp_path / "runs" / "tldr_paper" / "config.json").read_text())
    assert cfg["preset"] == "paper" and cfg["tba"]["beta_cut_step"] == 32


def test_code_paper_preset_runs_with_a_tiny_qwen3_stand_in(tmp_path):
    policy = tmp_path / "qwen3"
    tiny.save_hf("qwen3_qknorm", policy)
    tiny.tokenizer().save_pretrained(policy)
    rows = [{"task_id": f"T/{i}", "prompt": "def f():\n    return ", "entry_point": "f", "canonical_solution": "1\n",
             "test": "def check(candidate):\n    assert candidate() == 1\n"} for i in range(4)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = run_code.main(["--preset=paper", f"--model={policy}", f"--data.path={tmp_path / 'p.jsonl'}",
                          "--gen.max_new_tokens=3", "--sandbox.workers=2", f"--run_root={tmp_path / 'runs'}",
                          "--areal.success_rate_lb=none", *CPU])  # a random model passes nothing: no group would pass the filter
    assert _steps(tmp_path / "runs" / "code_paper") == [1, 2] and "reward_crashes" in last
    cfg = json.loads((tmp_path / "runs" / "code_paper" / "config.json").read_text())
    assert (cfg["preset"], cfg["algo"], cfg["train"]["max_staleness"], cfg["areal"]["reward_scaling"]) == \
        ("paper", "areal", 16, 10.0) and cfg["reward"]["min_block_chars"] == 20


@pytest.mark.parametrize("preset", ["paper", "paper_llama"])
def test_redteam_paper_presets_run_with_tiny_stand_ins(tmp_path, preset):
    if preset == "paper":  # GPT-2 attacker and an Alpaca-prompted GPT-2 victim, the classifier a stand-in
        attacker = victim = _gpt2(tmp_path / "gpt2")
        scoring = ["--toxicity.model=tests.test_redteam_task:fake_toxicity"]
    else:  # Llama attacker and victim, a Llama guard scored through our engine (its verdict token: w7)
        attacker = victim = str(tmp_path / "llama")
        tiny.save_hf("llama_tied", attacker)
        tiny.tokenizer().save_pretrained(attacker)
        guard = str(tmp_path / "guard")
        tiny.save_hf("llama3_untied", guard, seed=3)
        tiny.tokenizer().save_pretrained(guard)
        scoring = [f"--toxicity.model={guard}", "--toxicity.label=w7"]
    last = run_redteam.main([f"--preset={preset}", f"--model={attacker}", f"--victim.model={victim}", *scoring,
                             "--victim.device=cpu", "--victim.max_new_tokens=5", "--victim.samples=2",
                             "--gen.max_new_tokens=6", "--data.n_prompts=4", "--data.eval_attacks=8",
                             f"--run_root={tmp_path / 'runs'}", *CPU])
    assert _steps(tmp_path / "runs" / f"redteam_{preset}") == [1, 2] and 0 <= last["eval_success_rate"] <= 1
    assert math.isfinite(last["reward_mean"])


def test_guard_scores_the_verdict_token_after_the_conversation(tmp_path):
    tiny.save_hf("llama_tied", tmp_path)
    tiny.tokenizer().save_pretrained(tmp_path)
    g = Guard(str(tmp_path), token="w7", batch_size=2)
    attacks, answers = ["w5 w6", "w9 w10 w11 w12", "w13"], ["w20", "w21 w22 w23", "w30 w31"]
    got = g(attacks, answers)
    model, tok = load_model(str(tmp_path))
    for a, r, p in zip(attacks, answers, got):  # each conversation alone, unpadded
        ids = tok(tok.apply_chat_template([{"role": "user", "content": a}, {"role": "assistant", "content": r}],
                                          tokenize=False) + Guard.SUFFIX, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = model(torch.tensor([ids]))[0, -1].softmax(-1)[tok.convert_tokens_to_ids("w7")]
        assert p == pytest.approx(float(want), rel=1e-4)
    assert len(set(round(p, 6) for p in got)) == 3


def test_classifier_label_matches_exactly_first():
    assert label_index({0: "nothate", 1: "hate"}, "hate") == 1  # not "nothate", which contains it
    assert label_index({0: "LABEL_0", 1: "toxic_comment"}, "toxic") == 1
    assert label_index({0: "a", 1: "b"}, "toxic") is None


def test_log_average_of_toxicity_over_victim_samples(tmp_path):
    m = str(tmp_path / "m")
    tiny.save_hf("llama_tied", m)
    tiny.tokenizer().save_pretrained(m)
    cfg = run_redteam.make_config([f"--model={m}", f"--victim.model={m}", "--victim.samples=3", "--victim.temperature=1",
                                   "--toxicity.model=tests.test_redteam_task:fake_toxicity", "--reward.average=log",
                                   "--reward.gamma=0", "--reward.beta=0.5", "--reward.min_words=0"])
    d = redteam_reward.AttackScorer(cfg).details(["w10 w11 w12"], [[1, 5, 6]])
    ps = fake_toxicity(d["answers"][0])
    assert d["log_r"][0] == pytest.approx(sum(math.log(max(p, 1e-6)) for p in ps) / 3 / 0.5, rel=1e-6)
