"""What the faults table's attack rows share (bench/faults_attacks.py: files and command lines;
bench/faults_store.py: the run's store across nodes): child processes in sessions of their own,
how long until the user saw the promised line, and what is left (processes, the run's /dev/shm
entries)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.leaks import group_alive, leaked, wait_until  # noqa: E402 - the run's own /dev/shm entries only

FAULTS = ROOT / "bench" / "faults.py"
SECRET = "faults-bench-" + "5a" * 16


class Payload:
    """What an intruder plants: loading it creates a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def spawn(cmd: list[str], log: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **env})


def steps(run: Path) -> int:
    f = run / "metrics.jsonl"
    return sum('"step_s"' in x for x in f.read_text().splitlines()) if f.exists() else 0


def finish(res: dict, procs: list, logs: list[Path], expect: str, t0: float, shm_before: set, pids=None) -> dict:
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


def agent(port: int, node_rank: int, *args, master: str = "127.0.0.1") -> list[str]:
    """One of two torchrun agents on `master` (static rendezvous: node 0, the trainer, hosts torchrun's
    store) running the node tests' toy run."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=static",
            f"--master-addr={master}", f"--master-port={port}", f"--node-rank={node_rank}",
            str(ROOT / "tests" / "nodes_toy.py"), "--dist.trainer_nodes=1", *args]


def job(d: Path, model: str, log: Path, resume: bool = False) -> subprocess.Popen:
    """bench/faults.py's own job (a tiny TBA run, checkpoints every 2 steps) in `d`/runs/job."""
    return spawn([sys.executable, str(FAULTS), "--child", "attack", "--dir", str(d), "--model", model]
                 + ["--resume"] * resume, log)
