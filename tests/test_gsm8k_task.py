"""Tests for run_gsm8k.py and common/math_answer.py: loading (real files + malformed ones), prompts,
answer extraction and the 0/1 reward (including that it never raises)."""
import json
import logging

import pytest

import common.math_answer as math_answer
import run_gsm8k as gsm
from common.data import REPO_DATA
from run_gsm8k import (PAPER_TEMPLATE, GSM8KExample, default_data_dir, extract_answer,
                         format_prompt, load_gsm8k, reward_correct)

DATA = REPO_DATA / "gsm8k"


def test_load_the_repositorys_copy(monkeypatch):
    monkeypatch.delenv("ASYNCRL_DATA_DIR", raising=False)
    assert default_data_dir() == REPO_DATA / "gsm8k" and gsm.DataConfig().source == str(REPO_DATA / "gsm8k")
    train, test = gsm.load_split(str(DATA), "train"), gsm.load_split(str(DATA), "test")
    assert (len(train), len(test)) == (7473, 1319)
    assert isinstance(train[0], GSM8KExample) and train[0].gold == "72"
    assert all("," not in ex.gold for ex in train + test)
    # every reference solution earns reward 1 against its own gold
    assert all(reward_correct(ex.answer, ex.gold) == 1.0 for ex in test[:200])
    assert len(load_gsm8k(DATA / "test.jsonl.gz", limit=5)) == 5


def _write(tmp_path, lines):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps({"question": "q?", "answer": "work\n#### 1,200"})


def test_load_tmp_file_and_blank_lines(tmp_path):
    p = _write(tmp_path, [GOOD, "", "   ", GOOD])
    ex = load_gsm8k(p)
    assert len(ex) == 2 and ex[0].gold == "1200" and ex[0].question == "q?"


@pytest.mark.parametrize("bad, needle", [
    ("{not json", "malformed JSON"),
    (json.dumps({"question": "q"}), "'answer'"),
    (json.dumps({"answer": "#### 3"}), "'question'"),
    (json.dumps({"question": "q", "answer": "no marker 3"}), "####"),
    (json.dumps({"question": "q", "answer": "x ####   "}), "empty gold"),
])
def test_malformed_lines_name_file_and_line(tmp_path, bad, needle):
    p = _write(tmp_path, [GOOD, "", bad])  # bad row is on line 3 (blank line still counts)
    with pytest.raises(ValueError) as e:
        load_gsm8k(p)
    assert f"{p}:3" in str(e.value) and needle in str(e.value)


