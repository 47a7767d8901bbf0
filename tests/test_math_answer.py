"""The math reward pays only for right answers (common/rewards/math_answer.py, common/rewards/bounded_verify.py): a
table of completions in GSM8K's and R1's formats, each with its right answer written here, in both
directions for every kind of answer: a wrong answer the old first-number rule paid (false reward),
and a right one it refused (missed reward). Then the answer's extraction on its own, golds in LaTeX,
and hostile answers bounded in time without signals (in a thread too)."""
from __future__ import annotations

import gzip
import json
import os
import threading
import time

import pytest

import common.rewards.math_answer as math_answer
from common.rewards import bounded_verify
from common.rewards.math_answer import extract_answer, final_answer, gold_answer, reward_correct

R1 = "<think>\nLet me work this out step by step.\n{w}\n</think>\nSo the final answer is $\\boxed{{{a}}}$."
GSM = "Natalia sold 48 clips in April and half as many in May.\n{w}\n#### {a}"


def r1(answer: str, working: str = "First 3 + 4 = 7, then 7 x 2 = 14.") -> str:
    return R1.format(w=working, a=answer)


def gsm(answer: str, working: str = "She sold 48 / 2 = 24 in May, 48 + 24 = 72 in all.") -> str:
    return GSM.format(w=working, a=answer)


