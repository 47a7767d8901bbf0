"""Whole runs with the trainer as 2 FSDP2 ranks on CPU (gloo) and one generator: the async toy
task learns; a killed rank stops the run at once, naming it, with nothing left behind, and the
run resumes on one rank from the last checkpoint. (bench/faults.py also measures a rank that
raises or hangs; tests/test_ranks.py pins the step's numbers.)"""
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from common.contracts.log import read_metrics
from common.runtime.step import RankFailed
from common.train import train
from tests.test_e2e import _cfg, _policy_reward, _prompts, _reward_curve, _tba, toy_reward


def test_async_two_trainer_ranks_raise_reward(tmp_path):
    cfg = _cfg(tmp_path, trainer_devices=2)
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert len(_reward_curve(cfg)) == 100 and last["version"] == 50
    final_dir = sorted((tmp_path / "runs" / "toy" / "checkpoints").glob("step_*"))[-1]
    assert len(list((final_dir / "state").glob("*.distcp"))) == 2  # each rank wrote its shards
    r0, r1 = _policy_reward(cfg.model, _prompts(), cfg), _policy_reward(final_dir / "model", _prompts(), cfg)
    print(f"policy reward before {r0:.3f} after {r1:.3f}")
    assert r0 < 0.35 and r1 > r0 + 0.3, (r0, r1)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_rank_stops_cleanly_and_the_run_resumes_on_one_rank(tmp_path):
    cfg = _cfg(tmp_path, mode="sync", steps=40, checkpoint_every=2, trainer_devices=2)
    run = tmp_path / "runs" / "toy"
    killed = {}

    def kill_rank_1_after_step_3():
        while not (run / "metrics.jsonl").exists() or len([r for r in read_metrics(run / "metrics.jsonl")
                                                            if "step_s" in r]) < 3:
            time.sleep(0.05)
        killed["pids"] = json.loads((run / "workers.json").read_text())
        os.kill(killed["pids"]["trainer1"], signal.SIGKILL)
        killed["t"] = time.monotonic()
    threading.Thread(target=kill_rank_1_after_step_3, daemon=True).start()
    with pytest.raises(RankFailed, match=r"worker 'trainer1' died .*SIGKILL"):
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert time.monotonic() - killed["t"] < 15  # detected and everything stopped in seconds (mostly joins)
    assert not [n for n, pid in killed["pids"].items() if n != "trainer" and _alive(pid)]  # no worker left
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts and all(c.startswith("step_") for c in ckpts)  # no half-written .tmp_ directory
    done = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "step_s" in r]

    cfg.train.trainer_devices, cfg.train.steps = 1, max(done) + 2  # 2 -> 1: the same run on one rank
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)
    assert last["version"] == cfg.train.steps
    resumed_at = int(ckpts[-1][len("step_"):])
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "step_s" in r]
    # the steps after the last checkpoint are trained again (the dead rank took its shards); the
    # dead run's rows of those steps are moved aside, so each step has one row
    assert steps == [s for s in done if s <= resumed_at] + list(range(resumed_at + 1, cfg.train.steps + 1))
    late = [s for s in done if s > resumed_at]
    if late:
        assert [r["step"] for r in read_metrics(run / "metrics_discarded.jsonl") if "step_s" in r] == late
    assert torch.isfinite(torch.tensor(last["loss"]))
