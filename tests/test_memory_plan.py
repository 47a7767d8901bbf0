"""The memory plan (common/plan/memory_plan.py) against what tiny models on the CPU really hold,
and the plan's decisions: a preset that fits, one that does not (with what to change), and a run
whose plan does not fit stopping before it loads anything.

How it is measured: by the tensors' own byte counts, not by RSS or tracemalloc (the allocator's
caching, the Python heap and the other test processes make those move by more than these models
weigh). Activations: every tensor autograd saves for backward during one forward of a micro-batch
(`torch.autograd.graph.saved_tensors_hooks`), counted once per storage, the parameters and the
input tokens left out; that is what stays alive until backward. With checkpointing the forward
keeps the block inputs; the one layer recomputed in backward is the no-checkpointing per-layer
figure, checked by the first case (all within 4% here). The trainer's state: parameters, gradients and AdamW's moments
after one optimizer step. The sampler: its paged KV pool's tensors after a call. Tolerance: 5%
(the plan leaves out a few values per token: masks, positions, the head's row indices).
"""
import re

import pytest
import torch

import run_gsm8k
from bench import memory_plan as plan_bench
from common.plan import memory_plan
from common.engine.checkpoints.hf_io import load_model, read_hf_config
from common.engine.kv.budget import kv_bytes_per_token
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.engine.checkpoints.shapes import param_count
from common.contracts.errors import UserError
from common.contracts.ops import token_logp
from common.plan.preflight import UnknownShape, check_memory, plan_of
from common.runtime.step import make_optimizer
from tests import tiny

FAMILIES = ["llama_tied", "qwen2_bias", "neox_parallel_rot25", "neox_sequential_rot100", "gpt2"]


def _model(tmp_path, arch):
    tiny.save_hf(arch, tmp_path / arch)
    return load_model(str(tmp_path / arch), tokenizer=False)[0], read_hf_config(tmp_path / arch)


