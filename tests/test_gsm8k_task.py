"""Tests for run_gsm8k.py: loading (real files + malformed ones), prompts, presets, the reward it
takes (common/rewards/math_answer.py, whose own cases are tests/test_math_answer.py)."""
import json

import pytest

import common.rewards.math_answer as math_answer
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


def test_the_task_takes_the_math_reward():
    """The reward's own cases: tests/test_math_answer.py; here the task's names for it."""
    assert gsm.reward_fn("so #### 1,200", "1200") == 1.0 and gsm.reward_fn(r"\boxed{2^{10}}", "2") == 0.0
    assert extract_answer(r"\boxed{\$18}") == "18" and reward_correct is math_answer.reward_correct


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
