"""The faults table's attacks and mistakes (bench/faults.py runs them after its faults): a value
forged into a live two-node run's store, a pickle planted in a checkpoint, a hostile run name, a
really full disk, a zero-size setting. Each runs as a user would meet it (a task script, the
faults job, or two torchrun agents on 127.0.0.1), as child processes in sessions of their own, and
reports what the user sees (the last line of output, matched against the message the project
promises), how long it took, what is left (processes, /dev/shm entries of the run), and what the
attack must not achieve (a payload that ran, a file deleted that the project did not write).

    python bench/faults.py --only forged_store_value planted_checkpoint hostile_run_name disk_full zero_size_setting
"""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from bench.leaks import group_alive, leaked, shm_entries, wait_until  # noqa: E402 - the run's own /dev/shm entries only

FAULTS = ROOT / "bench" / "faults.py"
SECRET = "faults-bench-" + "5a" * 16
# name -> (the attack, regex the user's output must hold)
ATTACKS = {
    "forged_store_value": ("a pickle written under failed/1 of a live two-node run's store (its port read from "
                           "torchrun's store), over 127.0.0.1", r"refused the value under key 'failed/1'"),
    "planted_checkpoint": ("the latest checkpoint's DCP .metadata replaced by a pickle that runs code (meta.json's "
                           "size updated to match), then --resume", r"not a checkpoint this project wrote"),
    "hostile_run_name": ("--name=../../x, then --name=mine --overwrite on a folder holding a file the project "
                         "did not write", r"run name '\.\./\.\./x'.*one path component"),
    "disk_full": ("the run's file system (a tmpfs) filled to its last 8 KiB at step 3", r"No space left"),
    "zero_size_setting": ("--gen.max_batch=0", r"--gen\.max_batch=0: must be >= 1"),
}


class Payload:
    """What an intruder plants: loading it creates a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _spawn(cmd: list[str], log: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **env})


def _steps(run: Path) -> int:
    f = run / "metrics.jsonl"
    return sum('"step_s"' in x for x in f.read_text().splitlines()) if f.exists() else 0


def _finish(res: dict, procs: list, logs: list[Path], expect: str, t0: float, shm_before: set, pids=None) -> dict:
    """Wait for the processes (at most 120 s), then what the user saw and what is left."""
    said = wait_until(lambda: all(p.poll() is not None for p in procs) or
                 any(re.search(expect, lg.read_text(), re.S) for lg in logs), 120)
    t_said = time.monotonic()
    wait_until(lambda: all(p.poll() is not None for p in procs), 120)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = "\n".join(lg.read_text() for lg in logs)
    detected = bool(said) and re.search(expect, out, re.S) is not None
    time.sleep(1.0)  # let shutting-down workers go before counting
    lines = [x for x in out.splitlines() if re.search(expect, x)] or out.strip().splitlines()[-1:]
    return {**res, "detected": detected, "detect_s": round(t_said - t0, 2) if detected else None,
            "exit_s": round(time.monotonic() - 1.0 - t0, 2), "exit_code": [p.returncode for p in procs],
            "processes_left": sum(len(group_alive(p.pid)) for p in procs), "shm_left": sorted(leaked(shm_before, pids)),
            "message": lines[-1][:300] if lines else ""}


def _agent(port: int, node_rank: int, *args) -> list[str]:
    """One of two torchrun agents on 127.0.0.1 (static rendezvous: node 0, the trainer, hosts torchrun's
    store) running the node tests' toy run."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=static",
            "--master-addr=127.0.0.1", f"--master-port={port}", f"--node-rank={node_rank}",
            str(ROOT / "tests" / "nodes_toy.py"), "--dist.trainer_nodes=1", *args]


def forged_store_value(d: Path, model: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker, shm = d / "payload_ran", shm_entries()
    args = [f"--run_root={d}", f"--model={model}", "--train.steps=40", "--train.checkpoint_every=2"]
    logs = [d / "node0.log", d / "node1.log"]
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "ASYNCRL_RUN_SECRET": SECRET, "NODES_TOY_STEP_S": "0.5"}
    procs = [_spawn(_agent(port, k, *args), logs[k], **env) for k in range(2)]
    if not wait_until(lambda: _steps(d / "toy") >= 2 or any(p.poll() is not None for p in procs), 300) \
            or any(p.poll() is not None for p in procs):
        return {"error": f"the two-node run ended or stalled before the attack (see {logs})"}
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    run_port = int(agent_store.get("asyncrl/world0/run_store_port"))  # what any peer on the network can read
    intruder = dist.TCPStore("127.0.0.1", run_port, is_master=False, timeout=timedelta(seconds=10))
    t0 = time.monotonic()
    intruder.set("failed/1", pickle.dumps(Payload(marker)))
    del intruder, agent_store
    res = _finish({}, procs, logs, ATTACKS["forged_store_value"][1], t0, shm)
    return {**res, "payload_ran": marker.exists(), "checkpoint_after": "a worker failed; checkpoint" in logs[0].read_text()}


