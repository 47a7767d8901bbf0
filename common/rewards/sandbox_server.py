"""The code sandbox's server: a fresh interpreter (`python -I -S sandbox_server.py`, started by
common/rewards/sandbox.py with an empty environment) that forks a judge per program it is sent, so
that no program pays for an interpreter's start and nothing is forked from a process that holds the
run's weights. Never imported by the project; the standard library and its siblings only.

The processes, so that a program can neither leave nor lie about its tests:
  server    this one: holds nothing of the run (no weights, no secret, no environment) and never runs
            a line of a program. At its start it makes new PID and network namespaces where the
            kernel allows (a user namespace too when not root) and continues as the first process of
            the PID namespace (the process left outside only waits for it): every program then runs
            with no network and sees no process but its server's, and when the server ends the
            kernel ends every process in the namespace. Per job (a length-prefixed JSON frame on
            stdin) it forks the judge in a session of its own, reads its lines until they end or the
            wall-clock limit, kills the session, then whatever else the job left (in the namespace:
            every process but itself; without one: its children, as a child subreaper), and answers
            with the lines. One job at a time; the parent runs one server per worker.
  judge     sandbox_judge.py: runs the tests, in a process the program cannot reach.
  program   sandbox_program.py: an empty folder of its own, limits, an audit hook; it runs the
            program and answers the judge's calls. Forked from the judge: its memory holds what the
            server held, which is the job (its tests and nonce removed before its code runs) and the
            standard library modules loaded here once (`_PRELOAD`).
"""
import ctypes
import json
import os
import select
import signal
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out: its siblings
from sandbox_judge import judge_main  # noqa: E402 - after the path
from sandbox_program import _PRELOAD, _read_exact  # noqa: E402

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_NEWPID, _NEWNET, _NEWUSER = 0x20000000, 0x40000000, 0x10000000
MAX_LINES_BYTES = 16 << 20  # a judge never writes this much for one program: past it, reading stops


def _isolate(libc) -> bool:
    """New PID and network namespaces (and a user one when not root); False where the kernel refuses."""
    uid, gid, root = os.getuid(), os.getgid(), os.geteuid() == 0
    if libc.unshare(_NEWPID | _NEWNET | (0 if root else _NEWUSER)) != 0:
        return False
    if not root:  # the same ids inside, so what a program writes in its folder is the user's
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError:
                pass
    return True


def _frame_out(obj) -> None:
    data = json.dumps(obj).encode()
    os.write(1, struct.pack("<I", len(data)) + data)


def _next_job() -> dict | None:
    """The next job from the parent, or None at the end of its pipe (the parent closed it or died)."""
    head = _read_exact(0, 4, None)
    if head is None:
        return None
    body = _read_exact(0, struct.unpack("<I", head)[0], None)
    return None if body is None else json.loads(body)


def _collect(r: int, deadline: float) -> tuple[list[str], bool]:
    """The judge's lines until its pipe closes (True) or the deadline (False)."""
    buf = b""
    while len(buf) < MAX_LINES_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            return buf.decode(errors="replace").splitlines(), False
        chunk = os.read(r, 65536)
        if not chunk:
            return buf.decode(errors="replace").splitlines(), True
        buf += chunk
    return buf[:1 << 20].decode(errors="replace").splitlines(), True


def _children() -> list[int]:
    me, out = str(os.getpid()), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(pid))
            except (OSError, IndexError):
                continue
    return out


def _reap_all() -> None:
    """Kill and reap every process the job left until there is none. As the first process of its PID
    namespace the server sees only the job's processes (kill(-1) reaches every one but itself, and
    orphans come to it); without one it is a child subreaper (orphans come to it, found in /proc).
    A process's orphans are reparented before its own exit can be reaped: no child means none left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:  # a child still alive: one the job left behind (or one dying): kill them all
            killed = False
            if os.getpid() == 1:  # only here: the first process of our own namespace
                try:
                    os.kill(-1, signal.SIGKILL)
                    killed = True
                except OSError:
                    pass
            else:
                for child in _children():
                    try:
                        os.kill(child, signal.SIGKILL)
                        killed = True
                    except OSError:
                        pass
            if killed:  # one of them dies soon: wait for it rather than poll
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    return
            else:
                time.sleep(0.0005)


def serve_one(job: dict, namespaced: bool) -> None:
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        nul = os.open(os.devnull, os.O_RDWR)  # over the parent's pipes: nothing forked from here holds them
        os.dup2(nul, 0)
        os.dup2(nul, 1)
        os.close(nul)
        os.setsid()
        job["namespaced"] = namespaced
        judge_main(job, w)
    os.close(w)
    lines, ended = _collect(r, t0 + job["timeout_s"])
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    _reap_all()
    _frame_out({"lines": lines, "timeout": not ended})


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the parent gone, this goes too
    for name in _PRELOAD:  # once here, not once a program
        __import__(name)
    namespaced = "--namespaces" in sys.argv and _isolate(libc)
    if namespaced:  # this process stays outside the new PID namespace: its child is the server
        inner = os.fork()
        if inner:
            os.waitpid(inner, 0)
            os._exit(0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # its parent gone, the namespace goes
    else:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    while True:
        job = _next_job()
        if job is None:
            os._exit(0)
        serve_one(job, namespaced)
        del job


if __name__ == "__main__":
    main()
