"""The final answer of a math completion, and the 0/1 reward that pays only for a right one:
GSM8K's "#### 42" and the reasoning models' \\boxed{...} (R1-Distill, DeepScaleR), against a gold
answer that is a number (GSM8K) or LaTeX (MATH, AIME).

Runs wherever a reward is computed: the generators (or reward workers) and the trainer's evaluation
(`run_gsm8k.py`'s `reward_fn` and `greedy_pass_at_1`). Pure functions but the symbolic comparison,
which runs math-verify in a child process of its own (common/rewards/bounded_verify.py), bounded in time.

    r(y, gold) = 1[ answer(y) equals answer(gold) ]

`final_answer(y)`, whichever of these comes later in the text:
  * the whole content of the last \\boxed{...} / \\fbox{...} (never its first number: \\boxed{2^{10}}
    is 1024, \\boxed{3\\frac12} is 3.5, \\boxed{12-5} is 7), or
  * GSM8K's own rule after the last '####': the first number that follows ("#### 42 apples. Check: 7"
    is 42).
  A last box left open (a completion cut at the token limit, "... so \\boxed{4") is no answer: 0.
  With neither marker: the number after the last "answer is", else the last number (TBA's grader).

Equality: the two answers normalised the same way (LaTeX spacing "\\,", "{,}", "\\!", thousands
commas and digit-group spaces, \\$ and $, \\text{...} units after the number, a trailing period, the
Unicode minus, "x = 5" read as its right-hand side, \\left/\\right); two plain numbers compare as
exact decimals without any parser (the common case never waits); anything else (fractions, mixed
numbers, powers, scientific notation, products and sums, radicals, LaTeX golds) goes to math-verify.
A percentage is its number as written: "50\\%" equals 50, not 0.5, since the datasets record a
percentage answer without its sign ("#### 25" for "25%"); reading it as 0.5 as well would pay a
hedge that writes "%" after any number.
"""
from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation

from common.rewards.bounded_verify import latex_equal

log = logging.getLogger("asyncrl.math_answer")

MAX_ANSWER_CHARS = 1000  # a box (or gold) holding more is not a final answer: 0, never parsed
# a number: optional sign (not a binary minus like "3-5"), optional $, then comma-grouped thousands
# "1,234,567" or plain digits, optional decimals, or a bare ".5"
_NUM = re.compile(r"(?:(?<![\w)\]])-\s?)?\$?\s?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_ANSWER_IS = re.compile(r"answer\s+is", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"(?<!\\)[{}]")  # a brace; "\{" and "\}" are literal braces in LaTeX
_TEXT = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,!;: ]|\\q?quad\b|~|\\left\b|\\right\b|\\displaystyle\b")
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\ufe63": "-", "\uff0d": "-"})
_GROUPED = re.compile(r"(?<![\d.])\d{1,3}(?:[ ,]\d{3})+(?![\d])")  # 1,234 / 10 000 (thousands)
_UNITS = re.compile(r"^(.*?\d)\s+(?:[A-Za-z][A-Za-z.]*(?:\s*\^\s*\{?\d\}?)?\s*)+$")  # "18 dollars", "25 m^2" -> the number ("5x" is not)
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
_LHS = re.compile(r"^\s*[A-Za-z]\w*\s*=(?!=)(.*)$", re.S)  # "x = 5" -> "5"


def normalise_number(s: str) -> str:
    """'$1,200.' -> '1200', '- 3' -> '-3'; other text is returned stripped."""
    return s.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")


def _first_number(text: str) -> str | None:
    m = _NUM.search(text)
    return normalise_number(m.group(0)) if m else None


