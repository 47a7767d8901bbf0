"""The math reward on realistic completions, and how fast it is: one JSON line.

1. Fidelity. bench/data/math_reward_cases.jsonl holds GSM8K-format chains of thought and R1-style
   reasoning (kept apart from the tests), each with the right reward written by hand. Each grader
   is judged on them: cases it gets wrong, and of those the false rewards (paid for a wrong answer).
   Graders: ours (common/rewards/math_answer.py), math-verify alone over the whole completion (`verify(parse(
   gold), parse(completion))`, its defaults), TBA's grader (the last number of the completion, as
   its gsm8k_utils.py reads it) and, with --before REV, this repository's reward at that commit
   (loaded from git, run in this process).
2. Throughput. Synthetic R1-style completions of about 4k tokens (16k characters of reasoning, then
   the boxed answer), half plain numbers and half LaTeX (fractions, powers, mixed numbers, radicals),
   scored one after another; ours against math-verify over the whole text and over the box alone.
   The process (and the verifier's child) is pinned to one core.

    python bench/math_reward.py [--before 6609191] [--n 400]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.rewards.math_answer import reward_correct  # noqa: E402

CASES = ROOT / "bench" / "data" / "math_reward_cases.jsonl"
_TBA_NUMBER = re.compile(r"(?:[+-]?\d+\.\d*|[+-]?\.\d+|[+-]?\d+e[-+]?\d+|[+-]?\d+)")


def tba_grader(completion: str, gold: str) -> float:
    """TBA's: commas removed, the last number of the whole completion against the gold's, as floats."""
    def last(s):
        found = _TBA_NUMBER.findall(s.replace(",", ""))
        return float(found[-1]) if found else None
    g, p = last(gold), last(completion)
    return float(g is not None and p is not None and g == p)


def math_verify_alone(completion: str, gold: str) -> float:
    from math_verify import parse, verify  # the baseline's own import
    try:
        return float(verify(parse(gold), parse(completion)))
    except Exception:  # noqa: BLE001
        return 0.0


def before(rev: str):
    """`reward_correct` of common/rewards/math_answer.py at commit `rev` (a module loaded from git)."""
    for path in ("common/rewards/math_answer.py", "common/math_answer.py"):  # where it lived before the rooms
        r = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if r.returncode == 0:
            src = r.stdout
            break
    else:
        raise SystemExit(f"--before {rev}: no math_answer.py at that commit")
    spec = importlib.util.spec_from_loader(f"math_answer_{rev}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, f"math_answer@{rev}", "exec"), mod.__dict__)  # our own code, from our own history
    return mod.reward_correct


def judge(grader, cases: list[dict]) -> dict:
    wrong = [c for c in cases if grader(c["completion"], c["gold"]) != c["right"]]
    false = [c for c in wrong if c["right"] == 0]
    return {"wrong": len(wrong), "false_rewards": len(false), "missed": len(wrong) - len(false),
            "wrong_notes": [f"{c['kind']}: {c['note'] or c['completion'][-40:]!r} (gold {c['gold']})" for c in wrong]}


_LATEX = [("\\frac{{{a}}}{{{b}}}", lambda a, b: a / b), ("{a}^{{{b}}}", lambda a, b: a ** b),
          ("{a}\\frac{{1}}{{{b}}}", lambda a, b: a + 1 / b), ("\\sqrt{{{sq}}}", None)]


def synthetic(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(completion, gold) pairs: ~16k characters of reasoning with numbers and LaTeX, then a box."""
    rng = random.Random(seed)
    words = "so then we get the total of each step which gives us and check again carefully".split()
    out = []
    for i in range(n):
        body = []
        while sum(len(x) for x in body) < 16_000:
            a, b = rng.randint(2, 99), rng.randint(2, 9)
            body.append(f"{' '.join(rng.choices(words, k=12))} {a} \\times {b} = {a * b}, and $\\frac{{{a}}}{{{b}}}$. ")
        a, b = rng.randint(2, 30), rng.randint(2, 5)
        if i % 2 == 0:  # a plain number
            gold = str(a * b)
            box = gold if rng.random() < 0.5 else f"{a * b:,}"
        else:  # LaTeX
            form, value = _LATEX[i // 2 % len(_LATEX)]
            if value is None:
                box, gold = form.format(sq=a * a), str(a)
            else:
                box, gold = form.format(a=a, b=b), f"{value(a, b):.12g}"
        out.append(("<think>\n" + "".join(body) + "\n</think>\n\nThe answer is $\\boxed{" + box + "}$.", gold))
    return out


def rate(fn, pairs) -> tuple[float, float]:
    """(per second, the fraction paid) over `pairs`, after one warm-up call."""
    fn(*pairs[0])
    t, paid = time.perf_counter(), 0.0
    for c, g in pairs:
        paid += fn(c, g)
    return len(pairs) / (time.perf_counter() - t), paid / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="also judge the reward at this commit (git)")
    ap.add_argument("--n", type=int, default=400, help="synthetic completions for the throughput")
    a = ap.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core: the verifier's child inherits it
    cases = [json.loads(x) for x in CASES.read_text().splitlines() if x.strip()]
    res = {"bench": "math_reward", "cases": len(cases), "right_answers": sum(c["right"] for c in cases),
           "ours": judge(reward_correct, cases), "math_verify_alone": judge(math_verify_alone, cases),
           "tba_last_number": judge(tba_grader, cases)}
    if a.before:
        res[f"before_{a.before}"] = judge(before(a.before), cases)
    pairs = synthetic(a.n)
    ours, paid = rate(reward_correct, pairs)
    whole, _ = rate(math_verify_alone, pairs[: max(20, a.n // 10)])
    box = [("\\boxed{" + c.rsplit("\\boxed{", 1)[1].split("}$", 1)[0] + "}", g) for c, g in pairs]
    box_only, _ = rate(math_verify_alone, box[: max(40, a.n // 4)])
    res["throughput"] = {"completions": len(pairs), "chars_each": round(sum(len(c) for c, _ in pairs) / len(pairs)),
                         "ours_per_s": round(ours, 1), "ours_paid": paid,
                         "math_verify_whole_text_per_s": round(whole, 1), "math_verify_box_only_per_s": round(box_only, 1),
                         "one_core": True}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
