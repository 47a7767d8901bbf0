"""A user's mistake ends a task script with one line on stderr, `error: <what, where, the fix>`,
exit status 2 and no traceback (the traceback too only with ASYNCRL_DEBUG=1); Ctrl-C ends with
the runtime's own line, exit status 130 (common/task.py: `script`). The scripts run as the user
runs them, in subprocesses started together (each imports torch: a few seconds)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run_redteam
from common.engine.checkpoints.hf_io import ModelFileError, load_model, resolve_checkpoint
from common.contracts.errors import UserError
from common.plan.preflight import check_devices
from common.task import script
from tests.test_checkpoint_trust import _Plant
from tests.tiny import save_hf

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: (exit status, stderr)} of run_gsm8k.py on each mistake, all started at once."""
    tmp = tmp_path_factory.mktemp("user_errors")
    (tmp / "no_config").mkdir()
    (tmp / "no_config" / "tokenizer.json").write_text("{}")
    (tmp / "empty_data").mkdir()
    for split in ("train", "test"):
        (tmp / "empty_data" / f"{split}.jsonl").write_text("")
    truncated = tmp / "truncated"  # the tiny model, its weights cut short (a copy that stopped half-way)
    shutil.copytree(resolve_checkpoint("tiny"), truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    foreign = tmp / "runs" / "foreign"
    foreign.mkdir(parents=True)
    (foreign / "metrics.jsonl").write_text("{}\n")
    (foreign / "notes.txt").write_text("mine")
    root = f"--run_root={tmp / 'runs'}"
    ON_CPU = ["--train.device=cpu", "--memory_check=false"]
    cases = {
        "missing_model": (["--model=/nonexistent/model", "--name=x", root], {}),
        "missing_model_debug": (["--model=/nonexistent/model", "--name=x", root], {"ASYNCRL_DEBUG": "1"}),
        "name_outside": (["--name=../../x", root], {}),
        "model_without_config": ([f"--model={tmp / 'no_config'}", "--name=x", root], {}),
        "empty_data": ([f"--data.source={tmp / 'empty_data'}", "--name=x", root], {}),
        "foreign_overwrite": (["--model=tiny", "--name=foreign", "--overwrite", root], {}),
        # a preset's hub model, offline and not cached (an empty cache of our own: never a download)
        # (on the CPU, where the devices and the memory plan are checked first: these test the model)
        "hub_model_offline": (["--algo=areal", "--preset=areal_long", *ON_CPU, "--name=x", root], {
            "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"), "HF_HUB_CACHE": str(tmp / "hf" / "hub")}),
        "paper_offline": (["--preset=paper", *ON_CPU, "--name=x", root], {
            "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"), "HF_HUB_CACHE": str(tmp / "hf" / "hub")}),
        # a GPU preset where no GPU is visible: refused before its 1.1B random model is built
        "gpu_preset_no_gpu": (["--preset=paper", "--random_weights", "--name=x", root], {
            "CUDA_VISIBLE_DEVICES": "", "ASYNCRL_CACHE": str(tmp / "cache")}),
        "not_a_device": (["--model=tiny", "--train.device=gpu", "--name=x", root], {}),
        "truncated_model": ([f"--model={truncated}", "--name=truncated", "--data.eval_size=0", root], {}),
    }
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_DEBUG"}
    procs = {name: subprocess.Popen([sys.executable, "run_gsm8k.py", *argv], cwd=ROOT, env={**env, **extra},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, extra) in cases.items()}
    out = {}
    for name, p in procs.items():
        _, err = p.communicate(timeout=300)
        out[name] = (p.returncode, err)
    out["foreign_left"] = (foreign / "notes.txt").read_text()
    out["truncated"] = str(weights)
    out["cache_left"] = sorted(p.name for p in (tmp / "cache").rglob("*")) if (tmp / "cache").exists() else []
    return out


def _one_line(result) -> str:
    code, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err
    return lines[0]


def test_a_missing_model_path_is_one_line(runs):
    line = _one_line(runs["missing_model"])
    assert "--model=/nonexistent/model" in line and "does not exist" in line and "hub id" in line


def test_debug_shows_the_traceback(runs):
    code, err = runs["missing_model_debug"]
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_a_presets_hub_model_offline_is_one_line(runs):
    line = _one_line(runs["hub_model_offline"])
    assert "cannot resolve model 'deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B'" in line and "Hugging Face" in line
    assert "local checkpoint" in line  # the fix: --model=<a folder with it>
    line = _one_line(runs["paper_offline"])  # TBA's GSM8K preset: its RhoMath-1B SFT policy
    assert "cannot resolve model 'realtreetune/rho-1b-sft-GSM8K'" in line and "local checkpoint" in line


def test_a_gpu_preset_without_a_gpu_is_one_line_before_anything_is_built(runs):
    line = _one_line(runs["gpu_preset_no_gpu"])
    assert "this machine has no CUDA GPU" in line and "on the CPU instead: --train.device=cpu" in line
    assert runs["cache_left"] == []  # no random model was built first
    assert "--train.device=gpu: not a device; use cpu, cuda or cuda:N" in _one_line(runs["not_a_device"])


def test_every_device_setting_is_checked_against_the_machine(monkeypatch):
    """Each section's `device` (the trainer's, the victim's), whatever this machine has: GPUs counted 0 and 2."""
    cfg = run_redteam.make_config(["--train.device=cuda:1", "--victim.device=cuda"])
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(UserError, match=r"no CUDA GPU .*--train.device, --victim.device ask for one.*"
                                        r"--train.device=cpu --victim.device=cpu$"):
        check_devices(cfg)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    check_devices(cfg)  # cuda:1 of two
    cfg.victim.device = "cuda:2"
    with pytest.raises(UserError, match=r"^--victim.device=cuda:2: this machine has 2 GPU\(s\), cuda:0 to cuda:1$"):
        check_devices(cfg)
    cfg.victim.device = "mps"
    with pytest.raises(UserError, match=r"^--victim.device=mps: runs take cpu or cuda devices only$"):
        check_devices(cfg)