def _last_box(text: str) -> tuple[int, str | None] | None:
    """(where the last \\boxed{ / \\fbox{ starts, its content or None when left open or too long),
    or None without a box. Braces are matched once over the text from the first box (linear time,
    whatever the nesting)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    last, depth = boxes[-1], 0
    for m in _BRACE.finditer(text, last.end() - 1):
        depth += 1 if m.group(0) == "{" else -1
        if depth == 0:
            content = text[last.end():m.start()]
            return last.start(), content if len(content) <= MAX_ANSWER_CHARS else None
    return last.start(), None  # left open: cut at the token limit


def final_answer(text: str) -> str | None:
    """The text of a completion's final answer (module docstring), or None: no answer, a last box
    left open or too long to be one. An empty box, or a '####' with no number after it, is no
    marker at all: the other one, or the fallbacks, decide."""
    if not text:
        return None
    text = text.translate(_MINUS)  # one character for one: positions kept
    marker, box = text.rfind("####"), _last_box(text)
    hashed = _first_number(text[marker + 4:]) if marker >= 0 else None
    if box is not None and box[1] is not None and not box[1].strip():
        box = None  # \boxed{}: holds nothing
    if box is not None and (box[0] > marker or hashed is None):
        return box[1]  # None: left open (cut at the token limit) or too long
    if hashed is not None:
        return hashed
    hits = list(_ANSWER_IS.finditer(text))
    if hits and (ans := _first_number(text[hits[-1].end():])) is not None:
        return ans
    last = None
    for last in _NUM.finditer(text):  # keep only the final match
        pass
    return normalise_number(last.group(0)) if last else None


def extract_answer(text: str) -> str | None:
    """`final_answer`, normalised: what a task compares and shows ("1,200" -> "1200", "\\$18" -> "18")."""
    ans = final_answer(text)
    return None if ans is None else normalise_answer(ans)


def gold_answer(gold: str) -> str:
    """The gold answer of a dataset row or a bare value: after its last '####' (GSM8K's rule), the
    content of its last box (MATH-style solutions), else the value itself."""
    if "####" in gold or _BOXED.search(gold):
        ans = final_answer(gold)
        return "" if ans is None else ans
    return gold


def normalise_answer(s: str) -> str:
    """An answer's text with the notation that does not change its value removed (module docstring)."""
    s = s.translate(_MINUS).replace("{,}", ",").replace("\\%", "%").replace("\\$", "$")
    for _ in range(3):  # \text{\textbf{42}}: nested wrappers, innermost first
        s = _TEXT.sub(r" \1 ", s)
    s = _SPACING.sub(" ", s).replace("$", "").replace("%", "")
    if (m := _LHS.match(s)) and "=" not in m.group(1):
        s = m.group(1)
    s = _GROUPED.sub(lambda g: g.group(0).replace(",", "").replace(" ", ""), s.strip())
    s = s.strip().rstrip(".").strip()
    if (m := _UNITS.match(s)) and _PLAIN.fullmatch(m.group(1).strip()):
        s = m.group(1).strip()
    return s


def plain_number(s: str) -> Decimal | None:
    """The exact decimal a normalised answer is, where it is a plain number ("42", "-3.50", ".5"), else None."""
    if not _PLAIN.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def answers_equal(gold: str, pred: str) -> bool:
    """Whether two answers (raw text: a box's content, a '####' answer, a gold value) are equal:
    plain numbers exactly, anything else symbolically (math-verify, bounded: common/rewards/bounded_verify.py)."""
    g, p = normalise_answer(gold), normalise_answer(pred)
    if not g or not p or len(g) > MAX_ANSWER_CHARS or len(p) > MAX_ANSWER_CHARS:
        return False
    gn, pn = plain_number(g), plain_number(p)
    if gn is not None and pn is not None:
        return gn == pn
    if g == p:
        return True
    return latex_equal(g, p)


_warned = False  # warn once per process: a systematic failure would otherwise spam every sample


def reward_correct(completion_text: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold one, else 0.0 (module docstring). Never
    raises: any failure scores 0 and is logged once per process."""
    global _warned
    try:
        pred = final_answer(completion_text)
        return float(pred is not None and answers_equal(gold_answer(gold), pred))
    except Exception as e:  # noqa: BLE001 - a reward must never kill a generator
        if not _warned:
            log.warning("reward_correct: %s: %s; returning 0.0 (further failures logged at DEBUG)", type(e).__name__, e)
            _warned = True
        else:
            log.debug("reward_correct failed: %r", e)
        return 0.0

