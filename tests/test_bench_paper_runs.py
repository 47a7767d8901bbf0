"""bench/paper_runs.py, the presets end to end on a lent GPU: its flags are valid for every preset it
names (a typo would cost a lease), a tiny run is stopped once it has logged the steps asked for, and
its figures are the metrics' arithmetic (rates after the first step, peaks against the plan, AReaL's
6.0k tokens/s bar)."""
import argparse
import importlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import _process_memory, paper_runs
from bench.leaks import group_alive, leaked, shm_entries, wait_until
from common.plan import memory_plan
from common.plan.memory_plan import GiB
from common.plan.preflight import plan_of
from common.contracts.log import read_metrics


@pytest.mark.parametrize("task, preset", sorted(paper_runs.LEASE))
def test_the_lease_flags_are_valid_for_every_preset(task, preset):
    a = argparse.Namespace(task=task, preset=preset, lease=True, random_weights=True, set=[], steps=3)
    argv = paper_runs.argv_of(a, "async", "/tmp/runs")
    cfg = importlib.import_module(f"run_{task}").make_config(argv)  # unknown keys and bad values raise
    assert cfg.train.steps == 4 and cfg.train.mode == "async" and cfg.random_weights
    if (task, preset) == ("gsm8k", "areal_long"):
        assert (cfg.algo, cfg.gen.max_new_tokens, cfg.train.prompts_per_step * cfg.gen.n) == ("areal", 8192, 64)


def test_the_plan_of_a_cuda_preset_is_read_per_process(tmp_path):
    """The plan's allocator bytes of each CUDA process, here without a GPU (its memory unknown: the
    lines are still planned; the KV pool, sized from free memory, is left out)."""
    a = argparse.Namespace(task="gsm8k", preset="areal_long", lease=True, random_weights=False, set=["model=tiny"], steps=3)
    cfg = importlib.import_module("run_gsm8k").make_config(paper_runs.argv_of(a, "async", tmp_path / "runs"))
    plan, totals, params = paper_runs.planned(a, cfg, None)
    assert set(plan) == set(totals) == {"trainer", "generator 0"} and plan["trainer"] > plan["generator 0"] > 0
    assert totals["trainer"] == plan["trainer"] + memory_plan.CONTEXT  # its total holds its CUDA context
    assert plan["trainer"] >= 16 * params > 0  # fp32 weights, grads and AdamW's moments at least
    assert not (tmp_path / "runs").exists()  # planning made no run folder


def test_each_process_peak_from_nvidia_smi_against_its_planned_total(tmp_path):
    """The nvidia-smi side (bench/_process_memory.py): peaks per workers.json name from a stand-in
    query, polled before the file exists (nothing counted) and after; a reward worker set against
    one worker's share of the reward workers' planned total (red-teaming's paper preset: 2 workers)."""
    polls = iter([{11: 3 * 2**30}, {11: 3 * 2**30, 12: 2**30, 13: 5 * 2**30, 99: 2**40}, {11: 4 * 2**30, 13: 2**30}])
    peaks = _process_memory.Peaks(tmp_path / "workers.json", query=lambda: next(polls))
    peaks.poll()  # no workers.json yet: no names
    (tmp_path / "workers.json").write_text(json.dumps({"trainer": 11, "generator0": 12, "reward0": 13}))
    peaks.poll(), peaks.poll()
    assert peaks.peak == {"trainer": 4 * 2**30, "generator0": 2**30, "reward0": 5 * 2**30}  # pid 99 is not the run's
    a = argparse.Namespace(task="redteam", preset="paper", lease=True, random_weights=False, set=[], steps=3)
    cfg = importlib.import_module("run_redteam").make_config(paper_runs.argv_of(a, "async", tmp_path / "runs"))
    plan, totals, _ = paper_runs.planned(a, cfg, [80e9])
    p = plan_of(cfg, [80e9])
    assert totals["reward workers"] == p.used("cuda:0", "reward workers") / 2 and "reward workers" in plan
    m = paper_runs.memory({"cuda_peak_gib": 1.0}, plan, totals, {"reward0": totals["reward workers"] / GiB * 1.1})
    assert m["reward0_smi"]["within"] and m["reward0_smi"]["measured_over_planned"] == pytest.approx(1.1)
    assert _process_memory.plan_process("generator3") == "generator 3" and _process_memory.plan_process("x") is None


def _row(step, t, **kw):
    return {"step": step, "time": t, "step_s": 1.0, "train_s": 0.5, "wait_s": 0.1, "trainer_tok_s": 100.0,
            "batch_tokens": 80, "batch_seq_tokens": 64, "gen_tok_s": 300.0, "staleness_mean": 1.0, "comp_len_mean": 20.0, "gen_interrupts": 2,
            "gen_preemptions": 0, "dropped_stale": 0, "version": step, **kw}


