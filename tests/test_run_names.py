"""Run names and run folders (common/runtime/files/run_dir.py, common/contracts/run_files.py): a name is one path
component, the folder stays inside run_root, and `--overwrite` deletes only what the project
recorded when it wrote it, refusing, with the list and nothing removed, while the folder holds
anything else at any depth; checkpoint pruning and a crash's leftovers likewise."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.contracts.errors import UserError
from common.contracts.run_files import MANIFEST, foreign, record, record_files
from common.runtime.files.checkpoint_dir import clean_checkpoints, prune, remove_checkpoint
from common.runtime.files.run_dir import MARKER, RunDirError, RunNameError, check_name, open_run_dir
from common.runtime.run_log import prepare_run_dir
from common.task import RunConfig


def _cfg(root, name, overwrite=False):
    return SimpleNamespace(run_root=str(root), name=name, overwrite=overwrite)


@pytest.mark.parametrize("name, rule", [("/abs", "absolute path"), ("../x", "path separator"),
                                        ("../../x", "path separator"), ("a/b", "path separator"),
                                        ("a\\b", "path separator"), ("..", "not a folder name"),
                                        (".", "not a folder name"), ("", "empty"), ("  ", "empty"),
                                        ("run\nx", "control character"), ("a\tb", "control character"),
                                        ("a\0b", "control character"), ("x" * 300, "at most 200 characters"),
                                        ("é" * 150, "at most 200 characters")])  # 300 bytes: past a file system's 255
def test_a_name_is_one_path_component(name, rule):
    with pytest.raises(RunNameError, match=rule) as e:
        check_name(name)
    msg = str(e.value)
    assert "--name=my_run" in msg  # the rule broken and the fix
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    assert check_name("x" * 200) == "x" * 200


def test_a_bad_name_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(RunNameError):
        open_run_dir(_cfg(tmp_path / "runs", "../escaped", overwrite=True), resume=False)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


def test_a_new_run_folder_is_marked_and_records_what_it_writes(tmp_path):
    d = prepare_run_dir(RunConfig(name="r", run_root=str(tmp_path)), resume=False)
    marker = json.loads((d / MARKER).read_text())
    assert marker["project"] == "asyncrl" and marker["name"] == "r" and marker["created"]
    assert (d / "config.json").is_file() and "f config.json" in (d / MANIFEST).read_text()
    assert foreign(d) == []


def test_a_folder_without_the_marker_is_never_taken_for_a_run_whatever_its_names(tmp_path):
    """No name heuristics: entries named as a run's are someone else's without the marker."""
    d = tmp_path / "other_tool"
    (d / "checkpoints" / "epoch_10").mkdir(parents=True)
    (d / "checkpoints" / "epoch_10" / "model.pt").write_text("another tool's weights")
    for f in ("config.json", "metrics.jsonl"):
        (d / f).write_text("{}")
    (d / "tensorboard").mkdir()
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match=r"not made by this project \(it holds checkpoints/, config\.json.*"
                                              r"nothing was changed"):
            open_run_dir(_cfg(tmp_path, "other_tool", overwrite=overwrite), resume=False)
    assert (d / "checkpoints" / "epoch_10" / "model.pt").read_text() == "another tool's weights"
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(RunDirError, match="not made by this project"):
        open_run_dir(_cfg(tmp_path, "model"), resume=False)
    assert json.loads((m / "config.json").read_text()) == {"model_type": "llama"}


def _earlier_run(tmp_path) -> Path:
    """A run folder as a run leaves it: every entry recorded when written."""
    d = open_run_dir(_cfg(tmp_path, "r"), resume=False)
    for f in ("metrics.jsonl", "config.json", "precision.json", "curves.png", "workers.json"):
        record(d / f)
        (d / f).write_text("x")
    (d / "checkpoints" / "step_000003" / "model").mkdir(parents=True)
    (d / "checkpoints" / "step_000003" / "model" / "model.safetensors").write_text("w")
    (d / "checkpoints" / "step_000003" / "meta.json").write_text("{}")
    record_files(d / "checkpoints" / "step_000003")
    (d / "stacks").mkdir()
    record(d / "stacks")
    return d


def test_overwrite_removes_an_earlier_run_and_says_so(tmp_path, capsys):
    d = _earlier_run(tmp_path)
    with pytest.raises(RunDirError, match=r"already holds a run: continue it \(--resume"):
        open_run_dir(_cfg(tmp_path, "r"), resume=False)
    assert open_run_dir(_cfg(tmp_path, "r"), resume=True) == d  # resume: kept as it is
    assert (d / "checkpoints").is_dir()
    open_run_dir(_cfg(tmp_path, "r", overwrite=True), resume=False)
    assert os.listdir(d) == [MARKER]
    assert f"--overwrite: removed the earlier run in {d}" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["thesis.tex", "checkpoints/notes.txt", "checkpoints/step_000003/model/mine.bin",
                                   "checkpoints/step_000003/extra/", "stacks/gdb.txt"])
def test_overwrite_refuses_what_the_project_did_not_write_at_any_depth_and_removes_nothing(tmp_path, where):
    d = _earlier_run(tmp_path)
    p = d / where
    p.parent.mkdir(parents=True, exist_ok=True)
    p.mkdir() if where.endswith("/") else p.write_text("years of work")
    before = sorted(x.relative_to(d).as_posix() for x in d.rglob("*"))
    with pytest.raises(RunDirError, match=rf"--overwrite: .* holds what the project did not write: {where}.*"
                                          r"nothing was removed"):
        open_run_dir(_cfg(tmp_path, "r", overwrite=True), resume=False)
    assert sorted(x.relative_to(d).as_posix() for x in d.rglob("*")) == before


def test_a_run_written_before_the_manifest_is_refused_with_why(tmp_path):
    d = open_run_dir(_cfg(tmp_path, "old"), resume=False)
    (d / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match=r"written before runs recorded their files.*remove it yourself.*"
                                          r"metrics\.jsonl"):
        open_run_dir(_cfg(tmp_path, "old", overwrite=True), resume=False)
    assert (d / "metrics.jsonl").exists()


def test_a_name_through_a_symlink_out_of_run_root_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "metrics.jsonl").write_text("{}")
    (tmp_path / "runs").mkdir()
    os.symlink(outside, tmp_path / "runs" / "link")
    with pytest.raises(RunDirError, match=r"resolves to .*elsewhere, outside run_root"):
        open_run_dir(_cfg(tmp_path / "runs", "link", overwrite=True), resume=False)
    assert (outside / "metrics.jsonl").exists()


def test_a_symlink_inside_a_run_folder_is_not_followed_by_overwrite(tmp_path):
    d = _earlier_run(tmp_path)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data.bin").write_text("x")
    os.symlink(keep, d / "checkpoints" / "step_000003" / "link")
    with pytest.raises(RunDirError, match=r"did not write: checkpoints/step_000003/link"):
        open_run_dir(_cfg(tmp_path, "r", overwrite=True), resume=False)
    assert (keep / "data.bin").exists()


def _checkpoint(d: Path, step: int) -> Path:
    c = d / "checkpoints" / f"step_{step:06d}"
    (c / "model").mkdir(parents=True)
    (c / "model" / "w.safetensors").write_text("w")
    (c / "trainer_state.pt").write_text("s")
    (c / "meta.json").write_text(json.dumps({"format_version": 2, "step": step, "files": {
        "model/w.safetensors": 1, "trainer_state.pt": 1}}))
    record_files(c)
    return c


def test_pruning_deletes_what_the_checkpoint_lists_and_leaves_the_rest_named(tmp_path, capsys):
    d = open_run_dir(_cfg(tmp_path, "r"), resume=False)
    c1, c2 = _checkpoint(d, 1), _checkpoint(d, 2)
    (c1 / "model" / "my_notes.txt").write_text("mine")
    prune(d, keep_last=1)
    assert [p.relative_to(d).as_posix() for p in sorted(c1.rglob("*"))] == ["checkpoints/step_000001/model",
                                                                            "checkpoints/step_000001/model/my_notes.txt"]
    assert "my_notes.txt" in capsys.readouterr().err and c2.is_dir()
    assert foreign(d) == [c1]  # what is left is not the project's: --overwrite would name it


def test_a_prune_or_a_write_cut_off_is_finished_at_the_next_start(tmp_path):
    d = open_run_dir(_cfg(tmp_path, "r"), resume=False)
    c1, c2, c3 = _checkpoint(d, 1), _checkpoint(d, 2), _checkpoint(d, 3)
    (c1 / "meta.json").unlink()  # a prune killed after it made the checkpoint invalid
    tmp = d / "checkpoints" / ".tmp_step_000004"
    tmp.mkdir()
    record(tmp, tree=True)
    (tmp / "half_written.bin").write_text("x")  # a write killed midway
    (d / "checkpoints" / "step_000009").mkdir()
    (d / "checkpoints" / "step_000009" / "user.txt").write_text("not ours")  # someone else's, step-like name
    clean_checkpoints(d, keep_last=1)
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000003", "step_000009"]
    assert (d / "checkpoints" / "step_000009" / "user.txt").exists()
    assert remove_checkpoint(c3) == [] and not c3.exists()


def test_every_file_a_real_run_writes_is_recorded_and_overwrite_replaces_it(tmp_path):
    """A tiny run with evaluation, checkpoints (one pruned), a recorded stream and reward workers:
    nothing in its folder is foreign, and --overwrite replaces it whole."""
    import run_gsm8k
    common = ["--model=tiny", f"--run_root={tmp_path}", "--name=r", "--train.steps=3", "--train.prompts_per_step=2",
              "--gen.n=2", "--train.min_buffer=4", "--gen.max_new_tokens=4", "--data.train_limit=8",
              "--data.eval_size=2", "--train.checkpoint_every=1", "--train.record=true", "--train.reward_workers=1"]
    run_gsm8k.main(common)
    d = tmp_path / "r"
    assert foreign(d) == [], (d / MANIFEST).read_text()
    assert {p.name for p in d.iterdir()} >= {"metrics.jsonl", "curves.png", "checkpoints", "stream", "stacks",
                                             "precision.json", "workers.json"}
    assert len(list((d / "checkpoints").iterdir())) == 1  # keep_checkpoints = 1: the others pruned
    run_gsm8k.main(common + ["--overwrite", "--train.steps=1", "--train.record=false"])
    assert foreign(d) == [] and not (d / "stream").exists()