def saved_bytes(model, tokens) -> int:
    """Bytes of the distinct storages autograd saves in one forward (parameters and input excluded)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {tokens.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logp(model, tokens, 1.0).sum()
    return sum(n for ptr, n in seen.items() if ptr not in skip)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_what_autograd_saves(tmp_path, arch, checkpointing):
    model, hf = _model(tmp_path, arch)
    model.train()
    model.checkpoint_layers = checkpointing
    B, T = 4, 48
    tokens = torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(0))
    got = saved_bytes(model, tokens)
    want = memory_plan.activation_bytes(model.cfg, B * T, checkpointing, half=False)
    if checkpointing:  # the forward's part: less the layer recomputed in backward
        want -= B * T * 4 * memory_plan.layer_values(model.cfg)[0]
    assert got == pytest.approx(want, rel=0.05)


def test_trainer_state_and_kv_pool_match_their_tensors(tmp_path):
    model, hf = _model(tmp_path, "llama_tied")
    P = param_count(hf)
    opt = make_optimizer(model, 1e-3, 0.0)
    model.train()
    token_logp(model, torch.randint(3, 97, (2, 16)), 1.0).sum().backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    held = sum(t.nbytes for t in [*model.parameters(), *(p.grad for p in model.parameters()), *state])
    assert held == pytest.approx(16 * P, rel=0.01)  # fp32 weights, grads and two moments
    model.eval()
    s = Sampler(model, max_batch=4, max_seq_len=64, kv_tokens=640, page_size=64)
    s.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
    pool = sum(t.nbytes for t in s.cache.stores)
    per = kv_bytes_per_token(model.cfg, 4)
    assert pool == (640 // 64 + 1) * 64 * per  # whole pages and the scratch page, as the plan counts them


def test_plans_fit_or_say_what_to_change(tmp_path):
    cfg = run_gsm8k.make_config(["--preset=paper"])
    big = plan_of(cfg, gpus=[141e9])
    assert big.fits  # TBA's GSM8K run on one H200-sized GPU
    act = {x.what: x.nbytes for x in big.lines if x.what.startswith("activations")}
    assert len(act) == 1 and "checkpointed" in next(iter(act))  # the preset's setting, the other beside it:
    off = next(n for n in big.notes if "without checkpointing" in n)
    cfg_off = run_gsm8k.make_config(["--preset=paper", "--train.activation_checkpointing=false"])
    assert memory_plan.gb(next(x.nbytes for x in plan_of(cfg_off, gpus=[141e9]).lines
                               if x.what.startswith("activations"))) in off
    small = plan_of(cfg, gpus=[24e9])
    assert not small.fits and "cuda:0 needs" in small.report()
    advice = plan_of(run_gsm8k.make_config(["--preset=paper", "--train.activation_checkpointing=false"]),
                     gpus=[24e9]).advice()
    assert "--train.activation_checkpointing=true" in advice and "--train.micro_batch_tokens=" in advice


def test_one_gpus_shares_suggested_from_the_plan():
    """AReaL's long preset on one GPU: on 141 GB the trainer's fixed 0.6 share is far above its plan,
    and the plan names the shares that move the spare to the generator and what its pool then holds;
    re-planned with them, the pool holds that. On 80 GB the trainer fits within the plan's tolerance
    of its share, which the plan says, with the share that keeps the margin."""
    argv = ["--preset=areal_long", "--gen.max_new_tokens=8192"]
    big = plan_of(run_gsm8k.make_config(argv), gpus=[141e9])
    note = next(n for n in big.notes if "would hold" in n)
    t, g, n = re.search(r"--train.memory_fraction=([\d.]+) --gen.memory_fraction=([\d.]+) .* would hold ([\d,]+)", note).groups()
    before = big.kv_tokens["generator 0"]
    cfg = run_gsm8k.make_config(argv + [f"--train.memory_fraction={t}", f"--gen.memory_fraction={g}"])
    again = plan_of(cfg, gpus=[141e9])
    seq = memory_plan.PROMPT_TOKENS + 8192
    assert again.fits and again.kv_tokens["generator 0"] // seq == int(n.replace(",", "")) > before // seq
    # the suggested trainer share keeps the margin: its plan x 1.15 <= the share
    assert again.used("cuda:0", "trainer", allocator=True) * 1.15 <= float(t) * 141e9
    small = plan_of(run_gsm8k.make_config(["--preset=areal_long"]), gpus=[80e9])
    assert small.fits and any(n.startswith("trainer: planned") and "--train.memory_fraction=0.69" in n for n in small.notes)
    assert not any("would hold" in n for n in small.notes)  # no spare share to move on 80 GB


def test_a_cpu_kv_pool_past_the_memory_suggests_a_paged_budget_that_fits(monkeypatch):
    """On a CPU the default pool holds every slot at full length: long outputs outgrow the memory, and
    the fix is the pool's budget, not the trainer's micro-batch: the plan names it first, and
    re-planned with it the run fits and its pool still holds full-length samples."""
    monkeypatch.setattr(memory_plan, "ram_bytes", lambda: 2e9)
    argv = ["--model=tiny", "--algo=areal", "--gen.kv_layout=static", "--gen.max_new_tokens=16384", "--gen.max_batch=256"]
    p = plan_of(run_gsm8k.make_config(argv))
    assert not p.fits and p.fixes[0][0].startswith("--gen.kv_layout=paged --gen.kv_tokens=")
    again = plan_of(run_gsm8k.make_config(argv + p.fixes[0][0].split()))
    assert again.fits and again.kv_tokens["generator 0"] // (memory_plan.PROMPT_TOKENS + 16384) >= 1
    assert f"a pool of {again.kv_tokens['generator 0'] // (memory_plan.PROMPT_TOKENS + 16384)} full-length" in p.advice()


def test_a_run_that_does_not_fit_stops_before_loading(tmp_path):
    tiny.save_hf("llama_tied", tmp_path / "m")
    tiny.tokenizer().save_pretrained(tmp_path / "m")
    argv = [f"--model={tmp_path / 'm'}", f"--run_root={tmp_path / 'runs'}", "--train.micro_batch_tokens=4000000000"]
    with pytest.raises(UserError, match=r"^memory plan: cpu needs .* --train.micro_batch_tokens=1000000000"):
        run_gsm8k.main(argv)
    assert not (tmp_path / "runs").exists()  # nothing started


def test_the_gpu_check_runs_its_parts_on_a_cpu(tmp_path):
    """bench/memory_plan.py (the check a lent GPU runs at a paper preset's shapes) at a tiny shape on
    the CPU: both parts run in their own processes and report the plan's bytes beside a measurement
    (on a CPU a rough resident-set one: not compared here)."""
    tiny.save_hf("llama_tied", tmp_path / "m")
    tiny.tokenizer().save_pretrained(tmp_path / "m")
    res = plan_bench.main(["--task", "gsm8k", "--preset", "cpu", "--model", str(tmp_path / "m"), "--decode-tokens", "2",
                      "--set", "train.micro_batch_tokens=512", "--set", "gen.max_new_tokens=16", "--set", "gen.max_batch=4"])
    for part in ("trainer", "generator"):
        assert res[part]["planned"] > 0 and res[part]["measured"] >= 0 and "error" not in res[part], res[part]


def test_a_hub_model_neither_on_disk_nor_in_the_table_is_not_judged_before_a_run(capsys):
    """The run would fetch it (with the hub): the check before loading cannot plan it and lets the
    run go on, saying so; `--print-memory`, asked for the plan, refuses with what to do."""
    cfg = run_gsm8k.make_config(["--model=someone/unknown-model"])
    check_memory(cfg)  # no error: not judged
    assert "memory plan not checked: --model=someone/unknown-model" in capsys.readouterr().err
    with pytest.raises(UnknownShape, match=r"--model=someone/unknown-model is not on disk .* --memory_check=false"):
        check_memory(cfg, show=True)


def test_changes_that_fit_only_together_are_named_together():
    """Red-teaming's large setup on one 141 GB GPU: each of two reward workers holds the 8B victim
    (with its sampler's pool), the 8B guard and the frozen 1B attacker, and the trainer's evaluation
    a third set. No single change is the least disruptive fit; the plan names its changes taken in
    its own order, each kept where it helps, until they re-plan to a fit (not the victim on the CPU),
    and re-planned with exactly those the run fits. On 80 GB even all of them leave it short: said."""
    import run_redteam
    p = plan_of(run_redteam.make_config(["--preset=paper_llama"]), gpus=[141e9])
    assert not p.fits and re.search(r"--train.reward_workers=1 \(saves 4\d.\d\d GB", p.advice())
    settings = re.search(r"Together, (.*) fits \(cuda:0 ", p.advice()).group(1).split()
    assert settings == ["--train.micro_batch_tokens=8192", "--victim.max_batch=16", "--train.reward_workers=1"]
    again = plan_of(run_redteam.make_config(["--preset=paper_llama"] + settings), gpus=[141e9])
    assert again.fits and f"cuda:0 {memory_plan.gb(again.used('cuda:0'))} of 141.00 GB" in p.advice()
    small = plan_of(run_redteam.make_config(["--preset=paper_llama"]), gpus=[80e9])
    assert "--data.eval_attacks=0 it still does not fit (cuda:0 needs" in small.advice()
    small = plan_of(run_gsm8k.make_config(["--preset=paper"]), gpus=[24e9])  # TBA's 1.1B policy: LoRA makes it fit
    assert "Together, --train.micro_batch_tokens=8192 --train.lora.rank=16 fits (cuda:0 " in small.advice()
    small = plan_of(run_gsm8k.make_config(["--preset=paper"]), gpus=[8e9])
    assert "a larger GPU, more GPUs" in small.advice()  # nothing fits 8 GB


def test_the_reward_side_is_planned_where_each_process_holds_it():
    """What the task says its reward workers and its evaluation load: red-teaming's victim, guard and
    frozen attacker once per reward worker and once for the trainer's evaluation (none with the
    evaluation off), the attacker not at all where it is the victim; TL;DR's gold RM only while it
    evaluates; reward workers on CUDA with their contexts."""
    import run_redteam
    import run_tldr

    def lines(p, who):
        return {x.what.split(":")[0]: x.nbytes for x in p.lines if x.process == who}
    p = plan_of(run_redteam.make_config(["--preset=paper"]), gpus=[80e9])
    workers, evals = lines(p, "reward workers"), lines(p, "trainer (eval)")
    assert set(workers) == {"--victim.model", "--victim.model's KV pool", "--victim.model's prefill activations and "
                            "decode logits", "--toxicity.model", "--ref_model (frozen, beside the victim)",
                            "CUDA contexts (allowance)"}
    assert all(workers[k] == 2 * evals[k] for k in evals) and "CUDA contexts (allowance)" not in evals  # 2 workers, 1 evaluation
    off = plan_of(run_redteam.make_config(["--preset=paper", "--data.eval_attacks=0"]), gpus=[80e9])
    assert not lines(off, "trainer (eval)") and "--data.eval_attacks=0" not in off.advice()
    same = plan_of(run_redteam.make_config(["--model=tiny", "--victim.model=tiny"]))  # the attacker is the victim
    assert "--ref_model (frozen, beside the victim)" not in lines(same, "reward workers")
    tl = run_tldr.make_config(["--preset=paper"])
    assert set(lines(plan_of(tl, gpus=[80e9]), "trainer (eval)")) == {"--reward.gold_model",
                                                                      "--ref_model (the KL's initial policy)"}
    tl_off = run_tldr.make_config(["--preset=paper", "--data.eval_size=0"])
    assert not lines(plan_of(tl_off, gpus=[80e9]), "trainer (eval)")


def test_a_plan_for_several_gpus_not_on_this_machine_uses_their_count(capsys):
    """`--print-memory=<GB>x<N>` on a machine without those GPUs: a preset's shares of one shared GPU
    (trainer 0.6, generator 0.25) apply only where one GPU is shared, so a two-GPU plan caps no
    process (as the run on two GPUs would not); one GPU's plan does."""
    def printed(spec):
        with pytest.raises(SystemExit):
            run_gsm8k.make_config(["--preset=areal_long", f"--print-memory={spec}"])
        return capsys.readouterr().out
    two = printed("40x2")
    assert "share of cuda" not in two and "cuda:1:" in two
    assert "Together, --train.micro_batch_tokens=7680 --train.trainer_devices=2 fits" in two
    assert "planned 47.75 GB of its 48.00 GB share of cuda:0" in printed("80")
    with pytest.raises(SystemExit):  # the last of two is taken; GPUs for a CPU run are said to be unused
        run_gsm8k.make_config(["--model=tiny", "--print-memory=80", "--print-memory=40x2"])
    out = capsys.readouterr().out
    assert out.startswith("(the GPUs asked for are not planned: this run's trainer is on cpu)\ncpu: ")


def test_print_memory_without_the_gpus_memory_does_not_say_fits(capsys, monkeypatch):
    """`--print-memory` for a GPU preset on a machine without CUDA: the GPU's memory is unknown, so
    the plan is not judged, and says how to give it (exit status 0: nothing failed)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run_gsm8k.make_config(["--preset=gpu", "--print-memory"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "cuda:0: " in out and "of unknown" in out
    assert out.splitlines()[-1] == ("not judged: the memory of cuda:0 is unknown on this machine; give it as "
                                    "--print-memory=<GB> (or <GB>x<GPUs>), e.g. --print-memory=80")
    assert "fits" not in out


def test_reward_models_in_bf16_are_a_change_the_plan_names():
    """TL;DR's paper preset on a 60 GB GPU: its RMs (0.9B and the 6.9B gold one) load in fp32; the plan
    names `--reward.dtype=bf16` with half their bytes, and re-planned with it they weigh 2 B a parameter."""
    import run_tldr
    p = plan_of(run_tldr.make_config(["--preset=paper"]), gpus=[60e9])
    assert "--reward.dtype=bf16 (saves 15.12 GB on cuda:0)" in p.advice()
    assert "Together, --train.micro_batch_tokens=8192 --reward.dtype=bf16 fits" in p.advice()
    half = plan_of(run_tldr.make_config(["--preset=paper", "--reward.dtype=bf16"]), gpus=[80e9])
    assert any("--reward.gold_model: 1 x 2 B x 6.651B" in x.what for x in half.lines)
    assert "--reward.device=cpu (saves 30.77 GB" in p.advice()  # the gold RM and the worker's context move with it


def test_a_pool_below_one_sample_names_its_own_change_alone():
    """Nothing past a memory, only a KV pool too small for one full-length sample: the plan's change
    is that pool's size, not a list of byte savers that cannot help: a 512-token prompt's 8 pages of 64
    and 257 own tokens' 5 (the sampler's own rule, kv_pages.sample_kv_tokens), the prompt counted once."""
    p = plan_of(run_gsm8k.make_config(["--model=tiny", "--gen.kv_tokens=500", "--gen.max_new_tokens=256"]))
    assert not p.fits and p.fixes == [("--gen.kv_tokens=832", "one full-length sample")]


def test_together_skips_a_change_that_does_not_help_and_names_one_that_fits_alone():
    """`memory_fixes.together` on a stand-in re-planner: the first change saves nothing here, so it is
    not kept; the second fits alone, and since it is not the first of the list, the plan says so."""
    from common.plan import memory_fixes

    def replan(c):
        q = memory_plan.Plan(capacity={"cuda:0": 10e9})
        q.add("cuda:0", "trainer", "weights", 8e9 if c.train.reward_workers == 1 else 12e9)
        q.fixes = [("--train.micro_batch_tokens=64", "saves nothing"), ("--train.reward_workers=1", "saves 4 GB")]
        return q
    cfg = run_gsm8k.make_config(["--model=tiny", "--train.reward_workers=2"])
    p = replan(cfg)
    assert not p.fits
    assert memory_fixes.together(cfg, p, replan) == "--train.reward_workers=1 alone fits (cuda:0 8.00 GB of 10.00 GB)"