# (category, completion, gold, reward): every category has a 0 the first-number rule paid (or a
# rule like it would) and a 1 it refused, besides the plain cases around them
CASES = [
    # powers
    ("power", r1("2^{10}"), "2", 0.0), ("power", r1("2^{10}"), "1024", 1.0), ("power", r1("3^2"), "3", 0.0),
    ("power", r1("3^{2}+1"), "10", 1.0),
    # scientific notation
    ("sci", r1(r"1.5\times10^3"), "1.5", 0.0), ("sci", r1(r"1.5\times 10^3"), "1500", 1.0),
    ("sci", r1(r"3 \cdot 10^{4}"), "30000", 1.0), ("sci", r1(r"3 \cdot 10^{4}"), "3", 0.0), ("sci", r1("1.5e3"), "1500", 1.0),
    # mixed numbers
    ("mixed", r1(r"3\frac{1}{2}"), "3", 0.0), ("mixed", r1(r"3\frac12"), "3.5", 1.0),
    ("mixed", r1(r"2\tfrac{1}{4}"), "2.25", 1.0), ("mixed", r1(r"2\tfrac{1}{4}"), "2", 0.0),
    # products and sums
    ("product", r1(r"3\times 4"), "3", 0.0), ("product", r1(r"3\times 4"), "12", 1.0),
    ("product", r1(r"3 \cdot 4"), "12", 1.0), ("sum", r1("12-5"), "12", 0.0), ("sum", r1("12-5"), "7", 1.0),
    ("sum", r1("2+3"), "5", 1.0), ("sum", r1("2+3"), "2", 0.0),
    # the Unicode minus
    ("minus", r1("\u22123"), "3", 0.0), ("minus", r1("\u22123"), "-3", 1.0), ("minus", gsm("\u22125"), "-5", 1.0),
    ("minus", gsm("\u22125"), "5", 0.0),
    # fractions and radicals
    ("fraction", r1(r"\frac{3}{4}"), "0.75", 1.0), ("fraction", r1(r"\frac{3}{4}"), "3", 0.0),
    ("fraction", r1(r"\dfrac{5}{2}"), "2.5", 1.0), ("fraction", r1("3/4"), "0.75", 1.0),
    ("fraction", r1(r"\frac{\sqrt4}{2}"), "1", 1.0), ("fraction", r1(r"\frac{\sqrt4}{2}"), "4", 0.0),
    ("radical", r1(r"\sqrt{16}"), "4", 1.0), ("radical", r1(r"\sqrt{16}"), "16", 0.0),
    # digit groups, LaTeX spacing
    ("groups", r1("10 000"), "10000", 1.0), ("groups", r1(r"10\,000"), "10000", 1.0),
    ("groups", r1("1{,}200"), "1200", 1.0), ("groups", r1("1,200"), "1200", 1.0), ("groups", r1("10 000"), "10", 0.0),
    ("groups", gsm("1,200"), "1200", 1.0),
    # units and currency
    ("units", r1(r"\text{18 dollars}"), "18", 1.0), ("units", r1(r"18 \text{ dollars}"), "18", 1.0),
    ("units", r1(r"\$18"), "18", 1.0), ("units", r1(r"\text{18 dollars}"), "19", 0.0), ("units", gsm("$18.00"), "18", 1.0),
    ("units", r1(r"5\text{ cm}"), "5", 1.0), ("units", r1("5x"), "5", 0.0),
    # an equation's right-hand side
    ("equation", r1("x = 5"), "5", 1.0), ("equation", r1("x = 5"), "6", 0.0), ("equation", r1("y=-2"), "-2", 1.0),
    ("equation", r1("x = 2 + 3"), "5", 1.0),
    # percentages: the number as written
    ("percent", r1(r"50\%"), "50", 1.0), ("percent", r1(r"50\%"), "0.5", 0.0), ("percent", r1(r"12.5\%"), "12.5", 1.0),
    ("percent", gsm("25%"), "25", 1.0),
    # a box cut at the token limit
    ("truncated", "...so the result is \\boxed{4", "4", 0.0), ("truncated", r"\boxed{3} no wait, \boxed{4", "3", 0.0),
    ("truncated", "#### 4\nlet me box it: \\boxed{4", "4", 0.0), ("truncated", r1("4") + " and also \\boxed{", "4", 0.0),
    ("truncated", r"\boxed{4} and the working \(x^{2", "4", 1.0),  # an open brace that is no box: the box stands
    # GSM8K's '####' by its own rule
    ("gsm8k", gsm("42") + "\nCheck: 7 + 35 = 42. Also 7.", "42", 1.0), ("gsm8k", gsm("42") + "\nThen 7.", "7", 0.0),
    ("gsm8k", gsm("$1,200"), "1200", 1.0), ("gsm8k", gsm("42 apples"), "42", 1.0), ("gsm8k", gsm("72"), "72", 1.0),
    ("gsm8k", gsm("18.00"), "18", 1.0), ("gsm8k", gsm("71"), "72", 0.0), ("gsm8k", "#### 3 and later #### 9", "9", 1.0),
    # the later of '####' and the last box; two boxes: the last
    ("order", r"#### 5, then \boxed{6}", "6", 1.0), ("order", r"\boxed{6}, then #### 5", "5", 1.0),
    ("order", r"\boxed{6}, then #### 5", "6", 0.0), ("order", r1("3") + r" On reflection \boxed{5}.", "5", 1.0),
    ("order", r1("3") + r" On reflection \boxed{5}.", "3", 0.0), ("fbox", r"the answer: \fbox{12}", "12", 1.0),
    ("fbox", r"\fbox{12} then 13", "13", 0.0),
    # plain numbers, no parser
    ("plain", r1("18.00"), "18", 1.0), ("plain", r1("0.50"), ".5", 1.0), ("plain", r1("-7"), "-7", 1.0),
    ("plain", r1("7"), "-7", 0.0), ("plain", r1("1234"), "1234", 1.0), ("plain", r1("1235"), "1234", 0.0),
    ("plain", r1("033"), "33", 1.0),
    # golds in LaTeX (MATH / AIME)
    ("latex_gold", r1("0.5"), r"\frac{1}{2}", 1.0), ("latex_gold", r1(r"\frac{2}{4}"), r"\frac{1}{2}", 1.0),
    ("latex_gold", r1(r"\sqrt 2"), r"\sqrt{2}", 1.0), ("latex_gold", r1("2"), r"\sqrt{2}", 0.0),
    ("latex_gold", r1(r"\pi/4"), r"\frac{\pi}{4}", 1.0), ("latex_gold", r1(r"\pi/3"), r"\frac{\pi}{4}", 0.0),
    ("latex_gold", r1("3"), r"We find $x=3$, so the answer is \boxed{3}.", 1.0),
    ("latex_gold", r1("(1,2)"), "(1, 2)", 1.0), ("latex_gold", r1("(2,1)"), "(1, 2)", 0.0),
    # no answer at all, or nothing in the box
    ("none", "I don't know.", "5", 0.0), ("none", "", "5", 0.0), ("none", r"\boxed{} and then 9", "9", 1.0),
    # TBA's rule where no marker is written: "answer is", else the last number
    ("fallback", "We get 10 and 20. The answer is 30.", "30", 1.0), ("fallback", "costs $18.", "18", 1.0),
    ("fallback", "1, 2, 3, then 4", "4", 1.0), ("fallback", "from 3-5 we get 2", "2", 1.0),
]


