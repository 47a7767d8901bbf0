"""Run folders: `<run_root>/<name>/`, the one folder a run writes into and the only one
`--overwrite` deletes from.

A run name is one path component (no separator, not `.` or `..`, not empty), and the folder must
resolve inside run_root, symlinks followed, so a name never reaches outside it. A folder this
project creates holds a marker file (`MARKER`: a small JSON saying when and by what); an
existing folder without it is taken as ours only when every entry in it is one a run writes
(`OURS`: runs made before the marker existed), otherwise it is refused, untouched.
`--overwrite` removes only the entries a run writes, and refuses, removing nothing, while the
folder holds anything else (a user's file, a symlink).

Runs in the trainer (rank 0) through `common/runtime/run_log.py`'s `prepare_run_dir`; task
scripts check the name and the folder (`check_run_dir`, which writes nothing) before anything
loads (common/run_config.py: make_config).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from common.errors import UserError

MARKER = ".asyncrl_run"
# what a run (a training run, a replay, a task's own evaluation, other nodes) writes in its folder
_FILES = frozenset({MARKER, "config.json", "precision.json", "metrics.jsonl", "metrics_discarded.jsonl",
                    "curves.png", "workers.json", "replay_of.json", "replays.png", "eval_summary.json",
                    "attacks.jsonl"})
_DIRS = frozenset({"checkpoints", "stacks", "stream", "tensorboard", "wandb"})
_NODE_DIR = re.compile(r"node\d+")  # a multi-node run's per-node files (common/runtime/nodes/)
_TMP_FILE = re.compile(r"\..+\.\d+\.tmp")  # common/config.py save_config's temporary file
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
    if "\0" in name:
        raise RunNameError(f"run name {name!r} holds a NUL character: {fix}")
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


def _ours(p: Path) -> bool:
    """Whether an entry of a run folder is one a run writes (we never write symlinks)."""
    if p.is_symlink():
        return False
    if p.is_dir():
        return p.name in _DIRS or _NODE_DIR.fullmatch(p.name) is not None
    return p.name in _FILES or _TMP_FILE.fullmatch(p.name) is not None


def _listing(entries: list[Path]) -> str:
    names = [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in entries]
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _mark(d: Path, name: str) -> None:
    (d / MARKER).write_text(json.dumps({"project": "asyncrl", "name": name,
                                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def _remove(d: Path, entries: list[Path]) -> None:
    """Delete the given entries of `d` (every one checked to be ours) and say what went."""
    shown = _listing([p for p in entries if p.name != MARKER])
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    print(f"[asyncrl] --overwrite: removed the earlier run in {d} ({shown})")


def check_run_dir(cfg, resume: bool) -> tuple[Path, list[Path], bool]:
    """What `open_run_dir` would do, changing nothing: (folder, the entries --overwrite removes
    (none: keep all), whether the folder holds our marker); a RunDirError where it would refuse.
    Task scripts call it before anything loads (common/run_config.py: make_config)."""
    d = run_dir_of(cfg)
    if resume and getattr(cfg, "overwrite", False):
        raise RunDirError(f"--resume and --overwrite both set for {d}: continue the run, or replace it, not both")
    if d.exists() and not d.is_dir():
        raise RunDirError(f"run folder {d} is a file, not a folder: choose another --name (nothing was changed)")
    entries = sorted(d.iterdir()) if d.is_dir() else []
    foreign = [p for p in entries if not _ours(p)]
    marked = (d / MARKER).is_file() and not (d / MARKER).is_symlink()
    # without the marker: ours only when every entry is a run's (more than a lone config.json, which
    # any Hugging Face model folder has); an empty folder is free to use
    legacy = not foreign and any(p.name != "config.json" for p in entries)
    if entries and not marked and not legacy:
        raise RunDirError(f"{d} exists and was not made by this project (it holds {_listing(foreign or entries)}): "
                          f"choose another --name, or move that folder away (nothing was changed)")
    if not (d / "metrics.jsonl").exists() or resume:
        return d, [], marked
    if not getattr(cfg, "overwrite", False):
        raise RunDirError(f"{d} already holds a run: continue it (--resume, resume=True), replace it "
                          f"(--overwrite, overwrite=True) or choose another name")
    if foreign:
        raise RunDirError(f"--overwrite: {d} holds files a run does not write ({_listing(foreign)}): move them "
                          f"out of it, or choose another --name (nothing was removed)")
    return d, entries, marked


def open_run_dir(cfg, resume: bool) -> Path:
    """The run folder of `cfg`, created and marked as ours, with an earlier run in it continued
    (resume), replaced (cfg.overwrite: only the entries a run writes, and only in a folder that is
    ours) or refused; never mixed into. Errors change nothing on disk."""
    d, remove, marked = check_run_dir(cfg, resume)
    if remove:
        _remove(d, remove)
        marked = False
    d.mkdir(parents=True, exist_ok=True)
    if not marked:
        _mark(d, cfg.name)
    return d
