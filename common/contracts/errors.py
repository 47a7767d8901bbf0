"""The one base class of the errors a user can fix: a bad setting, a missing file, a run name, a
full disk. Task scripts (common/task.py: `script`) print such an error as one line (what, where,
the fix) and exit with status 2; the traceback is shown only with `ASYNCRL_DEBUG=1`. A contract:
every layer may raise it, and imports nothing of ours. Also how a failed write is said (every
writer of a run: checkpoints, the record stream, the metrics): what, where, and the free space there;
a full disk is said as one, however deep in the error it lies (`disk_full`).
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class UserError(Exception):
    """A mistake in the user's input or environment, said in one line that names what and where,
    and how to fix it. Subclasses keep their own name (`ConfigError`, `CheckpointError`, ...)."""


class WriteError(UserError):
    """A file of the run could not be written (disk full, quota, I/O error): `write_failed`'s line."""


def debug() -> bool:
    """True when the user asked for tracebacks (`ASYNCRL_DEBUG=1`)."""
    return os.environ.get("ASYNCRL_DEBUG", "") not in ("", "0", "false", "no")


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as df -H)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return ""  # unreachable


def free_bytes(path) -> int | None:
    """Free bytes (for this user) on the filesystem holding `path` (or its nearest existing
    parent: the file that failed may be gone); None where that cannot be asked."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def free_space(path) -> str:
    """'1.23 MB free on that filesystem' (or 'free space unknown'), for an error message."""
    free = free_bytes(path)
    return "free space unknown" if free is None else f"{human_bytes(free)} free on that filesystem"


# a write that fails with less than this free filled the disk (a failing write stops at the disk's last block)
FULL_BELOW = 1 << 20
# torch.save's zip writer when the file took fewer bytes than it wrote (its C++ stream loses the errno)
_SHORT_WRITE = "unexpected pos"


def _chain(e: BaseException) -> list[BaseException]:
    """`e`, its causes and contexts, and the per-rank errors DCP's CheckpointException gathers
    (`failures`: rank -> (error, traceback)), each once."""
    seen, todo = [], [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or any(x is s for s in seen):
            continue
        seen.append(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return seen


def disk_full(e: BaseException, path) -> bool:
    """Whether a failed write is a full disk: an OSError with errno ENOSPC anywhere in its chain, or
    torch's short write ('unexpected pos ...', which loses the errno) with less than `FULL_BELOW`
    free on the filesystem of `path` (ask before a partial copy is removed: removing it frees space)."""
    chain = _chain(e)
    if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in chain):
        return True
    if any(_SHORT_WRITE in str(x) for x in chain):
        free = free_bytes(path)
        return free is not None and free < FULL_BELOW
    return False


def write_failed(what: str, path, e: BaseException | str, full: bool | None = None) -> str:
    """One line for a failed write: 'could not write <what> <path> (<cause>); <free space>'. A full
    disk (`full`, else `disk_full(e, path)`) is named so when the cause does not say it (torch's
    'unexpected pos 704 vs 598', an ENOSPC under another error): '(no space left on device: <cause>)'.
    `e` as a string is the cause as it is said."""
    cause = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    if full is None:
        full = not isinstance(e, str) and disk_full(e, path)
    if full and "no space left on device" not in cause.lower():
        cause = f"no space left on device: {cause}"
    return f"could not write {what} {path} ({cause}); {free_space(path)}"