def test_summary_rates_are_over_the_steps_after_the_first():
    rows = [_row(1, 10.0, cuda_peak_gib=3.0, gen_cuda_peak_gib=1.0), _row(2, 12.0, cuda_peak_gib=4.0, gen_cuda_peak_gib=1.5),
            _row(3, 14.0, cuda_peak_gib=3.5, gen_cuda_peak_gib=1.2)]
    s = paper_runs.summarise(rows, params=1000, peak=6e6)
    # steps 2 and 3: 2 x (100 tok/s x 0.5 s) completion tokens and 2 x 80 batch tokens in the 4 s after step 1
    assert (s["tok_s"], s["batch_tok_s"], s["step_s"], s["wait_frac"]) == (25.0, 40.0, 2.0, 0.05)
    # 2 x 64 own tokens in 2 x 0.5 s of training, 50 of each 64 completions: MFU 6 x 1000 x 128 / 6e6
    assert (s["seq_tok_s_training"], s["prompt_share"], s["mfu"]) == (128.0, pytest.approx(14 / 64), pytest.approx(0.128))
    assert (s["cuda_peak_gib"], s["gen_cuda_peak_gib"], s["first_step_at_s"]) == (4.0, 1.5, 10.0)
    assert "error" in paper_runs.summarise(rows[:1])
    m = paper_runs.memory(s, {"trainer": 4.4 * GiB, "generator 0": 1.0 * GiB})
    assert m["trainer"]["within"] and not m["generator 0"]["within"]  # 4.0 / 4.4 = 0.91; 1.5 / 1.0 = 1.5
    assert paper_runs.memory(paper_runs.summarise([_row(1, 0.0), _row(2, 1.0)]), {})["measured"] is None


def test_areal_target_and_the_plan_entries():
    a = argparse.Namespace(task="gsm8k", preset="areal_long", modes=["async"])
    res = {"config": {"max_new_tokens": 8192, "device": "cuda"},
           "async": {"tok_s": 6500.0, "memory": {"trainer": {"measured_over_planned": 1.1, "within": True}}}}
    t = paper_runs.targets(a, res)
    assert t["areal_tok_s_one_gpu"]["met"] and t["plan_async_trainer"] == {"value": 1.1, "need": "within 15%", "met": True}
    res["async"]["tok_s"] = 5900.0
    assert paper_runs.targets(a, res)["areal_tok_s_one_gpu"]["met"] is False
    res["config"]["device"] = "cpu"  # not AReaL's setting: reported, not judged
    assert paper_runs.targets(a, res)["areal_tok_s_one_gpu"]["met"] is None


def test_a_tiny_run_is_stopped_after_the_steps_and_measured(tmp_path):
    before = shm_entries()
    res = paper_runs.main(["--task", "gsm8k", "--preset", "cpu", "--no-random-weights", "--steps", "1",
                           "--set", "model=tiny", "--set", "gen.max_new_tokens=16", "--set", "data.eval_size=0",
                           "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    x = res["async"]
    assert res["complete"] and json.loads((tmp_path / "r.json").read_text())["async"]["steps"] == 2
    # stopped once 2 steps are logged, or (a tiny run's checkpoint is quick) ended on its own just before
    assert x["end"].startswith(("stopped after the steps measured", "exited 0")) and x["memory"]["measured"] is None
    rows = [r for r in read_metrics(tmp_path / "runs" / "cpu_async" / "metrics.jsonl") if "step_s" in r]
    assert len(rows) == 2 and x["tok_s"] == pytest.approx(
        rows[1]["trainer_tok_s"] * rows[1]["train_s"] / (rows[1]["time"] - rows[0]["time"]))
    assert wait_until(lambda: not leaked(before), 10)  # the run's semaphores unlinked by its resource tracker


def _cmdline(d: Path) -> bytes:
    try:
        return (d / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_a_sigterm_to_the_bench_stops_the_run_and_its_workers(tmp_path):
    """An outer time limit (bench/gpu_check.sh's `timeout`) stops the bench with SIGTERM; the run it
    started in its own process group must not outlive it on a lent GPU the next phase needs."""
    before = shm_entries()
    p = subprocess.Popen([sys.executable, "bench/paper_runs.py", "--task", "gsm8k", "--preset", "cpu", "--no-random-weights",
                          "--steps", "500", "--set", "model=tiny", "--set", "data.eval_size=0", "--workdir", str(tmp_path)],
                         cwd=Path(paper_runs.ROOT), stdout=subprocess.DEVNULL)
    metrics, t = tmp_path / "runs" / "cpu_async" / "metrics.jsonl", time.time()
    while not metrics.exists() and time.time() - t < 300 and p.poll() is None:
        time.sleep(0.5)
    run = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
           and f"--run_root={tmp_path}".encode() in _cmdline(d)]
    assert metrics.exists() and len(run) == 1 and len(group_alive(run[0])) >= 2  # the trainer and its generator
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143
    t = time.time()
    while group_alive(run[0]) and time.time() - t < 10:
        time.sleep(0.2)
    assert group_alive(run[0]) == [] and wait_until(lambda: not leaked(before), 10)  # nothing left in /dev/shm either
