"""The code sandbox's parent side: each program the policy wrote runs in a fresh interpreter of its
own (common/rewards/sandbox_child.py: the launcher, the judge and the program's process, what each
may do), in its own process group and an empty temporary folder, with none of this process's
environment; its tests' verdicts come back on a pipe, and whatever is left of it is killed at the
end. Used by the code task's reward (common/rewards/code_answer.py) in generators or reward workers,
and by `run_code.py --judge`.

Safety (docs/tasks.md, "Code"): the interpreter is started by exec, never as a fork of this process
(which may hold the run's weights): Python's subprocess forks with vfork, nothing of this process's
memory is copied or runs in the child before the exec. Its environment is empty (the run's secret,
tokens and paths stay here), its working directory is its own new folder under the system's
temporary directory (never the run's), and every descriptor but stdin/stdout/stderr and the
result pipe is closed. The wall-clock limit is this process's: at it the whole process group is
killed, and again at the end whatever the program left (a process in a PID namespace of its own
dies with the namespace's first process, the judge). Where the kernel does not allow new
namespaces (no network, no PID namespace), the audit hook still refuses sockets and processes: said
once, at the first run.

Concurrency: `Sandbox.run_many` runs up to `workers` programs at once (threads waiting on
processes); each program is one interpreter, so `workers` bounds the CPUs the reward takes.
"""
from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.contracts.config_check import at_least, between

log = logging.getLogger("asyncrl.sandbox")
CHILD = Path(__file__).with_name("sandbox_child.py")
KINDS = ("check", "asserts", "call", "stdio")


@dataclass
class SandboxConfig:
    timeout_s: float = 20.0           # wall-clock limit of one program with all its tests; past it the group is killed
    test_timeout_s: float = 6.0       # one test (a call, a stdin case) at most this long; it and the later ones fail (AReaL: 6)
    cpu_s: int = 20                   # CPU seconds of the program's process (RLIMIT_CPU)
    memory_mb: int = 1024             # its address space (RLIMIT_AS)
    file_mb: int = 16                 # the largest file it may write, its stdout and stderr included (RLIMIT_FSIZE)
    open_files: int = 64              # descriptors it may hold (RLIMIT_NOFILE)
    processes: int = 64               # processes its user may run (RLIMIT_NPROC; creating one is refused anyway)
    output_kb: int = 1024             # stdout of one stdin case that is read back; more fails the case
    workers: int = 2                  # programs judged at once (each one interpreter: the CPUs the reward takes)
    namespaces: bool = True           # new PID and network namespaces where the kernel allows

    CHECKS = {"timeout_s": between(0, 3600, open_lo=True), "test_timeout_s": between(0, 3600, open_lo=True),
              "cpu_s": at_least(1), "memory_mb": at_least(64), "file_mb": at_least(1), "open_files": at_least(8),
              "processes": at_least(1), "output_kb": at_least(1), "workers": between(1, 256)}  # ranges


@dataclass
class Verdict:
    """What one program earned: tests passed of those run, and why it earned nothing where it did not."""
    passed: int
    total: int
    reason: str = "ok"                # ok, failed, syntax, crashed, timeout, blocked, no_result, forged
    detail: str = ""                  # the first error, the operation refused, or the limit reached
    seconds: float = 0.0
    namespaced: bool | None = None
    stdout: str = ""                  # the head of what the program printed
    verdicts: list = field(default_factory=list)

    def reward(self, rule: str = "all") -> float:
        """`all`: 1 when every test passed (AReaL's and DeepCoder's rule), else 0; `fraction`: the
        share passed. 0 whatever passed when the program did what it may not (`blocked`)."""
        if self.reason == "blocked" or self.total == 0:
            return 0.0
        if rule == "fraction":
            return self.passed / self.total
        return float(self.passed == self.total)


_warned = threading.Event()


