"""The one base class of the errors a user can fix: a bad setting, a missing file, a run name, a
full disk. Task scripts (common/task.py: `script`) print such an error as one line (what, where,
the fix) and exit with status 2; the traceback is shown only with `ASYNCRL_DEBUG=1`. A contract:
every layer may raise it, and imports nothing of ours. Also how a failed write is said (every
writer of a run: checkpoints, the record stream, the metrics): what, where, and the free space there.
"""
from __future__ import annotations

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


def write_failed(what: str, path, e: BaseException | str) -> str:
    """One line for a failed write: 'could not write <what> <path> (<cause>); <free space>'."""
    cause = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return f"could not write {what} {path} ({cause}); {free_space(path)}"
