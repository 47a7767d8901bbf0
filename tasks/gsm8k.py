"""GSM8K task: data loading, prompt formatting and the 0/1 correctness reward.

Used by the run script (data + prompts, in the trainer/driver process) and by the generator
processes (reward_correct is called on every sampled completion). The reward is the r(x, y) in
TBA's target pi*(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta):
    r(x, y) = 1[ extract_answer(y) == gold(x) ]   (numeric equality, math_verify as fallback)

Data rows are JSONL `{"question": ..., "answer": "<reasoning>#### 42"}`; the gold answer is the
text after the last '####' with thousands separators removed ("1,200" -> "1200").
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PAPER_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"
INSTRUCTION = "\nSolve step by step and give the final answer as a number after '####'."
PROMPT_STYLES = ("chat", "paper")


@dataclass
class GSM8KExample:
    question: str
    answer: str   # full reference solution, '#### gold' included
    gold: str     # normalised final answer, e.g. "1200"


# ---------------------------------------------------------------------------------------------
# data

def default_data_dir() -> Path | None:
    """First existing of $ASYNCRL_DATA_DIR/gsm8k, <repo>/../shared/data/gsm8k, <repo>/data/gsm8k."""
    repo = Path(__file__).resolve().parent.parent
    candidates = []
    if os.environ.get("ASYNCRL_DATA_DIR"):
        candidates.append(Path(os.environ["ASYNCRL_DATA_DIR"]) / "gsm8k")
    candidates += [repo.parent / "shared" / "data" / "gsm8k", repo / "data" / "gsm8k"]
    for c in candidates:
        if c.is_dir():
            return c
    return None


def load_gsm8k(path, limit: int | None = None) -> list[GSM8KExample]:
    """Read a GSM8K JSONL file; errors name the file and the 1-based line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K data file not found: {path} "
                                f"(point the run at the right folder with --data.dir=<dir with train/test.jsonl>)")
    examples: list[GSM8KExample] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str):
                    raise ValueError(f"{where}: missing or non-string key {key!r}")
            answer = row["answer"]
            if "####" not in answer:
                raise ValueError(f"{where}: answer has no '####' gold marker")
            gold = _normalise_number(answer.rsplit("####", 1)[1].strip())
            if not gold:
                raise ValueError(f"{where}: empty gold answer after '####'")
            examples.append(GSM8KExample(question=row["question"], answer=answer, gold=gold))
    return examples


# ---------------------------------------------------------------------------------------------
# prompts

def format_prompt(question: str, tokenizer=None, style: str = "chat") -> str:
    """Prompt string for `question`. "chat": the tokenizer's chat template with INSTRUCTION
    appended to the user turn; "paper": PAPER_TEMPLATE (the TBA paper's raw-text prompt)."""
    if style == "paper":
        return PAPER_TEMPLATE.format(question=question)
    if style == "chat":
        if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("format_prompt(style='chat') needs a tokenizer with apply_chat_template")
        return tokenizer.apply_chat_template([{"role": "user", "content": question + INSTRUCTION}],
                                             add_generation_prompt=True, tokenize=False)
    raise ValueError(f"format_prompt: unknown style {style!r}, expected one of {PROMPT_STYLES}")


# ---------------------------------------------------------------------------------------------
# answer extraction

# a number: optional sign (not when it is a binary minus like "3-5"), optional $, then either
# comma-grouped thousands "1,234,567" or plain digits, optional decimals, or a bare ".5"
_NUM = re.compile(r"(?:(?<![\w)\]])-\s?)?\$?\s?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_ANSWER_IS = re.compile(r"answer\s+is", re.IGNORECASE)


def _normalise_number(s: str) -> str:
    """'$1,200.' -> '1200', '- 3' -> '-3'; other text is returned stripped."""
    s = s.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    return s


def _first_number(text: str) -> str | None:
    m = _NUM.search(text)
    return _normalise_number(m.group(0)) if m else None


def extract_answer(text: str) -> str | None:
    """Final numeric answer of a completion: the number after the last '####', else after the
    last "answer is", else the last number in the text; None when there is no number."""
    if not text:
        return None
    if "####" in text:
        ans = _first_number(text.rsplit("####", 1)[1])
        if ans is not None:
            return ans
    hits = list(_ANSWER_IS.finditer(text))
    if hits:
        ans = _first_number(text[hits[-1].end():])
        if ans is not None:
            return ans
    last = None
    for last in _NUM.finditer(text):  # keep only the final match
        pass
    return _normalise_number(last.group(0)) if last else None


# ---------------------------------------------------------------------------------------------
# reward

_warned = False  # warn once per process: a systematic failure would otherwise spam every sample


def _to_float(s: str) -> float | None:
    try:
        x = float(_normalise_number(s))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _math_verify_equal(gold: str, pred: str) -> bool:
    import math_verify  # lazy: sympy import costs ~1 s and most rewards never get here

    # math_verify's default timeout uses signal.alarm, which raises outside the main thread;
    # our inputs are short number strings, so running without a timeout there is safe
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(math_verify.verify(math_verify.parse(gold, parsing_timeout=timeout),
                                   math_verify.parse(pred, parsing_timeout=timeout),
                                   timeout_seconds=timeout))


def reward_correct(completion_text: str, gold: str, use_math_verify: bool = True) -> float:
    """1.0 if the completion's extracted answer equals `gold`, else 0.0. Never raises.

    Numeric comparison first ("18.00" == "18", "1,200" == "1200"); if that fails and
    use_math_verify, math_verify decides (e.g. "0.5" vs "1/2"). Timed on this machine:
    ~0.5-2 ms per call on short number strings (~30 ms on the very first, warm-up call), so it
    stays on by default. Any exception -> 0.0 and one logged warning per process.
    """
    global _warned
    try:
        pred = extract_answer(completion_text)
        if pred is None:
            return 0.0
        g, p = _to_float(gold), _to_float(pred)
        if g is not None and p is not None and math.isclose(g, p, rel_tol=1e-9, abs_tol=1e-9):
            return 1.0
        # a huge digit string is garbage, and sympy on it could be slow: don't hand it over
        if use_math_verify and len(pred) <= 64:
            return 1.0 if _math_verify_equal(_normalise_number(gold), pred) else 0.0
        return 0.0
    except Exception as e:  # noqa: BLE001 - a reward must never kill a generator
        if not _warned:
            log.warning("reward_correct: %s: %s; returning 0.0 (further failures logged at DEBUG)",
                        type(e).__name__, e)
            _warned = True
        else:
            log.debug("reward_correct failed: %r", e)
        return 0.0
