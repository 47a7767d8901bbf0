"""Run folders: `<run_root>/<name>/`, the one folder a run writes into and the only one
`--overwrite` deletes from.

A run name is one path component (no separator, not `.` or `..`, not empty, no control
character, at most `MAX_NAME` characters), and the folder must resolve inside run_root, symlinks
followed, so a name never reaches outside it. A folder this project creates holds a marker file
(`MARKER`: a small JSON saying when and by what) and a manifest of every entry a run wrote there
(common/contracts/run_files.py: recorded when written). A non-empty folder without the marker is refused,
untouched, whatever its entries are named. `--overwrite` removes only the recorded entries, and
refuses, removing nothing, while the folder holds anything else at any depth (a user's file, one
inside checkpoints/, a symlink), listing it.

Runs in the trainer (rank 0) through `common/runtime/run_log.py`'s `prepare_run_dir`; task
scripts check the name and the folder (`check_run_dir`, which writes nothing) before anything
loads (common/run_config.py: make_config).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from common.contracts.errors import UserError
from common.contracts.run_files import MANIFEST, MARKER, foreign, remove_owned

MAX_NAME = 200  # characters of a run name (a folder name: most file systems stop at 255 bytes)
_SHOWN = 5  # how many foreign entries a refusal lists


class RunNameError(UserError, ValueError):
    """A run name that is not one plain path component."""


class RunDirError(UserError, FileExistsError):
    """A run folder that is not ours to write into or to delete (or holds a run not to be mixed into)."""


def check_name(name) -> str:
    """`name` when it is one path component; else RunNameError saying which rule it broke."""
    fix = "give a plain folder name such as --name=my_run (where runs go: --run_root)"
    if not isinstance(name, str) or not name.strip():
        raise RunNameError(f"run name {name!r} is empty: {fix}")
    if name in (".", ".."):
        raise RunNameError(f"run name {name!r} is not a folder name ('.' and '..' are not allowed): {fix}")
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        raise RunNameError(f"run name {name!r} is an absolute path: a run lives in run_root/<name>; {fix}")
    if "/" in name or "\\" in name:
        raise RunNameError(f"run name {name!r} holds a path separator: a name is one path component; {fix}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise RunNameError(f"run name {name!r} holds a control character (a newline, a tab, NUL, ...): {fix}")
    if len(name) > MAX_NAME or len(name.encode()) > 255:
        raise RunNameError(f"run name of {len(name)} characters: a run name is a folder name of at most {MAX_NAME} "
                           f"characters; {fix}")
    return name


def run_dir_of(cfg) -> Path:
    """`<run_root>/<name>` for a run config, after checking the name and that the folder resolves
    inside run_root (a symlink named like the run may not lead out of it)."""
    root = Path(cfg.run_root)
    d = root / check_name(cfg.name)
    real = d.resolve()
    if real.parent != root.resolve():
        raise RunDirError(f"run folder {d} resolves to {real}, outside run_root {root.resolve()} (a symlink?): "
                          f"choose another --name (nothing was changed)")
    return d


def _listing(entries: list[Path], d: Path) -> str:
    names = [p.relative_to(d).as_posix() + ("/" if p.is_dir() and not p.is_symlink() else "") for p in entries]
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _mark(d: Path, name: str) -> None:
    (d / MARKER).write_text(json.dumps({"project": "asyncrl", "name": name,
                                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def check_run_dir(cfg, resume: bool) -> tuple[Path, bool, bool]:
    """What `open_run_dir` would do, changing nothing: (folder, whether --overwrite removes an
    earlier run, whether the folder holds our marker); a RunDirError where it would refuse. Task
    scripts call it before anything loads (common/run_config.py: make_config)."""
    d = run_dir_of(cfg)
    if resume and getattr(cfg, "overwrite", False):
        raise RunDirError(f"--resume and --overwrite both set for {d}: continue the run, or replace it, not both")
    if d.exists() and not d.is_dir():
        raise RunDirError(f"run folder {d} is a file, not a folder: choose another --name (nothing was changed)")
    entries = sorted(d.iterdir()) if d.is_dir() else []
    marked = (d / MARKER).is_file() and not (d / MARKER).is_symlink()
    if entries and not marked:
        raise RunDirError(f"{d} exists and was not made by this project (it holds {_listing(entries, d)}): "
                          f"choose another --name, or move that folder away (nothing was changed)")
    if not (d / "metrics.jsonl").exists() or resume:
        return d, False, marked
    if not getattr(cfg, "overwrite", False):
        raise RunDirError(f"{d} already holds a run: continue it (--resume, resume=True), replace it "
                          f"(--overwrite, overwrite=True) or choose another name")
    left = foreign(d)
    if left:
        why = ("" if (d / MANIFEST).is_file() else
               f" (it was written before runs recorded their files in {MANIFEST}: remove it yourself)")
        raise RunDirError(f"--overwrite: {d} holds what the project did not write{why}: {_listing(left, d)}; "
                          f"move it out of the folder, or choose another --name (nothing was removed)")
    return d, True, marked


def open_run_dir(cfg, resume: bool) -> Path:
    """The run folder of `cfg`, created and marked as ours, with an earlier run in it continued
    (resume), replaced (cfg.overwrite: only the entries the project recorded, and only when nothing
    else is there) or refused; never mixed into. Errors change nothing on disk."""
    d, replace, marked = check_run_dir(cfg, resume)
    if replace:
        remove_owned(d, "")
        (d / MANIFEST).unlink(missing_ok=True)  # a fresh record for the new run
        print(f"[asyncrl] --overwrite: removed the earlier run in {d}")
        marked = False
    d.mkdir(parents=True, exist_ok=True)
    if not marked:
        _mark(d, cfg.name)
    return d
