"""Fault paths of a training run (bench/faults.py measures them all; these pin the behaviour):
a generator that dies mid-run, a NaN reward, a disk that fills while checkpointing, a hung
worker that must not hold up shutdown, and the fault bench itself on its quickest scenario."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.contracts.log import read_metrics
import common.runtime.files.checkpoint as ck
from common.runtime.files.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from common.runtime.launch import WorkerError
from common.train import train
from tests.test_e2e import _cfg, _prompts, _tba, toy_reward

_calls = 0


def dies_on_call_40(tokens, meta) -> float:
    """Runs in the generator: the 40th reward call kills its own process (an OOM kill, a segfault)."""
    global _calls
    _calls += 1
    if _calls == 40:
        os.kill(os.getpid(), signal.SIGKILL)
    return toy_reward(tokens, meta)


def nan_sometimes(tokens, meta) -> float:
    return float("nan") if tokens and tokens[0] % 3 == 0 else toy_reward(tokens, meta)


def test_dead_generator_stops_the_run_with_a_checkpoint_and_resume_continues(tmp_path, capsys):
    cfg = _cfg(tmp_path, mode="sync", steps=6)  # 16 rewards per step: call 40 is in step 3's batch
    with pytest.raises(WorkerError, match=r"'generator0' died .*SIGKILL"):
        train(cfg, _tba(cfg), _prompts(), dies_on_call_40, stop_token_ids=())
    assert "a worker failed; checkpoint" in capsys.readouterr().err
    run = tmp_path / "runs" / "toy"
    ck_dir = latest_checkpoint(run)
    assert ck_dir is not None and ck_dir.name == "step_000002"  # the steps trained so far are kept
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)
    assert last["version"] == 6
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # nothing trained twice, nothing skipped


def test_nan_reward_is_counted_and_never_trained_on(tmp_path):
    cfg = _cfg(tmp_path, mode="sync", steps=3)
    last = train(cfg, _tba(cfg), _prompts(), nan_sometimes, stop_token_ids=())
    assert last["reward_errors"] > 0 and torch.isfinite(torch.tensor(last["loss"]))
    buf = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "toy"), *_model_opt(cfg)).buffer
    assert torch.isfinite(buf.cols["reward"]).all()  # the NaN samples were scored 0


def _model_opt(cfg):
    from common.engine.checkpoints.hf_io import load_model
    m = load_model(cfg.model, tokenizer=False)[0]
    return m, torch.optim.AdamW(m.parameters())


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, mode="sync", steps=6, checkpoint_every=2)
    orig, n = ck._write_meta, [0]

    def write_meta(d, meta):
        n[0] += 1
        if n[0] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(d / "meta.json"))
        orig(d, meta)
    monkeypatch.setattr(ck, "_write_meta", write_meta)
    with pytest.raises(CheckpointError, match=r"step 4 .*No space left on device.*step_000002 is intact"):
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    root = tmp_path / "runs" / "toy" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no partial copy left taking space
    assert load_checkpoint(root / "step_000002", *_model_opt(cfg)).step == 2


def _sleep_forever(beat, *, stop_event):
    beat.start()
    beat("scoring", 1)
    time.sleep(3600)


def test_hung_worker_does_not_hold_up_shutdown(tmp_path):
    from common.runtime.watchdog import WorkerStalled
    from tests.test_watchdog import _watched
    with _watched(tmp_path, "reward0", _sleep_forever, timeout=1.0, join_timeout=60) as (w, _):
        with pytest.raises(WorkerStalled):
            w.wait_event(lambda: False, timeout=30)
        t = time.monotonic()  # leaving the block shuts the workers down
    assert time.monotonic() - t < 10  # killed at once, not after the 60 s polite join
    assert not w.alive()


def test_fault_bench_malformed_data_scenario(tmp_path):
    bench = Path(__file__).resolve().parent.parent / "bench" / "faults.py"
    out = subprocess.run([sys.executable, str(bench), "--only", "malformed_data_line", "--root", str(tmp_path / "f")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.splitlines()[0])
    assert row["detected"] and row["exit_code"] == 1 and row["processes_left"] == 0
    assert "train.jsonl:3: malformed JSON" in row["message"]
    assert json.loads(out.stdout.splitlines()[-1])["bench"] == "faults"
