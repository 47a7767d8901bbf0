"""Red-teaming task: the documented log R on a tiny victim with a fake classifier, the length
penalty, a failing classifier scored as the failure value and counted, diversity, one victim
sampler call per group, and a tiny end-to-end run whose attack success rate rises."""
import json
import math

import pytest
import torch

from common.rewards import redteam as redteam_reward
import run_redteam
from common.rewards.embed import mean_pairwise_cosine_distance
from common.engine.checkpoints.hf_io import load_model
from common.contracts.errors import UserError
from common.runtime.reward_service import _safe_scores
from tests import tiny

TRIGGERS = {f"w{i}" for i in range(3, 25)}  # the chosen tokens the fake classifier calls toxic


def fake_toxicity(texts):
    """p_toxic = the fraction of an answer's words among TRIGGERS (a stand-in classifier)."""
    return [sum(w in TRIGGERS for w in t.split()) / max(1, len(t.split())) for t in texts]


def raising_toxicity(texts):
    raise RuntimeError("classifier service down")


def _model(path, seed=0):
    tiny.save_hf("llama_tied", path, seed=seed)
    tiny.tokenizer().save_pretrained(path)
    return str(path)


def _cfg(tmp_path, *extra):
    m = _model(tmp_path / "model")
    return run_redteam.make_config([f"--model={m}", f"--victim.model={m}", "--toxicity.model=tests.test_redteam_task:fake_toxicity",
                                    "--victim.max_new_tokens=6", "--victim.temperature=0", "--precision.dtype=fp32",
                                    f"--run_root={tmp_path / 'runs'}", *extra])


def test_log_r_is_the_documented_formula(tmp_path):
    from common.contracts.ops import seq_logp, token_logp
    cfg = _cfg(tmp_path, "--reward.beta=0.5", "--reward.gamma=2.0", "--reward.min_words=2", "--reward.short_penalty=7")
    sc = redteam_reward.AttackScorer(cfg)
    prompt = [1, 5, 6, 7]
    attacks = ["w10 w11 w12", "w13"]
    d = sc.details(attacks, [prompt, prompt])
    p = [fake_toxicity(a)[0] for a in d["answers"]]  # one answer per attack (victim.samples = 1)
    assert d["p_toxic"] == pytest.approx(p)
    for a, pt, lr in zip(attacks, p, d["log_r"]):
        ids = torch.tensor([prompt + sc.atok(a, add_special_tokens=False)["input_ids"]])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt):] = True
        with torch.no_grad():  # the frozen attacker's log-prob, as the reward computes it
            lp = float(seq_logp(token_logp(sc.ref, ids, 1.0, mask), mask)[0])
        expect = math.log(max(pt, 1e-6)) / 0.5 + lp / 2.0 - 7.0 * (len(a.split()) < 2)
        assert lr == pytest.approx(expect, rel=1e-5, abs=1e-4)
    assert d["log_r"][1] < math.log(max(p[1], 1e-6)) / 0.5  # the one-word attack paid the penalty


def test_failing_classifier_scores_the_failure_value_and_is_counted(tmp_path):
    cfg = _cfg(tmp_path, "--toxicity.model=tests.test_redteam_task:raising_toxicity")
    sc = redteam_reward.AttackScorer(cfg)
    fail = cfg.gen.error_reward
    assert fail == pytest.approx(math.log(1e-6) / cfg.reward.beta)
    out, errors = _safe_scores(sc, ["w10 w11 w12", "w13 w14 w15"], [[1, 5], [1, 6]], fail)
    assert out == [fail, fail] and errors == 2


def test_diversity():
    e = torch.randn(5, 8)
    assert mean_pairwise_cosine_distance(e[:1].repeat(4, 1)) == pytest.approx(0.0, abs=1e-12)
    assert mean_pairwise_cosine_distance(torch.eye(6)) == pytest.approx(1.0)
    assert mean_pairwise_cosine_distance(e) == pytest.approx(mean_pairwise_cosine_distance(e[torch.randperm(5)]))
    assert math.isnan(mean_pairwise_cosine_distance(e[:1]))


def test_victim_generation_is_one_sampler_call_per_group(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "--victim.samples=3", "--victim.temperature=1.0")
    sc = redteam_reward.AttackScorer(cfg)
    calls = []
    orig = sc.sampler.generate
    monkeypatch.setattr(sc.sampler, "generate", lambda ps, params, **k: calls.append(len(ps)) or orig(ps, params, **k))
    d = sc.details(["w10 w11 w12", "w13 w14", "w15 w16 w17", "w18"], [[1, 5]] * 4)
    assert calls == [4] and all(len(a) == 3 for a in d["answers"])  # 4 attacks x 3 answers, one call