@pytest.mark.parametrize("category, completion, gold, want", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_reward_pays_right_answers_only(category, completion, gold, want):
    got = reward_correct(completion, gold)
    assert got == want and type(got) is float, (category, completion, gold)


def test_the_table_covers_each_kind_both_ways():
    assert len(CASES) >= 80
    for kind in {c[0] for c in CASES} - {"none", "fallback"}:  # those two: no answer, and TBA's own rule
        assert {c[3] for c in CASES if c[0] == kind} == {0.0, 1.0}, kind


@pytest.mark.parametrize("text, answer", [
    (r"\boxed{2^{10}}", "2^{10}"), (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"), (r"\boxed{x = 5}", "x = 5"),
    ("#### 42 apples. Check: 7", "42"), (r"\boxed{\boxed{8}}", "8"), (r"\boxed {12}", "12"),
    ("no digits", None), ("", None), (r"cut \boxed{1", None), (r"\boxed{" + "1" * 2000 + "}", None),
])
def test_the_final_answer_is_the_whole_last_box_or_gsm8ks_number(text, answer):
    assert final_answer(text) == answer


def test_extract_and_gold_answers_are_normalised():
    assert extract_answer(r"$\boxed{\$1,200.50}$") == "1200.50"
    assert extract_answer(r"\boxed{18 \text{ dollars}}") == "18" and extract_answer("\\boxed{\u22123}") == "-3"
    assert gold_answer("Natalia ... #### 72") == "72" and gold_answer(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert gold_answer("42") == "42"


def test_extraction_is_linear_on_hostile_text():
    t = time.perf_counter()
    assert final_answer(r"\boxed{" * 50_000 + "1") is None  # 50k unclosed boxes: the last is open
    assert final_answer(r"\boxed{{" * 20_000 + "}" * 40_000 + r"\boxed{7}") == "7"
    assert reward_correct("x#$%^&*(" * 20_000 + "9" * 5000 + "####" + ")(" * 1000, "3") == 0.0
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("answer", [r"9^{9^{9^{9}}}", r"10^{10^{10}}", r"\frac{1}{0}^{99999999}", "1" * 100_000])
def test_a_hostile_answer_scores_zero_within_a_second(answer):
    reward_correct(r1(r"\frac{1}{2}"), "0.5")  # the child started and warm: its start is not the bound
    t = time.perf_counter()
    assert reward_correct(r1(answer), "7") == 0.0
    assert time.perf_counter() - t < 1.0 + 0.3  # the bound, and killing the child
    assert reward_correct(r1(r"\frac{1}{2}"), "0.5") == 1.0  # a fresh child answers the next one


def test_the_bound_holds_in_a_thread_without_signals():
    out = []
    th = threading.Thread(target=lambda: out.append((reward_correct(r1(r"9^{9^{9^{9}}}"), "1"),
                                                     reward_correct(r1(r"\frac{3}{4}"), "0.75"))))
    t = time.perf_counter()
    th.start()
    th.join(30)
    assert out == [(0.0, 1.0)] and time.perf_counter() - t < 5


def test_the_verifiers_child_holds_nothing_of_the_run(monkeypatch):
    monkeypatch.setenv("ASYNCRL_RUN_SECRET", "a-secret-the-child-must-not-see-" + "0123456789abcdef")
    v = bounded_verify.Verifier()
    assert v.equal(r"\frac{1}{2}", "0.5")
    env = open(f"/proc/{v._proc.pid}/environ", "rb").read().split(b"\0")
    assert not any(e.startswith(b"ASYNCRL_RUN_SECRET") for e in env)
    limits = open(f"/proc/{v._proc.pid}/limits").read()
    assert str(bounded_verify.MEMORY_BYTES) in limits  # its address space bounded
    # it runs from the repository, which a clone without `pip install -e .` needs (the child imports
    # common.rewards.bounded_verify from there: a root one folder too deep made every comparison False)
    assert os.readlink(f"/proc/{v._proc.pid}/cwd") == bounded_verify.ROOT
    assert os.path.isfile(os.path.join(bounded_verify.ROOT, "common", "rewards", "bounded_verify.py"))
    v._proc.kill()


def test_the_reward_never_raises_and_warns_once(caplog, monkeypatch):
    import logging

    def boom(*a, **k):
        raise RuntimeError("sympy exploded")
    monkeypatch.setattr(math_answer, "latex_equal", boom)
    monkeypatch.setattr(math_answer, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="asyncrl.math_answer"):
        assert reward_correct(r1(r"\frac{1}{2}"), "5") == 0.0 and reward_correct(r1(r"\frac{3}{2}"), "5") == 0.0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][0].count("sympy exploded") == 1
    assert reward_correct(None, "5") == 0.0 and reward_correct("#### 5", None) == 0.0  # type: ignore[arg-type]


def test_gsm8k_golds_are_rewarded_against_their_own_solutions():
    with gzip.open(os.path.join(os.path.dirname(__file__), "..", "data", "gsm8k", "test.jsonl.gz"), "rt") as f:
        rows = [json.loads(x) for x in f.read().splitlines()[:200]]
    assert all(reward_correct(r["answer"], gold_answer(r["answer"])) == 1.0 for r in rows)
