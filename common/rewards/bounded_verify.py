"""math-verify's symbolic comparison of two LaTeX answers, every comparison bounded in time and
memory without signals: it runs in a child process of its own that is killed and replaced when a
comparison outlasts its bound (`TIMEOUT_S`) or dies.

Why a process: sympy on a hostile answer (\\boxed{9^{9^{9^{9}}}}, a power of ten with a billion
digits) computes for minutes and takes gigabytes; math-verify's own timeout is `signal.alarm`, which
only works in a process's main thread (a reward worker's thread, a notebook's executor cannot use
it), and a Python thread cannot be stopped. The child holds no weights and no secret; it parses
LaTeX only (math-verify's LaTeX extraction: a grammar, never `eval`; its plain-expression extraction,
which goes through sympy's `parse_expr`, is not used), under an address-space limit
(`MEMORY_BYTES`), and dies with the process that started it (PR_SET_PDEATHSIG).

Runs in every process that computes a math reward (generators, reward workers, the trainer's
evaluation); the child is started on the first symbolic comparison (`python -m
common.rewards.bounded_verify`: a JSON line in, a JSON line out, per comparison) and restarted in the
background after a kill, so a hostile answer costs its bound once.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: common/rewards/ -> ..
TIMEOUT_S = 0.8               # a comparison that takes longer scores 0 (its child is replaced): a hostile answer costs < 1 s
START_TIMEOUT_S = 60.0        # a child's start (math-verify and sympy imported) at most this long
MEMORY_BYTES = 3 * 2**30      # the child's address space: sympy's huge integers fail there, not the machine


def _limit_self(parent: int) -> None:
    """The child's own limits, set first thing: its address space bounded, its death tied to the
    parent's (no preexec_fn: forking a process with threads then running Python is unsafe)."""
    import ctypes  # stdlib; the child's only
    import resource  # stdlib; Unix only, as the project is
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # the parent died before the prctl took effect
        sys.exit(0)


class Verifier:
    """One child process and the comparisons sent to it, one at a time (a lock: threads share it)."""

    def __init__(self, timeout: float = TIMEOUT_S):
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the child said it imported math-verify
        self._lock = threading.Lock()
        self.timeouts = self.restarts = 0

    def _start(self) -> subprocess.Popen:
        root = ROOT
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
        env.update(PYTHONPATH=root, OMP_NUM_THREADS="1")  # nothing of the run's environment (its secret) passes
        self._ready = False
        return subprocess.Popen([sys.executable, "-m", "common.rewards.bounded_verify", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                cwd=root, text=True, bufsize=1)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = self._start()  # at once: it imports while the caller goes on
        self.restarts += 1

    def _read(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline() if ready else None

    def equal(self, gold: str, pred: str) -> bool:
        """Whether math-verify finds LaTeX answers `gold` and `pred` equal, within the bound; False on
        a timeout, a crash or an answer it cannot parse."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            try:
                if not self._ready:  # a fresh child first imports math-verify: that wait is not the answer's
                    self._ready = self._read(START_TIMEOUT_S) == '"ready"\n'
                started = time.monotonic()
                self._proc.stdin.write(json.dumps([gold, pred]) + "\n")
                self._proc.stdin.flush()
                line = self._read(self.timeout) if self._ready else None
            except (BrokenPipeError, OSError, ValueError):
                started, line = time.monotonic(), None
            if not line:
                self.timeouts += time.monotonic() - started >= self.timeout
                self._kill()
                return False
            return json.loads(line) is True


_verifier: Verifier | None = None
_made = threading.Lock()


def latex_equal(gold: str, pred: str) -> bool:
    """`Verifier.equal` on this process's verifier (made on first use)."""
    global _verifier
    with _made:
        if _verifier is None:
            _verifier = Verifier()
    return _verifier.equal(gold, pred)


def _serve(parent: int) -> None:
    """The child: read [gold, pred] JSON lines, answer true/false per line (no timeout of its own:
    the parent's bound kills it)."""
    _limit_self(parent)
    from math_verify import LatexExtractionConfig, parse, verify  # only the child imports sympy
    latex = [LatexExtractionConfig(boxed_match_priority=0)]
    # warm: the first parse and verify load the LaTeX grammar and sympy's printers (~0.3 s, seconds on
    # a loaded box), which must not count against the first real comparison's bound
    verify(parse("\\boxed{\\frac{1}{2}}", extraction_config=latex, parsing_timeout=None),
           parse("\\boxed{2^{-1}}", extraction_config=latex, parsing_timeout=None), timeout_seconds=None)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        try:
            gold, pred = json.loads(line)
            g = parse(f"\\boxed{{{gold}}}", extraction_config=latex, parsing_timeout=None)
            p = parse(f"\\boxed{{{pred}}}", extraction_config=latex, parsing_timeout=None)
            ok = bool(g and p and verify(g, p, timeout_seconds=None))
        except Exception:  # noqa: BLE001 - an answer it cannot parse is not equal
            ok = False
        print(json.dumps(ok), flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
