"""Which files in a run folder the project wrote: recorded when written, checked at every depth,
and the only ones ever deleted (`--overwrite`, checkpoint pruning, leftovers of a crash).

A run folder (`<run_root>/<name>/`, common/runtime/files/run_dir.py) holds the project's marker
(`MARKER`) and a manifest (`MANIFEST`): one line per entry a writer recorded, `f <path>` a file,
`d <path>` a folder, `t <path>` a folder and everything in it (one the project made empty and
filled in one go, or handed to a library that names its own files: a checkpoint being written,
TensorBoard's and W&B's folders), `- <path>` an entry removed. Paths are relative to the run folder,
'/'-separated. A folder is the project's when recorded, or when it holds a recorded entry.
Anything else is foreign: a user's file, a symlink (the project writes none), another tool's
folder; no name makes an entry the project's.

`record(path)` finds the run folder by walking up to the marker, so a writer at any depth records
without knowing where its folder sits (a path under no marked folder is not recorded: a checkpoint
or a stream written outside runs). Lines are appended with one `write` on an O_APPEND descriptor,
so the writers of one run (the trainer, its ranks' folders, the node processes' folders on one file
system) never interleave within a line.

Runs wherever a run writes (trainer, node processes, replay, the task scripts' evaluations).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

MARKER = ".asyncrl_run"        # the project made this folder (a small JSON: when, by what)
MANIFEST = ".asyncrl_files"    # what the project wrote in it (module docstring)
_OWN = frozenset({MARKER, MANIFEST})


def run_folder_of(path) -> Path | None:
    """The nearest folder at or above `path`'s parent that holds the marker (not a symlink), or None."""
    p = Path(os.path.abspath(path))
    for d in (p if p.is_dir() and not p.is_symlink() else p.parent, *p.parents):
        m = d / MARKER
        if m.is_file() and not m.is_symlink():
            return d
    return None


def _append(root: Path, lines: list[str]) -> None:
    fd = os.open(root / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(lines).encode())
    finally:
        os.close(fd)


def record(*paths, tree: bool = False) -> None:
    """Record `paths` as written by the project in their run folder's manifest: a folder as `d`
    (with `tree`, as `t`: everything in it), anything else as a file (recorded before or after it
    is written). A path under no run folder, or the run folder itself, is not recorded."""
    by_root: dict[Path, list[str]] = {}
    for path in paths:
        p = Path(os.path.abspath(path))
        root = run_folder_of(p)
        if root is None or p == root:
            continue
        kind = "t" if tree else ("d" if p.is_dir() and not p.is_symlink() else "f")
        by_root.setdefault(root, []).append(f"{kind} {p.relative_to(root).as_posix()}\n")
    for root, lines in by_root.items():
        _append(root, lines)


def record_files(folder) -> None:
    """Record every file now in `folder` (and the folder): a folder the project just wrote whole
    (a checkpoint after its rename: nothing but its own files can be in it yet)."""
    folder = Path(folder)
    record(folder, *(p for p in sorted(folder.rglob("*")) if not p.is_symlink()))


def forget(*paths) -> None:
    """Record that `paths` are gone (renamed away or removed by the project)."""
    by_root: dict[Path, list[str]] = {}
    for path in paths:
        p = Path(os.path.abspath(path))
        root = run_folder_of(p)
        if root is not None and p != root:
            by_root.setdefault(root, []).append(f"- {p.relative_to(root).as_posix()}\n")
    for root, lines in by_root.items():
        _append(root, lines)


def recorded(path) -> bool:
    """Whether `path` is an entry the project recorded in its run folder (False outside run folders)."""
    p = Path(os.path.abspath(path))
    root = run_folder_of(p)
    if root is None or p == root or p.is_symlink():
        return False
    rel = p.relative_to(root).as_posix()
    owned = Owned(root)
    return owned.is_ours_dir(rel) if p.is_dir() else owned.is_ours(rel)