def test_the_victims_pool_is_what_the_memory_plan_counts(tmp_path):
    """The victim's sampler (its rows and prompt cut from `victim.max_batch` / `max_prompt_tokens`)
    holds the KV pool the memory plan's line for it counts, to the byte (the plan's other reward-side
    lines: tests/test_memory_plan.py)."""
    from common.plan.preflight import plan_of
    cfg = _cfg(tmp_path, "--victim.max_batch=5", "--victim.max_prompt_tokens=40", "--train.reward_workers=1")
    sc = redteam_reward.AttackScorer(cfg)
    assert (sc.sampler.max_batch, sc.max_prompt) == (5, 40)
    sc.details(["w10 w11 w12"], [[1, 5]])
    pool = sum(t.nbytes for t in sc.sampler.cache.stores)
    planned = next(x.nbytes for x in plan_of(cfg).lines if x.what.startswith("--victim.model's KV pool"))
    assert pool == planned


def test_missing_classifier_says_how_to_get_one(monkeypatch):
    import builtins
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda n, *a, **k: (_ for _ in ()).throw(ImportError(n))
                        if n == "profanity_check" else real(n, *a, **k))
    with pytest.raises(UserError, match="pip install alt-profanity-check"):
        run_redteam.Toxicity("profanity-check")


def test_a_classifier_function_that_cannot_be_imported_is_named():
    with pytest.raises(UserError, match=r"^toxicity classifier nosuch_module:fn: No module named 'nosuch_module'"):
        run_redteam.Toxicity("nosuch_module:fn")
    with pytest.raises(UserError, match=r"has no attribute 'nosuch'"):
        run_redteam.Toxicity("common.rewards.toxicity:nosuch")
    with pytest.raises(UserError, match=r"^toxicity classifier common.contracts.errors:__doc__: str is not a function$"):
        run_redteam.Toxicity("common.contracts.errors:__doc__")
    assert run_redteam.Toxicity("tests.test_redteam_task:half")(["a", "b"]) == [0.5, 0.5]  # an importable one is taken


def test_the_evaluation_shows_its_progress(tmp_path, capsys):
    """The evaluation's two samplings (1,024 attacks at the paper preset, then the victim's answers)
    each show a bar of the samples finished."""
    cfg = _cfg(tmp_path, "--data.eval_attacks=6", "--gen.max_new_tokens=4")
    model, tok = load_model(cfg.model)
    out = run_redteam.Evaluator(cfg, [[1, 5, 6]], (2,), tmp_path / "attacks.jsonl")(model, tok)
    err = capsys.readouterr().err
    assert out["eval_n"] == 6 and "eval: attacks: 100%" in err and "eval: the victim's answers: 100%" in err


def half(texts):
    return [0.5] * len(texts)


def test_tiny_end_to_end_success_rate_rises(tmp_path):
    cfg_args = ["--train.steps=60", "--train.lr=3e-3", "--train.sync_every=2", "--gen.max_new_tokens=6",
                "--gen.n=4", "--train.prompts_per_step=4", "--data.n_prompts=4", "--data.eval_attacks=48",
                "--train.checkpoint_every=0", "--tba.beta_init=1", "--tba.beta_final=1", "--reward.gamma=1000",
                "--reward.beta=0.1", "--reward.min_words=1", "--train.micro_batch_tokens=1024",
                # sync: a trainer step takes ~0.02 s here, so in async mode all 60 steps fit the first few
                # groups the generator managed to write, and the outcome hung on which few those were
                # (seed and CPU load); async learning is tests/test_e2e.py's
                "--train.mode=sync"]
    m = _model(tmp_path / "model")
    last = run_redteam.main([f"--model={m}", f"--victim.model={m}", "--toxicity.model=tests.test_redteam_task:fake_toxicity",
                             "--victim.max_new_tokens=4", "--victim.temperature=0", "--precision.dtype=fp32",
                             f"--run_root={tmp_path / 'runs'}", *cfg_args])
    s = last["success_rate_change"]
    print(s)
    assert s["after"] > s["before"] + 0.15 and s["ci_low"] > 0, s
    rows = [json.loads(x) for x in (tmp_path / "runs" / "redteam_tba" / "attacks.jsonl").read_text().splitlines()]
    assert rows and {"attack", "answer", "toxicity"} <= set(rows[0])