def test_a_run_name_outside_run_root_is_one_line(runs):
    assert "run name '../../x' holds a path separator" in _one_line(runs["name_outside"])


def test_a_model_folder_without_config_names_the_missing_file(runs):
    line = _one_line(runs["model_without_config"])
    assert "lacks config.json" in line and "sentencepiece" not in line


def test_an_empty_data_file_is_named(runs):
    line = _one_line(runs["empty_data"])
    assert "empty_data/train.jsonl holds no rows" in line


def test_overwrite_on_a_folder_not_ours_is_refused_and_the_file_kept(runs):
    line = _one_line(runs["foreign_overwrite"])
    assert "was not made by this project (it holds metrics.jsonl, notes.txt)" in line  # no name makes an entry ours
    assert runs["foreign_left"] == "mine"


def test_a_truncated_model_file_is_named(runs):
    line = _one_line(runs["truncated_model"])
    assert f"{runs['truncated']}: the weight file is truncated or damaged (SafetensorError: " in line
    assert "copy it again" in line


def test_a_damaged_or_planted_weight_file_is_a_user_error(tmp_path):
    save_hf("llama_tied", tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    for cut in (len(data) - 100, 20, 0):  # the data, the header, nothing
        f.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match=rf"^{f}: the weight file is truncated or damaged \(SafetensorError: "):
            load_model(str(tmp_path / "m"), tokenizer=False)
    f.unlink()
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": _Plant(marker)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelFileError, match=r"pytorch_model\.bin: not plain weights: it references the disallowed "
                                             r"global (posix|os|nt)\.system, so it was not read"):
        load_model(str(tmp_path / "m"), tokenizer=False)
    assert not marker.exists()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "lla')
    with pytest.raises(ModelFileError, match=r"config\.json: truncated or damaged, not JSON"):
        load_model(str(tmp_path / "m"), tokenizer=False)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{case: (exit status, stderr)} of `--resume` on a one-step tiny run whose buffer.pt was replaced
    (its size in meta.json fixed to match, as someone who edits a checkpoint would)."""
    tmp = tmp_path_factory.mktemp("resume")
    root = tmp / "runs"
    argv = ["--model=tiny", "--train.steps=1", "--data.eval_size=0", f"--run_root={root}"]
    r = subprocess.run([sys.executable, "run_gsm8k.py", *argv, "--name=planted"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(root / "planted", root / "absurd")
    cases = {}
    for name in ("planted", "absurd"):
        ck = root / name / "checkpoints" / "step_000001"
        state = torch.load(ck / "buffer.pt", weights_only=True)
        if name == "planted":
            state = {"format": state["format"], "capacity": _Plant(tmp / "pwned")}
        else:
            state["capacity"] = 10**12
        torch.save(state, ck / "buffer.pt")
        meta = json.loads((ck / "meta.json").read_text())
        meta["files"]["buffer.pt"] = (ck / "buffer.pt").stat().st_size
        (ck / "meta.json").write_text(json.dumps(meta))
        cases[name] = subprocess.Popen([sys.executable, "run_gsm8k.py", *argv, f"--name={name}", "--resume"], cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {name: (p.communicate(timeout=300)[1], p.returncode)[::-1] for name, p in cases.items()}
    out["ran"] = (tmp / "pwned").exists()
    out["root"] = root
    return out


def test_a_planted_buffer_is_one_line_and_never_runs(resumed):
    line = _one_line(resumed["planted"])
    where = resumed["root"] / "planted" / "checkpoints" / "step_000001" / "buffer.pt"
    assert line.startswith(f"error: {where}: not a replay buffer this project wrote: it references the disallowed global ")
    assert not resumed["ran"]


def test_a_buffer_of_absurd_capacity_is_refused_with_the_numbers(resumed):
    line = _one_line(resumed["absurd"])
    assert "buffer.pt: the saved replay buffer is 1,000,000,000,000 rows x " in line
    assert "this run's is 2,048 rows (--train.buffer_capacity)" in line


# ---- script() itself, in this process ----------------------------------------------------------
def test_ctrl_c_after_the_trainers_line_exits_130_without_a_traceback(capsys, monkeypatch):
    monkeypatch.delenv("ASYNCRL_DEBUG", raising=False)

    def interrupted(reported):
        e = KeyboardInterrupt()
        if reported:
            e.reported = True  # the trainer printed "interrupted ... at step N: checkpoint ..."
        raise e

    with pytest.raises(SystemExit) as e:
        script(lambda: interrupted(True))
    assert e.value.code == 130 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:  # e.g. inside a checkpoint, or before training began
        script(lambda: interrupted(False))
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.strip().startswith("interrupted (Ctrl-C)") and "Traceback" not in err


def test_a_user_error_is_one_line_even_when_its_message_is_not(capsys, monkeypatch):
    monkeypatch.delenv("ASYNCRL_DEBUG", raising=False)

    def fails():
        raise UserError("a bad thing\nover two lines")

    with pytest.raises(SystemExit) as e:
        script(fails)
    assert e.value.code == 2 and capsys.readouterr().err == "error: a bad thing over two lines\n"
    monkeypatch.setenv("ASYNCRL_DEBUG", "1")
    with pytest.raises(SystemExit):
        script(fails)
    assert "Traceback" in capsys.readouterr().err
