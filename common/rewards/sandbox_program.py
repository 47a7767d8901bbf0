"""The program's side of the code sandbox: the messages between the judge and the program, the
program's process (limits, the audit hook, running the program and answering the judge's calls).
Imported by the sandbox server (sandbox_server.py) before any program runs, in a fresh interpreter
(`python -I -S`); the standard library only. What each process does: sandbox_server.py's docstring.
"""
import ast
import builtins
import io
import math
import os
import resource
import select
import signal
import struct
import sys
import time

MAX_MESSAGE = 1 << 20  # bytes of one answer of the program's; a longer one is a failure
# modules a computation has no use for, each a way out of the process or into its memory
_DENIED_MODULES = {"ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
                   "multiprocessing", "_multiprocessing", "mmap", "gc", "fcntl", "pty", "resource", "signal",
                   "_signal", "urllib", "http", "ftplib", "smtplib", "telnetlib", "asyncio", "pdb", "faulthandler",
                   "tracemalloc", "_tracemalloc", "_xxsubinterpreters", "_posixshmem", "termios"}
_DENIED_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
                  "os.setuid", "os.setgid", "os.chroot", "os.setns", "os.unshare", "subprocess.Popen", "socket.__new__",
                  "socket.connect", "socket.bind", "socket.getaddrinfo", "sys._current_frames", "sys.settrace",
                  "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "signal.pthread_kill",
                  "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof", "ctypes.call_function",
                  "urllib.Request", "webbrowser.open", "pty.spawn", "os.fchdir", "resource.setrlimit",
                  "resource.prlimit", "sys.remote_exec"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
                "os.truncate", "os.utime", "os.chdir", "shutil.rmtree", "shutil.move", "shutil.copyfile",
                "shutil.copytree", "os.listdir", "os.scandir", "glob.glob", "os.setxattr", "os.removexattr"}
# modules most programs import, loaded once by the server (a program forked from it finds them loaded);
# not more: every module loaded there makes each fork slower (hashlib's OpenSSL doubles it)
_PRELOAD = ("typing", "collections", "dataclasses", "enum", "functools", "itertools", "heapq", "bisect", "math",
            "string", "re", "random", "copy", "operator", "io")


# ------------------------------------------------------------------ messages between judge and program
def _send(fd: int, obj) -> None:
    data = repr(obj).encode()
    os.write(fd, struct.pack("<I", len(data)) + data)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    out = b""
    while len(out) < n:
        if deadline is not None:
            left = deadline - _now()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def _receive(fd: int, deadline: float | None = None):
    """The next message as a plain value (ast.literal_eval), or None: none in time, the other side
    gone, a message too long or not a literal."""
    head = _read_exact(fd, 4, deadline)
    if head is None or struct.unpack("<I", head)[0] > MAX_MESSAGE:
        return None
    body = _read_exact(fd, struct.unpack("<I", head)[0], deadline)
    try:
        return _decode(ast.literal_eval(body.decode())) if body is not None else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
        return None


def _encode(x):
    """A value as a Python literal can carry it (inf and nan as tagged tuples)."""
    t = type(x)
    if t is float and not math.isfinite(x):
        return ("__float__", repr(x))
    if t in (list, tuple, set, frozenset):
        return t(_encode(v) for v in x) if t is not set else {_encode(v) for v in x}
    if t is dict:
        return {_encode(k): _encode(v) for k, v in x.items()}
    return x


def _decode(x):
    t = type(x)
    if t is tuple and len(x) == 2 and x[0] == "__float__":
        return float(x[1])
    if t in (list, tuple):
        return t(_decode(v) for v in x)
    if t is dict:
        return {_decode(k): _decode(v) for k, v in x.items()}
    return x


def _now() -> float:
    return time.monotonic()


# ------------------------------------------------------------------ the program's process
def _limit(limits: dict) -> None:
    mb = 2 ** 20
    for what, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_mb"] * mb),
                        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb), (resource.RLIMIT_NOFILE, limits["open_files"]),
                        (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))


