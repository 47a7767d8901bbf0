"""The checkpoints folder of a run: which checkpoints are whole, and removing one, a leftover of
a crash or an old one, deleting only what the project wrote. Run by the trainer (rank 0), from
common/runtime/files/checkpoint.py (save, prune) and at a run's start (`clean_checkpoints`).

What the project wrote in a checkpoint: the files its meta.json lists, and meta.json itself (the
list is written last, so a checkpoint with one is whole). A folder without one is a write cut off
(`.tmp_step_*`, recorded in the run folder's manifest as made whole by the project:
common/contracts/run_files.py) or a prune cut off (`step_*` that lost its meta.json first: what is left of
it is found in the manifest). Anything else in a checkpoint folder is someone else's: left there
and named. Outside a run folder (a checkpoint saved by hand) a `.tmp_step_*` folder is taken as
ours, as the write that made it was exclusive.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from common.contracts.run_files import forget, record, record_files, remove_owned, remove_tree, run_folder_of
from common.runtime.files.state import CheckpointError

FORMAT_VERSION = 2  # 2: model and optimizer state in state/ (DCP); 1 had the optimizer in trainer_state.pt
PREFIX, TMP = "step_", ".tmp_"


def ckpt_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(p: Path) -> int | None:
    if not p.name.startswith(PREFIX):
        return None
    try:
        return int(p.name[len(PREFIX):])
    except ValueError:
        return None


def read_meta(ckpt: Path) -> dict:
    f = Path(ckpt) / "meta.json"
    if not f.is_file():
        raise CheckpointError(f"{ckpt}: no meta.json (incomplete or not a checkpoint directory)")
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: corrupt meta.json ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or "step" not in meta:
        raise CheckpointError(f"{f}: corrupt meta.json (missing 'step' or 'files')")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{f}: format_version {meta.get('format_version')!r}, this code reads "
                              f"{FORMAT_VERSION}")
    return meta


def valid_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """(step, dir) of every step_* dir with a readable meta.json, by increasing step."""
    root, out = ckpt_root(run_dir), []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        step = step_of(p)
        if step is None or not p.is_dir() or p.is_symlink():
            continue
        try:
            read_meta(p)
        except CheckpointError:
            continue
        out.append((step, p))
    return sorted(out)


def latest_checkpoint(run_dir) -> Path | None:
    """The highest-step checkpoint with a valid meta.json, or None."""
    ckpts = valid_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(tmp: Path) -> None:
    """Make the folder a checkpoint is written into (exclusive: never an existing one), recorded as
    the project's whole (common/contracts/run_files.py)."""
    tmp.mkdir()
    record(tmp, tree=True)


def published(tmp: Path, final: Path) -> None:
    """After `tmp` was renamed to `final`: the manifest follows (every file of `final` is ours)."""
    forget(tmp)
    record_files(final)


def _leave(d: Path, left: list[Path]) -> None:
    if left:
        print(f"[asyncrl] kept {', '.join(str(p) for p in left[:5])}{' and more' if len(left) > 5 else ''} in "
              f"{d}: not written by the project", file=sys.stderr)


def remove_checkpoint(d: Path, as_of: Path | None = None) -> list[Path]:
    """Delete checkpoint folder `d`'s files the project wrote (module docstring): those its meta.json
    lists, meta.json last, then the folders left empty; without one, what the run folder's manifest
    recorded (`as_of`: the path `d` had when recorded). Returns what is left (someone else's)."""
    d = Path(os.path.abspath(d))  # the listed files are compared as absolute paths (a relative run_root too)
    if not d.exists() or d.is_symlink():
        return [d] if d.is_symlink() else []
    try:
        listed = [d / rel for rel in read_meta(d)["files"]]
    except CheckpointError:
        listed = None
    root = run_folder_of(d)
    if listed is None:
        if root is not None:
            rel = lambda p: Path(os.path.abspath(p)).relative_to(root).as_posix()  # noqa: E731
            left = (remove_tree(root, rel(d)) if as_of is None else remove_owned(root, rel(d), rel(as_of)))
        elif d.name.startswith(TMP):
            shutil.rmtree(d, ignore_errors=True)
            left = []
        else:
            left = sorted(d.rglob("*"))
        _leave(d, left)
        return left
    for p in listed:
        if not p.is_symlink() and Path(os.path.abspath(p)).is_relative_to(d):
            p.unlink(missing_ok=True)
    (d / "meta.json").unlink(missing_ok=True)  # last: a prune cut off before it is pruned again
    for sub in sorted((p for p in d.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        if not any(sub.iterdir()):
            sub.rmdir()
    if not any(d.iterdir()):
        d.rmdir()
    forget(d, *([as_of] if as_of is not None else []))
    left = sorted(d.rglob("*")) if d.exists() else []
    _leave(d, left)
    return left


def prune(run_dir, keep_last: int | None, keep: Path | None = None) -> None:
    """Remove all but the newest `keep_last` whole checkpoints (None/<=0: keep all), never `keep`."""
    if keep_last is None or keep_last <= 0:
        return
    for _, p in valid_checkpoints(run_dir)[:-keep_last]:
        if p != keep:
            remove_checkpoint(p)


def clean_checkpoints(run_dir, keep_last: int | None = None) -> None:
    """At a run's start: the leftovers of a crash (writes cut off, prunes cut off) removed, then the
    old checkpoints beyond `keep_last`; what the project did not write stays."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return
    whole = {p for _, p in valid_checkpoints(run_dir)}
    for p in sorted(root.iterdir()):
        if p.is_dir() and not p.is_symlink() and (p.name.startswith(TMP) or (step_of(p) is not None and p not in whole)):
            remove_checkpoint(p)
    prune(run_dir, keep_last)
