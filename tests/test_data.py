"""The data a fresh clone runs on: the repository's own copies (data/), read without anything
beside the clone, and a hub id that fails at once, in one line, when the hub cannot be reached.
(tests/conftest.py also makes any open of a folder beside the clone fail in every test.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import run_tldr
from common.data import REPO_DATA, DataSourceError, default_data_dir, iter_rows, load_examples

ROOT = Path(__file__).resolve().parents[1]
SIBLING = ".." + "/shared"  # spelled apart, so that this file does not match its own search


def test_the_repository_holds_the_default_data_with_its_source_and_licence(monkeypatch):
    monkeypatch.delenv("ASYNCRL_DATA_DIR", raising=False)
    assert default_data_dir("tldr") == REPO_DATA / "tldr" and run_tldr.DataConfig().source == str(REPO_DATA / "tldr")
    for split in ("train", "val"):
        ex = run_tldr.load_split(str(REPO_DATA / "tldr"), split)
        assert len(ex) == 1000 and all(e.sentences and e.summary for e in ex)
    readme = (REPO_DATA / "README.md").read_text()
    assert "MIT" in readme and "openai/gsm8k" in readme and "TLDRHQ" in readme
    sizes = sum(f.stat().st_size for f in REPO_DATA.rglob("*.gz"))
    assert sizes < 5e6  # compressed: the clone stays small


def test_no_file_of_the_repository_points_beside_it():
    """Nothing may read a folder next to the clone: a fresh clone has none."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    needles = (SIBLING, "shared" + "/data", "shared" + '" / "data')
    hits = [f for f in files if f.endswith((".py", ".md", ".ipynb", ".sh", ".toml", ".ini", ".txt", ".json", "run"))
            and (ROOT / f).is_file() and any(n in (ROOT / f).read_text(errors="replace") for n in needles)]
    assert hits == []


def test_the_audit_hook_refuses_to_open_beside_the_clone(tmp_path):
    from tests.conftest import BESIDE
    with pytest.raises(PermissionError, match="beside the clone"):
        open(BESIDE / "data" / "x.jsonl")
    os.listdir(tmp_path)  # anything else is untouched


def test_env_dir_replaces_the_repository_copy(tmp_path, monkeypatch):
    (tmp_path / "tldr").mkdir()
    monkeypatch.setenv("ASYNCRL_DATA_DIR", str(tmp_path))
    assert default_data_dir("tldr") == tmp_path / "tldr"
    assert default_data_dir("gsm8k") == REPO_DATA / "gsm8k"  # no gsm8k there: the repository's


@pytest.mark.parametrize("how", ["offline_flag", "unreachable_host"])
def test_a_hub_id_offline_fails_at_once(monkeypatch, how):
    pytest.importorskip("datasets")
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    if how == "offline_flag":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # nothing listens on port 9 of this machine: the connection is refused at once
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(DataSourceError) as e:
        load_examples("openai/gsm8k", "train", lambda row, where: row, hub_config="main")
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "\n" not in msg and "openai/gsm8k" in msg and "--data.source" in msg
    assert ("HF_HUB_OFFLINE is set" in msg) == (how == "offline_flag")
    assert e.value.__cause__ is None  # nothing chained: the message is the whole story


def test_the_script_reports_an_unreachable_hub_in_one_line():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ASYNCRL_NUM_THREADS": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "run_gsm8k.py", "--data.source=openai/gsm8k"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: hub dataset 'openai/gsm8k' cannot be loaded: HF_HUB_OFFLINE is set")
    assert time.monotonic() - t0 < 60  # the import of torch and transformers, no network wait


def test_iter_rows_rejects_what_is_neither_folder_nor_hub_id(tmp_path):
    with pytest.raises(DataSourceError, match="not a local folder"):
        list(iter_rows(str(tmp_path / "missing" / "x"), "train"))