def _guard(folder: str, violations: list, report) -> None:
    """The audit hook (module docstring): refuses what a computation has no business doing, records
    the first refusal and reports it to the judge (`report`)."""
    reads = tuple({os.path.dirname(os.__file__), sys.base_prefix, sys.prefix, "/dev/null", "/dev/urandom"})
    realpath, isinstance_, fsdecode, inside = os.path.realpath, isinstance, os.fsdecode, folder.rstrip("/") + "/"
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def refuse(event, detail):
        if not violations:
            violations.append(f"{event} {str(detail)[:160]}")
            report(violations[0])
        raise PermissionError(f"sandbox: {event} is not allowed here")

    def where(p):
        p = realpath(fsdecode(p))
        return p, p == folder or p.startswith(inside)

    def hook(event, args):
        if event in _DENIED_EVENTS:
            refuse(event, args[:1])
        elif event == "import":
            name = args[0] or ""
            if name.split(".")[0] in _DENIED_MODULES:
                refuse("import", name)
        elif event == "pickle.find_class" and (args[0].split(".")[0] in _DENIED_MODULES or args[0] in ("os", "posix")):
            refuse(event, f"{args[0]}.{args[1]}")
        elif event == "open" and isinstance_(args[0], (str, bytes)):
            p, ok = where(args[0])
            mode, flags = args[1], args[2] or 0
            writes = (mode is not None and any(c in mode for c in "wax+")) or bool(flags & write_flags)
            if not ok and (writes or not p.startswith(reads)):
                refuse("open", p)
        elif event in _PATH_EVENTS:
            for a in args[:2]:
                if isinstance_(a, (str, bytes)):
                    p, ok = where(a)
                    if not ok and not (event in ("os.listdir", "os.scandir", "glob.glob") and p.startswith(reads)):
                        refuse(event, p)
    sys.addaudithook(hook)


def _program(job: dict, calls: int, answers: int, alarm: int) -> None:
    """The program's process (module docstring): runs it, then answers the judge until told to stop."""
    for fd in [int(x) for x in os.listdir("/proc/self/fd")]:  # the result pipe and anything else inherited:
        if fd > 2 and fd not in (calls, answers, alarm):        # only its own pipes stay
            try:
                os.close(fd)
            except OSError:
                pass
    folder = os.path.realpath(job["folder"])
    os.chdir(folder)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the size limit fails (EFBIG) instead of killing
    _limit(job["limits"])
    write = os.write
    violations: list = []
    _guard(folder, violations, lambda v: write(alarm, v.encode()[:400]))
    send, receive, repr_ = _send, _receive, repr
    cap = job["limits"]["output_kb"] * 1024
    try:  # ---- from here on the program's code runs ----
        code = compile(job["program"], "<program>", "exec")
        ns = {"__builtins__": builtins, "__name__": "__main__"}
        if job["kind"] != "stdio":
            exec(code, ns)
        send(answers, ("ready", None))
    except BaseException as e:  # noqa: BLE001 - the program did not load: every test fails
        send(answers, ("failed", f"{type(e).__name__}: {str(e)[:200]}"))
        os._exit(0)
    while True:
        req = receive(calls)
        if req is None or req[0] == "stop":
            os._exit(0)
        try:
            if req[0] == "call":
                out = ns[req[1]](*req[2])
                send(answers, ("ok", _encode(out)))
            elif req[0] == "run":  # stdio: the program once on this input
                sys.stdin = io.TextIOWrapper(io.BytesIO(req[1].encode()))
                sys.stdout = buf = io.StringIO()
                try:
                    exec(code, {"__builtins__": builtins, "__name__": "__main__"})
                    ok = True
                except SystemExit as e:
                    ok = e.code in (None, 0)
                text = buf.getvalue()
                send(answers, ("ok", text) if ok and len(text) <= cap else ("err", "exit" if not ok else "output"))
            elif req[0] == "names":
                send(answers, ("ok", [k for k, v in ns.items() if callable(v) and not k.startswith("__")]))
        except BaseException as e:  # noqa: BLE001 - the call failed: that test fails
            try:
                send(answers, ("err", repr_(type(e).__name__)[:100]))
            except BaseException:  # noqa: BLE001
                os._exit(0)


