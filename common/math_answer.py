"""The final answer of a math completion, and the 0/1 reward that compares it with the gold one:
GSM8K's "#### 42" and the reasoning models' \\boxed{42} (R1-Distill, DeepScaleR), any math word problem's.

Runs wherever a reward is computed: the generators (or reward workers) and the trainer's evaluation
(`run_gsm8k.py`'s `reward_fn` and `greedy_pass_at_1`).

    r(y, gold) = 1[ extract_answer(y) == gold ]   numerically ("18.00" == "18", "1,200" == "1200"),
                                                  math-verify as the fallback ("0.5" == "1/2")

extract_answer(y): the number in the last \\boxed{...} or after the last '####', whichever comes later
in the text; else the number after the last "answer is"; else the last number; None when there is none.
"""
from __future__ import annotations

import logging
import math
import re
import threading

log = logging.getLogger("asyncrl.math_answer")

# a number: optional sign (not when it is a binary minus like "3-5"), optional $, then either
# comma-grouped thousands "1,234,567" or plain digits, optional decimals, or a bare ".5"
_NUM = re.compile(r"(?:(?<![\w)\]])-\s?)?\$?\s?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_ANSWER_IS = re.compile(r"answer\s+is", re.IGNORECASE)


def normalise_number(s: str) -> str:
    """'$1,200.' -> '1200', '- 3' -> '-3'; other text is returned stripped."""
    s = s.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    return s


def _first_number(text: str) -> str | None:
    m = _NUM.search(text)
    return normalise_number(m.group(0)) if m else None


# \boxed{...} (R1-Distill / DeepScaleR-style reasoning models), \fbox{...} alike; its braces may nest
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MAX_BOX_CHARS = 256  # a box holding more is not a final answer
_BRACE = re.compile(r"(?<!\\)[{}]")  # a brace; "\{" and "\}" are literal braces in LaTeX
_TEXT_CMD = re.compile(r"\\(?:text|textrm|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\\\$|\\%")  # thin spaces ("1\,234"), \left( , \$, \%
_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(-?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}|(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)")


def _boxed_value(content: str) -> str | None:
    """The number a \\boxed{...} holds: "1,234" -> "1234", "\\$18" -> "18", "\\text{42}" -> "42",
    "x = 5" -> "5" (after the last '='), "\\frac{3}{4}" or "3/4" -> "3/4" (compared by math-verify),
    "5 \\text{ apples}" -> "5" (its first number); None when it holds none."""
    s = content
    for _ in range(3):  # \text{\textbf{42}}: nested wrappers, innermost first
        s = _TEXT_CMD.sub(r" \1 ", s)
    s = _LATEX_NOISE.sub("", s.replace("{,}", ","))
    s = s.rsplit("=", 1)[-1]
    frac = _FRACTION.fullmatch(s.replace(" ", "").replace("$", ""))
    if frac:
        sign, num, den = frac.groups()[:3] if frac.group(2) else ("", *frac.groups()[3:])
        return f"{sign}{num}/{den}"
    return _first_number(s)


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(where it starts, its number) of the last complete \\boxed{...} in `text` that holds a number,
    or None. Braces are matched once over the text (linear time, whatever the nesting); a box
    left open (a completion cut at max_new_tokens) is skipped, and so is one holding more than
    _MAX_BOX_CHARS characters (not a final answer; boxes nested in boxes stay linear)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    closing, stack = {}, []
    for m in _BRACE.finditer(text, boxes[0].end() - 1):
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            closing[stack.pop()] = m.start()
    for box in reversed(boxes):
        end = closing.get(box.end() - 1)
        if end is not None and end - box.end() <= _MAX_BOX_CHARS:
            value = _boxed_value(text[box.end():end])
            if value is not None:
                return box.start(), value
    return None


def extract_answer(text: str) -> str | None:
    """Final numeric answer of a completion: the number in its last \\boxed{...} or after its last
    '####', whichever comes later in the text (the LAST box that holds a number: nested braces,
    '$' and thousands commas handled); else the number after the last "answer is"; else the last
    number in the text; None when there is no number."""
    if not text:
        return None
    marker = text.rfind("####")
    boxed = _last_boxed(text)
    if boxed is not None and boxed[0] > marker:
        return boxed[1]
    if marker >= 0:
        ans = _first_number(text[marker + 4:])
        if ans is not None:
            return ans
    if boxed is not None:
        return boxed[1]
    hits = list(_ANSWER_IS.finditer(text))
    if hits:
        ans = _first_number(text[hits[-1].end():])
        if ans is not None:
            return ans
    last = None
    for last in _NUM.finditer(text):  # keep only the final match
        pass
    return normalise_number(last.group(0)) if last else None


# ---------------------------------------------------------------------------------------------
# the reward

_warned = False  # warn once per process: a systematic failure would otherwise spam every sample


def _to_float(s: str) -> float | None:
    try:
        x = float(normalise_number(s))
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
            return 1.0 if _math_verify_equal(normalise_number(gold), pred) else 0.0
        return 0.0
    except Exception as e:  # noqa: BLE001 - a reward must never kill a generator
        if not _warned:
            log.warning("reward_correct: %s: %s; returning 0.0 (further failures logged at DEBUG)",
                        type(e).__name__, e)
            _warned = True
        else:
            log.debug("reward_correct failed: %r", e)
        return 0.0
