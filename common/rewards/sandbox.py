"""The code sandbox's parent side: each program the policy wrote runs in a process of its own forked,
per program, from a sandbox server (common/rewards/sandbox_server.py: the server, the launcher, the
judge and the program's process, what each may do), in its own session and an empty temporary
folder; its tests' verdicts come back as the judge's lines, and whatever is left of it is killed at
the end. Used by the code task's reward (common/rewards/code_answer.py) in reward workers, and by
`run_code.py --judge` and the evaluation.

Safety (docs/tasks.md, "Code"): a server is a fresh interpreter started by exec, never a fork of
this process (which may hold the run's weights: Python's subprocess execs at once, nothing of this
process's memory runs in the child), with an empty environment (the run's secret, tokens and paths
stay here), `/` as its working directory and only its two pipes. It holds nothing of the run and
never runs a program's code; the programs are forked from it (so none pays for an interpreter's
start). The wall-clock limit is the server's: at it the job's session is killed, then whatever the
job left (the server is a child subreaper); here a second limit, ten seconds later, kills a server
that stopped answering. Where the kernel does not allow new namespaces (no network, no PID
namespace), the audit hook still refuses sockets and processes: said once, at the first run.

Concurrency: `Sandbox.run_many` runs up to `workers` programs at once (threads, each with a server of
its own, started at first use); each program is one process, so `workers` bounds the CPUs the
reward takes.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common.contracts.config_check import between
from common.rewards.sandbox_program import _read_exact  # the framing the server and the judge read with (stdlib only)

log = logging.getLogger("asyncrl.sandbox")
SERVER = Path(__file__).with_name("sandbox_server.py")
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

    # ranges (common/contracts/config_check.py): a limit past these is no limit, or one the kernel refuses
    CHECKS = {"timeout_s": between(0, 3600, open_lo=True), "test_timeout_s": between(0, 3600, open_lo=True),
              "cpu_s": between(1, 86400), "memory_mb": between(64, 1 << 24), "file_mb": between(1, 1 << 20),
              "open_files": between(8, 65536), "processes": between(1, 1 << 16), "output_kb": between(1, 1 << 20),
              "workers": between(1, 256)}


@dataclass
class Verdict:
    """What one program earned: tests passed of those run, and why it earned nothing where it did not."""
    passed: int
    total: int
    reason: str = "ok"                # ok, failed, syntax, crashed, timeout, blocked, no_result, forged (no_program: none ran)
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


class _Server:
    """One sandbox server (sandbox_server.py): a fresh interpreter started by exec with an empty
    environment, judging one job at a time; `judge` returns the judge's lines and whether the
    wall-clock limit cut them."""

    def __init__(self, namespaces: bool):
        self.p = subprocess.Popen([sys.executable, "-I", "-S", str(SERVER)] + ["--namespaces"] * namespaces,
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={"LANG": "C.UTF-8"},
                                  cwd="/", start_new_session=True, close_fds=True, bufsize=0)

    def judge(self, job: dict, timeout: float) -> tuple[list[str], bool]:
        data = json.dumps(job).encode()
        self.p.stdin.write(struct.pack("<I", len(data)) + data)
        done = self._frame(time.monotonic() + timeout + 10.0)  # the server ends the job at `timeout` itself
        if done is None:  # the server is stuck or gone: killed, and with it its namespace (or the job's processes
            _kill_group(self.p.pid)  # without one: they are in the server's session until the judge's setsid)
            raise OSError("the sandbox server stopped answering")
        return done["lines"], done["timeout"]

    def _frame(self, deadline: float) -> dict | None:
        """The server's next length-prefixed JSON frame, or None (none by `deadline`, or its pipe closed)."""
        fd = self.p.stdout.fileno()
        head = _read_exact(fd, 4, deadline)
        body = None if head is None else _read_exact(fd, struct.unpack("<I", head)[0], deadline)
        return None if body is None else json.loads(body)

    def close(self) -> None:
        try:
            self.p.stdin.close()  # the server exits at the end of its pipe
            self.p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            _kill_group(self.p.pid)
        self.p.wait()


class Sandbox:
    """Runs programs against their tests (module docstring); safe to share between threads; `close()`
    (or `with`) ends its servers, which also end when this process does."""

    def __init__(self, cfg: SandboxConfig | None = None, base_dir: str | None = None):
        self.cfg = cfg or SandboxConfig()
        self.base_dir = base_dir  # where each program's folder is made; None = the system's temporary directory
        self._pool = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="sandbox")
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._lock, self._servers = threading.Lock(), []  # every server started (started lazily, `workers` at most)
        # a Sandbox dropped without close() ends its servers when collected (and they end with this process)
        self._finalize = weakref.finalize(self, _close_all, self._pool, self._lock, self._servers)

    def run(self, program: str, kind: str, tests, entry_point: str | None = None) -> Verdict:
        """One program and its tests (`kind`: check, asserts, call or stdio; sandbox_judge.py)."""
        if kind not in KINDS:
            raise ValueError(f"test kind {kind!r}: expected one of {KINDS}")
        total = (len(tests) if kind != "check" else None)
        folder = tempfile.mkdtemp(prefix="asyncrl_sandbox_", dir=self.base_dir)
        c = self.cfg
        job = {"program": program, "kind": kind, "tests": tests, "entry_point": entry_point, "folder": folder,
               "nonce": os.urandom(16).hex(), "namespaces": c.namespaces, "timeout_s": c.timeout_s,
               "limits": {k: getattr(c, k) for k in ("cpu_s", "memory_mb", "file_mb", "open_files", "processes",
                                                     "output_kb", "test_timeout_s")}}
        t0 = time.monotonic()
        try:
            server = self._take()
            try:
                lines, cut = server.judge(job, c.timeout_s)
                self._idle.put(server)
            except (OSError, ValueError):  # a broken server is dropped (a new one replaces it): this job gets no result
                self._drop(server)
                lines, cut = [], False
            v = _verdict(lines + (["__timeout__"] if cut else []), job["nonce"], total, time.monotonic() - t0,
                         c.timeout_s)
            v.stdout = _head(Path(folder) / "stdout.txt")
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the folder made above: nothing in it is anyone else's
        if v.namespaced is False and c.namespaces and not _warned.is_set():
            _warned.set()
            log.warning("sandbox: this kernel does not allow new PID and network namespaces here: programs run "
                        "without them; sockets and new processes are still refused inside them")
        return v

    def run_many(self, jobs: list[dict]) -> list[Verdict]:
        """`run(**job)` for each job, `workers` at a time, in order."""
        return list(self._pool.map(lambda j: self.run(**j), jobs))

    def _take(self) -> _Server:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._servers) < self.cfg.workers:
                server = _Server(self.cfg.namespaces)
                self._servers.append(server)
                return server
        return self._idle.get()

    def _drop(self, server: _Server) -> None:
        with self._lock:
            self._servers.remove(server)
        server.close()

    def close(self) -> None:
        self._finalize()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_all(pool: ThreadPoolExecutor, lock: threading.Lock, servers: list) -> None:
    pool.shutdown(wait=True)
    with lock:
        ended = servers[:]
        servers.clear()
    for server in ended:
        server.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
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
