"""Run names and run folders (common/runtime/run_dir.py): a name is one path component, the
folder stays inside run_root, and `--overwrite` deletes only a run folder this project wrote,
only the entries a run writes, and says what it removed."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from common.errors import UserError
from common.runtime.run_dir import MARKER, RunDirError, RunNameError, check_name, open_run_dir
from common.runtime.run_log import prepare_run_dir
from common.task import RunConfig


def _cfg(root, name, overwrite=False):
    return SimpleNamespace(run_root=str(root), name=name, overwrite=overwrite)


@pytest.mark.parametrize("name, rule", [("/abs", "absolute path"), ("../x", "path separator"),
                                        ("../../x", "path separator"), ("a/b", "path separator"),
                                        ("a\\b", "path separator"), ("..", "not a folder name"),
                                        (".", "not a folder name"), ("", "empty"), ("  ", "empty")])
def test_a_name_is_one_path_component(name, rule):
    with pytest.raises(RunNameError, match=rule) as e:
        check_name(name)
    msg = str(e.value)
    assert "\n" not in msg and "--name=my_run" in msg  # one line: the rule broken and the fix
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


def test_a_bad_name_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(RunNameError):
        open_run_dir(_cfg(tmp_path / "runs", "../escaped", overwrite=True), resume=False)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


def test_a_new_run_folder_is_marked_as_ours(tmp_path):
    d = prepare_run_dir(RunConfig(name="r", run_root=str(tmp_path)), resume=False)
    marker = json.loads((d / MARKER).read_text())
    assert marker["project"] == "asyncrl" and marker["name"] == "r" and marker["created"]
    assert (d / "config.json").is_file()


def test_overwrite_refuses_a_folder_holding_a_foreign_file_and_leaves_it(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "metrics.jsonl").write_text("{}\n")
    (d / "thesis.tex").write_text("years of work")
    with pytest.raises(RunDirError, match=r"not made by this project \(it holds thesis\.tex\).*nothing was changed"):
        open_run_dir(_cfg(tmp_path, "mine", overwrite=True), resume=False)
    (d / MARKER).write_text("{}")  # even in a folder we made: a file we did not write stops --overwrite
    with pytest.raises(RunDirError, match=r"--overwrite: .* holds files a run does not write \(thesis\.tex\)"):
        open_run_dir(_cfg(tmp_path, "mine", overwrite=True), resume=False)
    assert (d / "thesis.tex").read_text() == "years of work" and (d / "metrics.jsonl").exists()


def test_a_model_folder_is_never_taken_for_a_run(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(RunDirError, match="not made by this project"):
        open_run_dir(_cfg(tmp_path, "model"), resume=False)
    assert json.loads((d / "config.json").read_text()) == {"model_type": "llama"}


def test_overwrite_removes_an_earlier_run_and_says_so(tmp_path, capsys):
    d = open_run_dir(_cfg(tmp_path, "r"), resume=False)
    for f in ("metrics.jsonl", "config.json", "precision.json", "curves.png", "workers.json"):
        (d / f).write_text("x")
    for sub in ("checkpoints/step_000003/model", "stacks", "stream"):
        (d / sub).mkdir(parents=True)
    with pytest.raises(RunDirError, match=r"already holds a run: continue it \(--resume"):
        open_run_dir(_cfg(tmp_path, "r"), resume=False)
    assert open_run_dir(_cfg(tmp_path, "r"), resume=True) == d  # resume: kept as it is
    assert (d / "checkpoints").is_dir()
    open_run_dir(_cfg(tmp_path, "r", overwrite=True), resume=False)
    assert os.listdir(d) == [MARKER]
    out = capsys.readouterr().out
    assert f"--overwrite: removed the earlier run in {d} (checkpoints/, config.json, curves.png, metrics.jsonl" in out


def test_a_run_from_before_the_marker_counts_as_ours(tmp_path, capsys):
    d = tmp_path / "old"
    (d / "checkpoints" / "step_000001").mkdir(parents=True)
    (d / "node1").mkdir()
    for f in ("metrics.jsonl", "config.json", "precision.json"):
        (d / f).write_text("x")
    open_run_dir(_cfg(tmp_path, "old", overwrite=True), resume=False)
    assert os.listdir(d) == [MARKER] and "removed the earlier run" in capsys.readouterr().out


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
    d = open_run_dir(_cfg(tmp_path, "r"), resume=False)
    (d / "metrics.jsonl").write_text("{}")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data.bin").write_text("x")
    os.symlink(keep, d / "checkpoints")
    with pytest.raises(RunDirError, match=r"does not write \(checkpoints\)"):
        open_run_dir(_cfg(tmp_path, "r", overwrite=True), resume=False)
    assert (keep / "data.bin").exists()
