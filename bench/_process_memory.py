"""Each process's GPU memory as nvidia-smi sees it (its caching allocator's reserve and its CUDA
context), polled while a run runs and named by the run's workers.json (trainer, generator0,
reward0, ...): the peak of each, to set beside the memory plan's total for that process (the
allocator peaks the run logs leave out the reward workers). Runs in bench/paper_runs.py's process.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable


def smi_used() -> dict[int, int]:
    """{pid: bytes} of the compute processes nvidia-smi lists ({} without nvidia-smi; a process it
    reports no figure for, "[N/A]" inside some containers, is left out)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        try:
            used[int(pid)] = int(mib) * 2**20
        except ValueError:
            continue
    return used


class Peaks:
    """The peak bytes of each named process of a run, one `poll()` at a time."""

    def __init__(self, workers_json: Path, query: Callable[[], dict[int, int]] = smi_used):
        self.workers_json, self.query = workers_json, query
        self.names: dict[int, str] = {}
        self.peak: dict[str, int] = {}

    def poll(self) -> None:
        if not self.names and self.workers_json.is_file():  # written once, when the workers have started
            try:
                self.names = {pid: name for name, pid in json.loads(self.workers_json.read_text()).items()}
            except (ValueError, OSError):  # caught mid-write: read again at the next poll
                return
        for pid, nbytes in self.query().items():
            if pid in self.names:
                name = self.names[pid]
                self.peak[name] = max(self.peak.get(name, 0), nbytes)


def plan_process(name: str) -> str | None:
    """The memory plan's process for a workers.json name ("generator0" -> "generator 0")."""
    if name == "trainer":
        return "trainer"
    if name.startswith("generator"):
        return f"generator {name[len('generator'):]}"
    return "reward workers" if name.startswith("reward") else None
