"""The one base class of the errors a user can fix: a bad setting, a missing file, a run name, a
full disk. Task scripts (common/task.py: `script`) print such an error as one line (what, where,
the fix) and exit with status 2; the traceback is shown only with `ASYNCRL_DEBUG=1`. A contract:
every layer may raise it, and imports nothing of ours.
"""
from __future__ import annotations

import os


class UserError(Exception):
    """A mistake in the user's input or environment, said in one line that names what and where,
    and how to fix it. Subclasses keep their own name (`ConfigError`, `CheckpointError`, ...)."""


def debug() -> bool:
    """True when the user asked for tracebacks (`ASYNCRL_DEBUG=1`)."""
    return os.environ.get("ASYNCRL_DEBUG", "") not in ("", "0", "false", "no")