def test_missing_file_suggests_override(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data.source") as e:
        load_gsm8k(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(e.value)


def test_default_data_dir_env(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    monkeypatch.setenv("ASYNCRL_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path / "gsm8k"


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def test_format_prompt():
    assert format_prompt("What is 2+2?", None, "paper") == PAPER_TEMPLATE.format(question="What is 2+2?")
    assert format_prompt("Q", None, "paper") == "[MATH TASK] Problem:\nQ\n\nSolution:\n"
    chat = format_prompt("What is 2+2?", FakeTokenizer(), "chat")
    assert chat.startswith("<user>What is 2+2?\n") and "####" in chat and chat.endswith("<assistant>")
    with pytest.raises(ValueError):
        format_prompt("Q", None, "nope")
    with pytest.raises(ValueError):
        format_prompt("Q", None, "chat")


@pytest.mark.parametrize("text, expected", [
    ("So she sold 72 clips.\n#### 72", "72"),
    ("first 5 then #### 1,234", "1234"),
    ("#### 3 and later #### 9", "9"),              # last '####' wins
    ("We get 10 and 20. The answer is 30.", "30"),
    ("The answer is $1,200.50", "1200.50"),
    ("costs $18.", "18"),                          # $ sign and trailing period
    ("temperature drops to -5 degrees", "-5"),
    ("x = -4.5.", "-4.5"),
    ("from 3-5 we get 2", "2"),                    # binary minus is not a sign
    ("she has 3-5", "5"),
    ("1, 2, 3, then 4", "4"),                      # list commas are not thousands separators
    ("#### no number here but 7 before", "7"),      # empty '####' falls back
    ("no digits at all", None),
    ("", None),
    # \boxed{...}, as R1-Distill / DeepScaleR-style reasoning models write it
    (r"so the answer is \boxed{42}.", "42"),
    (r"Total: \boxed{1,234} dollars", "1234"),               # thousands commas
    (r"$\boxed{\$1,200.50}$", "1200.50"),                  # $ and \$ stripped
    (r"\boxed{1{,}234} or \boxed{5\,000}", "5000"),       # LaTeX's {,} and thin-space separators
    (r"\boxed{\frac{3}{4}}", "3/4"),                       # nested braces
    (r"\boxed{-\dfrac{3}{4}}", "-3/4"),
    (r"\boxed{\text{42}}", "42"),
    (r"\boxed{18 \text{ dollars}}", "18"),
    (r"\boxed{x = 5}", "5"),                               # the value after '='
    (r"\boxed{-7}", "-7"),
    (r"\boxed{2.5\%}", "2.5"),
    (r"first \boxed{3}, on reflection \boxed{7} and 9 apples", "7"),  # the LAST box wins, over later numbers
    (r"\boxed{3} then cut off: \boxed{4", "3"),           # an unclosed box (cut at max_new_tokens) is skipped
    (r"\boxed{6} \boxed{} and 9", "6"),                   # an empty box holds no answer
    (r"\boxed {12}", "12"),
    (r"\fbox{12}", "12"),
    (r"\boxed{\boxed{8}}", "8"),
    (r"#### 5, then \boxed{6}", "6"),                      # the later of '####' and a box
    (r"\boxed{6}, then #### 5", "5"),
    (r"\boxed{6}, then #### nothing", "6"),                # an empty '####' falls back to the box
    (r"The answer is \boxed{\frac{1}{2}}", "1/2"),        # a box beats "answer is"
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_boxed_extraction_is_linear_on_hostile_text():
    import time
    t = time.perf_counter()
    assert extract_answer(r"\boxed{" * 50_000 + "1") == "1"  # 50k unclosed boxes
    assert extract_answer(r"\boxed{{" * 20_000 + "}" * 40_000 + r"\boxed{7}") == "7"
    assert extract_answer(r"9 \boxed{" * 20_000 + "}" * 20_000) == "9"  # boxes in boxes: only short ones are read
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("completion, gold, r", [
    ("She earns 10 dollars.\n#### 10", "10", 1.0),
    ("#### 11", "10", 0.0),
    ("The total is 1,200 apples.", "1200", 1.0),
    ("#### 1200", "1,200", 1.0),
    ("#### 18", "18.00", 1.0),
    ("#### 18.00", "18", 1.0),
    ("#### 42.0", "42", 1.0),
    ("#### -3", "-3", 1.0),
    ("I don't know", "5", 0.0),
    ("", "5", 0.0),
    (r"<think>3 + 4 = 7, wait, 3 x 4 = 12</think> The answer is \boxed{12}.", "12", 1.0),
    (r"\boxed{1,234}", "1234", 1.0),
    (r"\boxed{18.00}", "18", 1.0),
    (r"\boxed{7} ... \boxed{8}", "7", 0.0),
])
def test_reward_cases(completion, gold, r):
    out = reward_correct(completion, gold)
    assert out == r and type(out) is float
    assert reward_correct(completion, gold, use_math_verify=False) == r


def test_reward_math_verify_fallback():
    # numeric compare fails on a non-numeric gold; math_verify settles it
    assert reward_correct("#### 0.5", "1/2") == 1.0
    assert reward_correct("#### 0.5", "1/2", use_math_verify=False) == 0.0
    assert reward_correct(r"\boxed{\frac{3}{4}}", "0.75") == 1.0  # a boxed fraction: "3/4"
    assert reward_correct(r"\boxed{\frac{10}{2}}", "5") == 1.0
    assert reward_correct(r"\boxed{\frac{3}{4}}", "0.5") == 0.0


def test_reward_never_raises(caplog, monkeypatch):
    garbage = "x#$%^&*(" * 20_000 + "9" * 5000 + "####" + ")(" * 1000
    assert reward_correct(garbage, "3") == 0.0
    assert reward_correct("#### 5", "") == 0.0
    assert reward_correct(None, "5") == 0.0          # type: ignore[arg-type]
    assert reward_correct("#### 5", None) == 0.0     # type: ignore[arg-type]

    def boom(*a, **k):
        raise RuntimeError("sympy exploded")
    monkeypatch.setattr(math_answer, "_math_verify_equal", boom)
    monkeypatch.setattr(math_answer, "_warned", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.math_answer"):
        assert reward_correct("#### 5", "6") == 0.0
        assert reward_correct("#### 7", "6") == 0.0
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sympy exploded" in warnings[0].getMessage()


def test_reward_math_verify_in_worker_thread():
    # math_verify's default signal.alarm timeout raises outside the main thread
    import threading
    out = []
    th = threading.Thread(target=lambda: out.append(reward_correct("#### 0.5", "1/2")))
    th.start()
    th.join()
    assert out == [1.0]


def test_algo_defaults_then_overrides():
    """--algo=areal applies AReaL's settings on top of the preset; explicit overrides still win."""
    c = gsm.make_config(["--algo=areal"])
    assert (c.train.sync_every, c.train.max_staleness, c.gen.update_mode, c.gen.ref_logp) == (1, 4, "interrupt", False)
    assert c.areal.n_minibatches == 4 and c.areal.eps_clip == 0.2
    c = gsm.make_config(["--algo", "areal", "--train.max_staleness=1", "--gen.update_mode=finish"])
    assert (c.train.max_staleness, c.gen.update_mode) == (1, "finish")
    c = gsm.make_config(["--preset=gpu", "--algo=areal"])
    assert (c.gen.n, c.train.prompts_per_step, c.train.device, c.preset) == (16, 8, "cuda", "gpu")
    c = gsm.make_config([])  # TBA's defaults untouched
    assert (c.algo, c.train.max_staleness, c.gen.update_mode, c.train.sync_every) == ("tba", None, "finish", 2)


ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "Twelve hundred?", "answer": "#### 1,200", "extra": "ignored"}]


def test_datasets_folder_in_both_layouts(tmp_path):
    """A folder written by the `datasets` library (the hub's format, saved for offline use)."""
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dict"))
    for split in ("train", "test"):
        dd[split].save_to_disk(str(tmp_path / "per_split" / split))
    from run_gsm8k import load_split
    for folder in ("dict", "per_split"):
        train = load_split(str(tmp_path / folder), "train")
        assert [(e.question, e.gold) for e in train] == [("What is 2 + 3?", "5"), ("Twelve hundred?", "1200")]
        assert len(load_split(str(tmp_path / folder), "test")) == 1
        assert len(load_split(str(tmp_path / folder), "train", limit=1)) == 1
    bad = datasets.Dataset.from_list([{"question": "q", "answer": "no marker"}])
    datasets.DatasetDict({"train": bad}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"row 0: answer has no '####'"):
        load_split(str(tmp_path / "bad"), "train")
    from common.data import DataSourceError
    with pytest.raises(DataSourceError, match="no split 'test'"):
        load_split(str(tmp_path / "bad"), "test")


def test_hub_id_offline_says_use_a_local_folder(monkeypatch):
    pytest.importorskip("datasets")
    import datasets
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", "/nonexistent-asyncrl-test-cache")
    from common.data import DataSourceError
    from run_gsm8k import load_split
    with pytest.raises(DataSourceError, match="use a local folder instead") as e:
        load_split("openai/gsm8k", "train", hub_config="main")
    assert "openai/gsm8k" in str(e.value)
    with pytest.raises(DataSourceError, match="not a local folder"):
        load_split("/no/such/folder", "train")
