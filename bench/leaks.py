"""What a run left in /dev/shm, counting only the run's own entries (bench/faults.py and the tests);
and the processes of a session still alive (`group_alive`), waited for with `wait_until`.

/dev/shm is the machine's, shared with every other program: a test that flagged any new `sem.mp-*`
there failed because another program (another test run, a notebook) had opened a semaphore
meanwhile. The kinds of entry our runtime can leave: torch's shared-memory segments
(`torch_<creator pid>_...`; with the `file_descriptor` strategy they are unlinked at once and only a
crash in between leaves one) and multiprocessing's named semaphores (`sem.mp-<random>`: spawn's
Locks, Events and Queues). An entry new since `before` counts as the run's leak when

* it is this user's (another user's program cannot be ours),
* a torch segment's creator pid is one of the run's (when the run's pids are given), and
* no living process outside the run maps it or holds it open (/proc/*/maps, /proc/*/fd): another
  program's live semaphore is mapped by that program, a leaked one by nobody. A run's process
  that still holds one is itself left running, which the callers check as well.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

SHM = "/dev/shm"
KINDS = ("torch_", "sem.mp-")


def shm_entries() -> set:
    """The names of our kinds of entry in /dev/shm now (empty where there is no /dev/shm)."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith(KINDS)}
    except FileNotFoundError:
        return set()


def holders(names) -> dict:
    """name -> pids of the living processes (those we may inspect) that map or hold open /dev/shm/name.
    Matched by inode, not path: glibc's sem_open maps a temporary file and then links it under
    its name, so a semaphore's mapping reads `/dev/shm/sem.XXXXXX (deleted)`."""
    inodes = {}
    for n in names:
        try:
            st = os.stat(os.path.join(SHM, n))
        except FileNotFoundError:
            continue
        inodes[(st.st_dev, st.st_ino)] = n
    out = {n: set() for n in names}
    if not inodes:
        return out
    dev = os.stat(SHM).st_dev
    by_ino = {ino: n for (d, ino), n in inodes.items() if d == dev}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if SHM + "/" in line:  # address perms offset dev inode path
                        n = by_ino.get(int(line.split(None, 5)[4]))
                        if n is not None:
                            out[n].add(int(pid))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except (FileNotFoundError, PermissionError):
                    continue
                n = inodes.get((st.st_dev, st.st_ino))
                if n is not None:
                    out[n].add(int(pid))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue  # gone meanwhile, or not ours to read (another user's: its entries are not ours either)
    return out


def _creator(name: str) -> int | None:
    parts = name.split("_")
    return int(parts[1]) if name.startswith("torch_") and len(parts) > 2 and parts[1].isdigit() else None


def leaked(before: set, pids=None) -> set:
    """The run's entries of /dev/shm new since `before` (a `shm_entries()` taken before the run)
    that nobody outside the run holds (module docstring). `pids`: the run's process ids, if known."""
    run = set(pids) if pids is not None else set()
    uid, new = os.getuid(), set()
    for n in shm_entries() - before:
        try:
            if os.stat(os.path.join(SHM, n)).st_uid != uid:
                continue
        except FileNotFoundError:
            continue  # unlinked meanwhile
        if pids is not None and _creator(n) is not None and _creator(n) not in run:
            continue  # another program's torch segment
        new.add(n)
    held = holders(new)
    return {n for n in new if not held[n] - run and os.path.exists(os.path.join(SHM, n))}


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            stat = (p / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
        if p.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(p.name))
    return out


def wait_until(cond, timeout: float, step: float = 0.02):
    """Poll `cond()` until it returns something true (returned) or `timeout` s pass (None)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step)
    return None