class Owned:
    """A run folder's manifest, read: `is_ours(rel)` for files, `is_ours_dir(rel)` for folders."""

    def __init__(self, root):
        self.root = Path(root)
        self.files, self.dirs, self.trees = set(), set(), set()
        f = self.root / MANIFEST
        text = f.read_text(errors="replace") if f.is_file() and not f.is_symlink() else ""
        for line in text.splitlines():
            kind, _, rel = line.partition(" ")
            if kind == "-":  # removed: it and anything recorded under it
                for entries in (self.files, self.dirs, self.trees):
                    entries.difference_update({e for e in entries if e == rel or e.startswith(rel + "/")})
            elif kind in ("f", "d", "t") and rel:
                {"f": self.files, "d": self.dirs, "t": self.trees}[kind].add(rel)
        self._holders = {str(Path(r).parent.as_posix()) for r in self.files | self.dirs | self.trees}
        self._holders |= {a.as_posix() for r in self._holders for a in Path(r).parents}

    def in_tree(self, rel: str) -> bool:
        return any(rel == t or rel.startswith(t + "/") for t in self.trees)

    def is_ours(self, rel: str) -> bool:
        return rel in _OWN or rel in self.files or self.in_tree(rel)

    def is_ours_dir(self, rel: str) -> bool:
        return rel in self.dirs or rel in self._holders or self.in_tree(rel)


def foreign(root, sub: str = "") -> list[Path]:
    """Every entry under `root`/`sub` (all of the run folder by default) the project did not write,
    at every depth (a foreign folder is listed, not entered); symlinks are never the project's."""
    root = Path(root)
    owned, out = Owned(root), []
    top = root / sub if sub else root
    if not top.exists() and not top.is_symlink():
        return out
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        here = Path(dirpath)
        for name in sorted(dirnames):
            p = here / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink() or not owned.is_ours_dir(rel):
                out.append(p)
                dirnames.remove(name)  # not entered: all of it is someone else's
            elif owned.in_tree(rel):
                dirnames.remove(name)  # all of it is ours
        for name in sorted(filenames):
            p = here / name
            if p.is_symlink() or not owned.is_ours(p.relative_to(root).as_posix()):
                out.append(p)
    return out


def remove_owned(root, sub: str, as_of: str | None = None) -> list[Path]:
    """Delete what the project wrote under `root`/`sub` (the recorded files and trees, then the
    folders left empty) and nothing else; returns the foreign entries left there. `as_of`: the path
    the entries were recorded under, where the folder was renamed since (a checkpoint replaced in
    place). Each removal is recorded."""
    root, as_of = Path(root), as_of or sub
    owned, top = Owned(root), root / sub
    if not top.exists() or top.is_symlink():
        return [top] if top.is_symlink() else []
    left, gone = [], []
    for dirpath, dirnames, filenames in os.walk(top, topdown=False, followlinks=False):
        here = Path(dirpath)
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            p = here / name
            rel = (Path(as_of) / p.relative_to(top)).as_posix()
            if not p.is_symlink() and owned.is_ours(rel):
                p.unlink()
                gone.append(rel)
            else:
                left.append(p)
        rel = (Path(as_of) / here.relative_to(top)).as_posix() if here != top else as_of
        if owned.is_ours_dir(rel) and not any(here.iterdir()):
            here.rmdir()
            gone.append(rel)
    if gone:
        _append(root, [f"- {r}\n" for r in gone])
    return sorted(left)


def remove_tree(root, sub: str) -> list[Path]:
    """Delete `root`/`sub` whole where the manifest says all of it is the project's (a `t` entry: a
    checkpoint write that failed or was cut off), else only what is recorded (`remove_owned`);
    returns the foreign entries left."""
    root = Path(root)
    if Owned(root).in_tree(sub) and not (root / sub).is_symlink():
        shutil.rmtree(root / sub, ignore_errors=True)
        if not (root / sub).exists():
            _append(root, [f"- {sub}\n"])
            return []
    return remove_owned(root, sub)
