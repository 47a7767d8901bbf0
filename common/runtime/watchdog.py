"""Liveness: workers publish heartbeats and what they are doing; the trainer names a worker that
stops making progress, with its phase, for how long, and its Python stack.

Processes: every worker (generators, reward workers, trainer ranks 1..N-1) holds a `Beat` and calls
`beat(phase, request)` at least once per loop iteration: per decode step, around each reward
call, reference pass and weight apply, and on every poll while it waits (for quota, for a
reward worker). A worker that is waiting legitimately therefore keeps beating; only one stuck
inside a single call (a deadlock, a reward function blocked on the network, a stopped process)
goes quiet. The trainer's `Watchdog.check()` runs inside `Workers.check()`, so every trainer
wait is covered; it reads one small shared array.

Shared state: `Heartbeats.t` (n_workers, 3) float64 in shared memory: [time of the last beat
(time.monotonic, system-wide on Linux so comparable across processes), phase index, request
id or -1]. One writer per row (its worker), one reader (the trainer); a torn read of a row can
only mix two recent beats, which is harmless for a timeout measured in seconds.

Stacks: each worker registers `faulthandler` on SIGUSR1, writing to its own file in a
directory the trainer chose; on a stall the trainer sends SIGUSR1 and reads the file. The dump
runs in the C signal handler, so it works while the worker is stuck in Python or in a blocking
C call; a stopped process (SIGSTOP, state T) cannot run it, and the report says so.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch

from common.contracts.run_files import record

PHASES = ("spawning", "starting", "loading", "waiting", "applying_weights", "decoding", "scoring", "reference",
          "training", "publishing", "gathering", "checkpointing")  # the last four: trainer ranks 1..N-1
_STACK_WAIT_S = 1.0  # how long the trainer waits for a worker's stack dump to appear


class WorkerStalled(RuntimeError):
    """A worker made no progress for train.stall_timeout seconds (message: who, what, stack)."""

    def __init__(self, message: str, worker: str = ""):
        super().__init__(message)
        self.worker = worker  # its name: shutdown kills it at once (it cannot honour stop_event)


class Heartbeats:
    """Shared heartbeat table, one row per worker name; create in the trainer before spawning."""

    def __init__(self, names: list[str], stack_dir: str | os.PathLike):
        self.names = list(names)
        self.stack_dir = str(stack_dir)
        self.t = torch.zeros(len(self.names), 3, dtype=torch.float64).share_memory_()
        self.t[:, 0] = time.monotonic()
        self.t[:, 2] = -1

    def beat_for(self, name: str) -> "Beat":
        return Beat(self.t, self.names.index(name), name, self.stack_dir)

    def row(self, name: str) -> tuple[float, str, int]:
        """(seconds since the last beat, phase, request id) of one worker."""
        last, phase, req = self.t[self.names.index(name)].tolist()
        return time.monotonic() - last, PHASES[int(phase)], int(req)


class Beat:
    """A worker's handle (picklable through torch.multiprocessing: the tensor is shared)."""

    def __init__(self, t: torch.Tensor, i: int, name: str, stack_dir: str):
        self.t, self.i, self.name, self.stack_dir = t, i, name, stack_dir
        self._row = None
        self._stack_file = None

    def start(self) -> "Beat":
        """Call first thing in the worker: numpy view of its row, stack dump on SIGUSR1."""
        self._row = self.t[self.i].numpy()  # numpy writes are ~20x cheaper than tensor ops
        Path(self.stack_dir).mkdir(parents=True, exist_ok=True)
        record(Path(self.stack_dir) / f"{self.name}.txt")  # in a run folder: ours (common/contracts/run_files.py)
        self._stack_file = open(Path(self.stack_dir) / f"{self.name}.txt", "w")  # kept open for the handler
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        self("starting")
        return self

    def __call__(self, phase: str, request: int = -1) -> None:
        row = self._row if self._row is not None else self.t[self.i].numpy()
        row[1], row[2] = PHASES.index(phase), request
        row[0] = time.monotonic()  # last: a reader that sees the new time sees the new phase

    def __getstate__(self):
        return {"t": self.t, "i": self.i, "name": self.name, "stack_dir": self.stack_dir}

    def __setstate__(self, s):
        self.__init__(s["t"], s["i"], s["name"], s["stack_dir"])


def process_state(pid: int) -> str:
    """Linux process state letter from /proc ("S" sleeping, "R" running, "T" stopped, "D" disk
    wait, "Z" zombie), or "?" where /proc is not available."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def dump_stack(pid: int, name: str, stack_dir: str) -> str:
    """Ask worker `pid` for its Python stack (SIGUSR1 -> faulthandler) and return it."""
    f = Path(stack_dir) / f"{name}.txt"
    if process_state(pid) == "T":
        return "(no stack: the process is stopped (SIGSTOP / state T) and cannot run its handler)"
    before = f.stat().st_size if f.exists() else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError as e:
        return f"(no stack: {e})"
    deadline = time.monotonic() + _STACK_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if f.exists() and f.stat().st_size > before:
            time.sleep(0.1)  # let the handler finish writing every thread
            return f.read_bytes()[before:].decode(errors="replace").rstrip()
    return f"(no stack within {_STACK_WAIT_S} s: the worker may be blocked with signals masked)"


class Watchdog:
    """Trainer side: `check()` raises WorkerStalled ("stop") or prints a warning every
    `timeout` seconds ("warn") for each live worker silent for more than `timeout` seconds."""

    def __init__(self, hb: Heartbeats, pid_of, timeout: float, action: str = "stop"):
        """pid_of(name) -> the worker's pid while it is alive, else None (dead workers are
        `Workers.check`'s to report)."""
        if action not in ("stop", "warn"):
            raise ValueError(f"stall action {action!r}: expected 'stop' or 'warn'")
        self.hb, self.pid_of, self.timeout, self.action = hb, pid_of, float(timeout), action
        self._warned: dict[str, float] = {}
        self.n_reports = 0

    def report(self, name: str) -> str:
        age, phase, req = self.hb.row(name)
        pid = self.pid_of(name)
        what = f" on request {req}" if req >= 0 else ""
        # before Beat.start() no SIGUSR1 handler exists, and the signal's default action kills
        stack = ("(no stack: the worker never started; stuck spawning or importing)" if phase == "spawning"
                 else dump_stack(pid, name, self.hb.stack_dir))
        return (f"worker {name!r} (pid {pid}, state {process_state(pid)}) has made no progress for "
                f"{age:.1f} s (train.stall_timeout={self.timeout:g}), phase '{phase}'{what}. Its stack:\n" + stack)

    def check(self) -> None:
        if self.timeout <= 0:
            return
        now = time.monotonic()
        for name in self.hb.names:
            pid = self.pid_of(name)
            if pid is None or self.hb.row(name)[0] <= self.timeout:
                continue
            if self.action == "stop":
                raise WorkerStalled(self.report(name), name)
            if now - self._warned.get(name, -float("inf")) >= self.timeout:
                self._warned[name] = now
                self.n_reports += 1
                print(f"[asyncrl] WARNING (train.stall_action=warn, still waiting): {self.report(name)}",
                      file=sys.stderr, flush=True)
