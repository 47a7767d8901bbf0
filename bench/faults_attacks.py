"""The faults table's attacks and mistakes on files and command lines (bench/faults.py runs them
after its faults; the store's: bench/faults_store.py; the shared parts: bench/_faults_util.py): a
pickle planted in a checkpoint or its replay buffer, a buffer of absurd size, a truncated weight
file, a hostile run name, `--overwrite` on a run folder holding a user's file, a really full disk,
a zero-size setting. Each runs as a user would meet it (a task script, or the faults job), as child
processes in sessions of their own, and reports what the user sees (the last line of output,
matched against the message the project promises), how long it took, what is left (processes,
/dev/shm entries of the run), and what the attack must not achieve (a payload that ran, a file
deleted that the project did not write).

    python bench/faults.py --only planted_checkpoint planted_buffer truncated_model hostile_run_name \
        foreign_overwrite disk_full zero_size_setting
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench._faults_util import ROOT, Payload, finish, job, spawn, steps
from bench.leaks import shm_entries, wait_until
from common.engine.checkpoints.hf_io import resolve_checkpoint

# name -> (the attack, regex the user's output must hold)
ATTACKS = {
    "planted_checkpoint": ("the latest checkpoint's DCP .metadata replaced by a pickle that runs code (meta.json's "
                           "size updated to match), then --resume", r"not a checkpoint this project wrote"),
    "planted_buffer": ("the latest checkpoint's buffer.pt replaced by a pickle that runs code (meta.json's size "
                       "updated to match), then run_gsm8k.py --resume", r"buffer\.pt: not a replay buffer this project wrote"),
    "absurd_buffer": ("the latest checkpoint's buffer.pt saying a capacity of 10^12 rows, then run_gsm8k.py --resume",
                      r"the saved replay buffer is 1,000,000,000,000 rows"),
    "truncated_model": ("run_gsm8k.py --model=<folder> whose model.safetensors was cut to half its size",
                        r"model\.safetensors: the weight file is truncated or damaged"),
    "hostile_run_name": ("--name=../../x, then --name=mine --overwrite on a folder holding a file the project "
                         "did not write", r"run name '\.\./\.\./x'.*one path component"),
    "foreign_overwrite": ("--overwrite of a finished run whose checkpoint folder holds a user's file "
                          "(checkpoints/step_N/model/notes.txt)", r"--overwrite: .* holds what the project did not write"),
    "disk_full": ("the run's file system (a tmpfs) filled to its last 8 KiB at step 3", r"No space left"),
    "zero_size_setting": ("--gen.max_batch=0", r"--gen\.max_batch=0: must be >= 1"),
}
_SCRIPT = [sys.executable, str(ROOT / "run_gsm8k.py"), "--model=tiny", "--data.eval_size=0"]


def planted_checkpoint(d: Path, model: str) -> dict:
    marker, run, shm = d / "payload_ran", d / "runs" / "job", shm_entries()
    p = job(d, model, d / "run.log")
    if not wait_until(lambda: steps(run) >= 3 or p.poll() is not None, 180) or p.poll() is not None:
        return {"error": f"the job ended or stalled before the attack (see {d / 'run.log'})"}
    os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: a checkpoint of the last step, then it exits
    p.wait(120)
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    md = next(ck.rglob(".metadata"))
    md.write_bytes(pickle.dumps(Payload(marker)))  # an attacker with write access to the run folder ...
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"][md.relative_to(ck).as_posix()] = md.stat().st_size  # ... fixes the recorded size too
    (ck / "meta.json").write_text(json.dumps(meta))
    t0 = time.monotonic()
    q = job(d, model, d / "resume.log", resume=True)
    res = finish({}, [q], [d / "resume.log"], ATTACKS["planted_checkpoint"][1], t0, shm, {q.pid})
    return {**res, "payload_ran": marker.exists(), "checkpoint_kept": md.exists()}


def _finished_run(d: Path, name: str) -> Path:
    """A one-step tiny GSM8K run in `d`/runs/`name` (its last checkpoint: step 1), run to its end."""
    r = subprocess.run(_SCRIPT + [f"--run_root={d / 'runs'}", f"--name={name}", "--train.steps=1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"the tiny run to attack failed: {r.stderr[-2000:]}")
    return d / "runs" / name


def _replace_buffer(run: Path, state) -> Path:
    """The last checkpoint's buffer.pt replaced by `state` (a dict, or a pickle), its size in meta.json
    fixed to match, as someone who edits a checkpoint would."""
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    if isinstance(state, dict):
        torch.save(state, ck / "buffer.pt")
    else:
        (ck / "buffer.pt").write_bytes(pickle.dumps(state))
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"]["buffer.pt"] = (ck / "buffer.pt").stat().st_size
    (ck / "meta.json").write_text(json.dumps(meta))
    return ck / "buffer.pt"


def _resume(d: Path, name: str, expect: str, shm: set) -> dict:
    t0 = time.monotonic()
    p = spawn(_SCRIPT + [f"--run_root={d / 'runs'}", f"--name={name}", "--train.steps=2", "--resume"], d / "resume.log")
    return finish({}, [p], [d / "resume.log"], expect, t0, shm, {p.pid})


def planted_buffer(d: Path, model: str) -> dict:
    shm, marker = shm_entries(), d / "payload_ran"
    f = _replace_buffer(_finished_run(d, "job"), Payload(marker))
    res = _resume(d, "job", ATTACKS["planted_buffer"][1], shm)
    return {**res, "payload_ran": marker.exists(), "checkpoint_kept": f.exists()}


def absurd_buffer(d: Path, model: str) -> dict:
    shm, run = shm_entries(), _finished_run(d, "job")
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    state = torch.load(ck / "buffer.pt", weights_only=True)
    _replace_buffer(run, {**state, "capacity": 10**12})
    return _resume(d, "job", ATTACKS["absurd_buffer"][1], shm)


def truncated_model(d: Path, model: str) -> dict:
    shm = shm_entries()
    m = d / "model"
    shutil.copytree(resolve_checkpoint("tiny"), m)  # a whole model folder (weights, config, tokenizer)
    w = m / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:len(data) // 2])  # a copy that stopped half-way
    t0 = time.monotonic()
    p = spawn([sys.executable, str(ROOT / "run_gsm8k.py"), f"--model={m}", f"--run_root={d / 'runs'}", "--name=t",
               "--data.eval_size=0"], d / "run.log")
    res = finish({}, [p], [d / "run.log"], ATTACKS["truncated_model"][1], t0, shm)
    return {**res, "checkpoints_made": (d / "runs" / "t" / "checkpoints").exists()}


def foreign_overwrite(d: Path, model: str) -> dict:
    shm, run = shm_entries(), _finished_run(d, "job")
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    (ck / "model" / "notes.txt").write_text("a user's notes on this checkpoint\n")
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    t0 = time.monotonic()
    p = spawn(_SCRIPT + [f"--run_root={d / 'runs'}", "--name=job", "--train.steps=1", "--overwrite"], d / "run.log")
    res = finish({}, [p], [d / "run.log"], ATTACKS["foreign_overwrite"][1], t0, shm)
    return {**res, "foreign_file_kept": (ck / "model" / "notes.txt").exists(),
            "nothing_removed": sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before}


def hostile_run_name(d: Path, model: str) -> dict:
    shm, runs = shm_entries(), d / "runs"
    (runs / "mine").mkdir(parents=True)
    (runs / "mine" / "notes.txt").write_text("a user's own file\n")
    (runs / "mine" / "metrics.jsonl").write_text("{}\n")  # looks like a run (the old rmtree's only test)
    t0 = time.monotonic()
    script = [sys.executable, str(ROOT / "run_gsm8k.py"), "--model=tiny", f"--run_root={runs}"]
    procs = [spawn(script + ["--name=../../x"], d / "name.log"),
             spawn(script + ["--name=mine", "--overwrite"], d / "overwrite.log")]
    res = finish({}, procs, [d / "name.log"], ATTACKS["hostile_run_name"][1], t0, shm)
    over = (d / "overwrite.log").read_text().strip().splitlines()
    return {**res, "foreign_file_kept": (runs / "mine" / "notes.txt").exists(), "outside_written": (d.parent / "x").exists(),
            "overwrite_message": over[-1][:300] if over else ""}


def disk_full(d: Path, model: str) -> dict:
    from common.runtime.files.checkpoint import latest_checkpoint  # noqa: E402 - the parent reads the run's files
    mnt, shm = d / "runs", shm_entries()
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": f"cannot mount a tmpfs here ({r.stderr.strip()[:120]}): the simulated disk_full_in_checkpoint row stands"}
    try:
        p = job(d, model, d / "run.log")
        if not wait_until(lambda: steps(mnt / "job") >= 3 or p.poll() is not None, 180) or p.poll() is not None:
            return {"error": f"the job ended or stalled before the disk filled (see {d / 'run.log'})"}
        st = os.statvfs(mnt)
        filler = st.f_bavail * st.f_frsize - 8192  # all but the last 8 KiB
        with open(mnt / "filler", "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, filler))
        t0 = time.monotonic()
        res = finish({}, [p], [d / "run.log"], ATTACKS["disk_full"][1], t0, shm, {p.pid})
        root = mnt / "job" / "checkpoints"
        latest = latest_checkpoint(mnt / "job")
        return {**res, "tmp_dirs_left": len(list(root.glob(".tmp_*"))) if root.is_dir() else 0,
                "latest_checkpoint": latest.name if latest else None}
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def zero_size_setting(d: Path, model: str) -> dict:
    shm, t0 = shm_entries(), time.monotonic()
    p = spawn([sys.executable, str(ROOT / "run_gsm8k.py"), "--model=tiny", f"--run_root={d / 'runs'}", "--name=zero",
                "--gen.max_batch=0"], d / "run.log")
    res = finish({}, [p], [d / "run.log"], ATTACKS["zero_size_setting"][1], t0, shm)
    return {**res, "run_dir_made": (d / "runs" / "zero").exists()}