def _job(d: Path, model: str, log: Path, resume: bool = False) -> subprocess.Popen:
    """bench/faults.py's own job (a tiny TBA run, checkpoints every 2 steps) in `d`/runs/job."""
    return _spawn([sys.executable, str(FAULTS), "--child", "attack", "--dir", str(d), "--model", model]
                  + ["--resume"] * resume, log)


def planted_checkpoint(d: Path, model: str) -> dict:
    marker, run, shm = d / "payload_ran", d / "runs" / "job", shm_entries()
    p = _job(d, model, d / "run.log")
    if not wait_until(lambda: _steps(run) >= 3 or p.poll() is not None, 180) or p.poll() is not None:
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
    q = _job(d, model, d / "resume.log", resume=True)
    res = _finish({}, [q], [d / "resume.log"], ATTACKS["planted_checkpoint"][1], t0, shm, {q.pid})
    return {**res, "payload_ran": marker.exists(), "checkpoint_kept": md.exists()}


def hostile_run_name(d: Path, model: str) -> dict:
    shm, runs = shm_entries(), d / "runs"
    (runs / "mine").mkdir(parents=True)
    (runs / "mine" / "notes.txt").write_text("a user's own file\n")
    (runs / "mine" / "metrics.jsonl").write_text("{}\n")  # looks like a run (the old rmtree's only test)
    t0 = time.monotonic()
    script = [sys.executable, str(ROOT / "run_gsm8k.py"), "--model=tiny", f"--run_root={runs}"]
    procs = [_spawn(script + ["--name=../../x"], d / "name.log"),
             _spawn(script + ["--name=mine", "--overwrite"], d / "overwrite.log")]
    res = _finish({}, procs, [d / "name.log"], ATTACKS["hostile_run_name"][1], t0, shm)
    over = (d / "overwrite.log").read_text().strip().splitlines()
    return {**res, "foreign_file_kept": (runs / "mine" / "notes.txt").exists(), "outside_written": (d.parent / "x").exists(),
            "overwrite_message": over[-1][:300] if over else ""}


def disk_full(d: Path, model: str) -> dict:
    from common.runtime.checkpoint import latest_checkpoint  # noqa: E402 - the parent reads the run's files
    mnt, shm = d / "runs", shm_entries()
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": f"cannot mount a tmpfs here ({r.stderr.strip()[:120]}): the simulated disk_full_in_checkpoint row stands"}
    try:
        p = _job(d, model, d / "run.log")
        if not wait_until(lambda: _steps(mnt / "job") >= 3 or p.poll() is not None, 180) or p.poll() is not None:
            return {"error": f"the job ended or stalled before the disk filled (see {d / 'run.log'})"}
        st = os.statvfs(mnt)
        filler = st.f_bavail * st.f_frsize - 8192  # all but the last 8 KiB
        with open(mnt / "filler", "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, filler))
        t0 = time.monotonic()
        res = _finish({}, [p], [d / "run.log"], ATTACKS["disk_full"][1], t0, shm, {p.pid})
        root = mnt / "job" / "checkpoints"
        latest = latest_checkpoint(mnt / "job")
        return {**res, "tmp_dirs_left": len(list(root.glob(".tmp_*"))) if root.is_dir() else 0,
                "latest_checkpoint": latest.name if latest else None}
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def zero_size_setting(d: Path, model: str) -> dict:
    shm, t0 = shm_entries(), time.monotonic()
    p = _spawn([sys.executable, str(ROOT / "run_gsm8k.py"), "--model=tiny", f"--run_root={d / 'runs'}", "--name=zero",
                "--gen.max_batch=0"], d / "run.log")
    res = _finish({}, [p], [d / "run.log"], ATTACKS["zero_size_setting"][1], t0, shm)
    return {**res, "run_dir_made": (d / "runs" / "zero").exists()}


def run_attack(name: str, root: Path, model: str) -> dict:
    d = root / name
    d.mkdir(parents=True)
    return {"scenario": name, "fault": ATTACKS[name][0], **globals()[name](d, model)}