class Sandbox:
    """Runs programs against their tests (module docstring); safe to share between threads."""

    def __init__(self, cfg: SandboxConfig | None = None, base_dir: str | None = None):
        self.cfg = cfg or SandboxConfig()
        self.base_dir = base_dir  # where each program's folder is made; None = the system's temporary directory
        self._pool = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="sandbox")

    def run(self, program: str, kind: str, tests, entry_point: str | None = None) -> Verdict:
        """One program and its tests (`kind`: check, asserts, call or stdio; sandbox_child.py)."""
        if kind not in KINDS:
            raise ValueError(f"test kind {kind!r}: expected one of {KINDS}")
        total = (len(tests) if kind != "check" else None)
        folder = tempfile.mkdtemp(prefix="asyncrl_sandbox_", dir=self.base_dir)
        c = self.cfg
        r, w = os.pipe()
        job = {"program": program, "kind": kind, "tests": tests, "entry_point": entry_point, "folder": folder,
               "nonce": os.urandom(16).hex(), "namespaces": c.namespaces, "result_fd": w,
               "limits": {k: getattr(c, k) for k in ("cpu_s", "memory_mb", "file_mb", "open_files", "processes",
                                                     "output_kb", "test_timeout_s")}}
        t0 = time.monotonic()
        try:
            p = subprocess.Popen([sys.executable, "-I", "-S", str(CHILD)], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"LANG": "C.UTF-8"},
                                 cwd=folder, pass_fds=(w,), start_new_session=True, close_fds=True)
        except BaseException:
            os.close(r)
            os.close(w)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        os.close(w)
        try:
            lines = self._collect(p, r, json.dumps(job).encode(), t0)
        finally:
            _kill_group(p)
            os.close(r)
        v = _verdict(lines, job["nonce"], total, time.monotonic() - t0, c.timeout_s)
        v.stdout = _head(Path(folder) / "stdout.txt")
        shutil.rmtree(folder, ignore_errors=True)  # the folder made above: nothing in it is anyone else's
        if v.namespaced is False and c.namespaces and not _warned.is_set():
            _warned.set()
            log.warning("sandbox: this kernel does not allow new PID and network namespaces here: programs run "
                        "without them; sockets and new processes are still refused inside them")
        return v

    def run_many(self, jobs: list[dict]) -> list[Verdict]:
        """`run(**job)` for each job, `workers` at a time, in order."""
        return list(self._pool.map(lambda j: self.run(**j), jobs))

    def _collect(self, p: subprocess.Popen, r: int, payload: bytes, t0: float) -> list[str]:
        """The result pipe's lines until it closes or the wall-clock limit."""
        try:
            p.stdin.write(payload)
            p.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        buf, deadline = b"", t0 + self.cfg.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                return buf.decode(errors="replace").splitlines() + ["__timeout__"]
            chunk = os.read(r, 65536)
            if not chunk:
                return buf.decode(errors="replace").splitlines()
            buf += chunk
            if len(buf) > 16 << 20:  # a judge never writes this much: something is wrong, stop reading
                return buf[:1 << 20].decode(errors="replace").splitlines()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _kill_group(p: subprocess.Popen) -> None:
    """Kill the program's process group (whatever it left behind there), then reap the launcher."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _head(path: Path, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(n).decode(errors="replace")
    except OSError:
        return ""


def _verdict(lines: list[str], nonce: str, total: int | None, seconds: float, timeout: float) -> Verdict:
    """The judge's lines as a Verdict: only lines carrying the nonce count; a missing final line is a
    timeout (the wall clock), or no result (the process ended before it: a crash of the harness)."""
    msgs, forged = [], False
    for line in lines:
        if line == "__timeout__":
            continue
        try:
            m = json.loads(line)
        except ValueError:
            forged = True
            continue
        if m.get("nonce") != nonce:
            forged = True
            continue
        msgs.append(m)
    start = next((m for m in msgs if m.get("start")), {})
    done = next((m for m in msgs if m.get("done")), None)
    seen = [m["ok"] for m in msgs if "test" in m]
    if done is None:
        reason = "timeout" if lines and lines[-1] == "__timeout__" else "no_result"
        n = total if total is not None else max(len(seen), 1)
        return Verdict(sum(seen), n, reason, f"after {seconds:.1f} s (limit {timeout:g} s)", seconds,
                       start.get("namespaced"), verdicts=seen)
    verdicts = done["passed"]
    n = done["total"] if done["total"] is not None else (total if total is not None else 1)
    if done.get("violation"):
        reason, detail = "blocked", done["violation"]
    elif forged:
        reason, detail = "forged", "a line on the result pipe without the judge's nonce"
    elif done.get("error"):
        reason, detail = ("syntax" if done["error"].startswith("SyntaxError") else "crashed"), done["error"]
    elif done.get("timed_out"):
        reason, detail = "timeout", "a test ran past its limit (test_timeout_s); it and the later ones failed"
    elif sum(verdicts) < n:
        reason, detail = "failed", f"{n - sum(verdicts)} of {n} tests failed"
    else:
        reason, detail = "ok", ""
    return Verdict(sum(verdicts), n, reason, detail, seconds, start.get("namespaced"), verdicts=verdicts)
