"""Where a task's rows come from: a local folder, or a Hugging Face hub dataset (trainer process).

A task script names its splits and turns one row (a dict) into its example type; this file only
finds the rows. `source` is one of
  - a local folder with `<split>.jsonl` or `<split>.jsonl.gz` files (errors name file:line). The
    default is the repository's own copy, `data/<task>/` (data/README.md: what it is, its
    licence), or `$ASYNCRL_DATA_DIR/<task>` when that variable names a folder that exists;
  - a local folder written by the `datasets` library (`DatasetDict.save_to_disk`, or a
    `Dataset.save_to_disk` per split in `<folder>/<split>`);
  - a hub dataset id, `owner/name` (the task supplies the config name, e.g. openai/gsm8k
    "main"), loaded through `datasets.load_dataset`, only when asked for. Offline
    (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or the hub's host unreachable within a few
    seconds) it fails at once with a `DataSourceError` saying what to do instead, rather than
    after `datasets`' retries (~25 s); task scripts print that message as one line.
"""
from __future__ import annotations

import gzip
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse
from typing import Callable, Iterator, TypeVar

from common.contracts.errors import UserError

T = TypeVar("T")
REPO_DATA = Path(__file__).resolve().parent.parent / "data"  # the repository's copy (data/README.md)
_PROBE_S = 3.0  # how long the hub's host may take to accept a connection before we call it unreachable


class DataSourceError(UserError, RuntimeError):
    """The data source could not be read; the message says what was tried and the fix."""


class DataFileMissing(DataSourceError, FileNotFoundError):
    """A data file that does not exist (the message names it)."""


class DataFileError(DataSourceError, ValueError):
    """A data file that is empty or holds a malformed row (the message names file:line)."""


def default_data_dir(task: str) -> Path:
    """$ASYNCRL_DATA_DIR/<task> when that folder exists, else the repository's data/<task>."""
    env = os.environ.get("ASYNCRL_DATA_DIR")
    if env and (Path(env).expanduser() / task).is_dir():
        return Path(env).expanduser() / task
    return REPO_DATA / task


def jsonl_file(source: str | os.PathLike, split: str) -> Path | None:
    """`<source>/<split>.jsonl`, else `<split>.jsonl.gz`, whichever exists; None if neither."""
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (Path(source).expanduser() / name).is_file():
            return Path(source).expanduser() / name
    return None


def is_jsonl_folder(source: str | os.PathLike, split: str) -> bool:
    return jsonl_file(source, split) is not None


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used now (offline mode set, or its host refusing or
    not answering a connection within _PROBE_S), or None when it may be. Behind a proxy
    (HTTPS_PROXY / ALL_PROXY) no direct probe is made: the proxy decides."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if _truthy(var):
            return f"{var} is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=_PROBE_S).close()
    except OSError as e:
        return f"{host}:{port} cannot be reached ({type(e).__name__}: {e})"
    return None


def _saved_split(folder: Path, split: str):
    import datasets  # lazy: heavy (pyarrow), hub data only
    if (folder / "dataset_dict.json").is_file():
        dd = datasets.load_from_disk(str(folder))
        if split not in dd:
            raise DataSourceError(f"{folder}: no split {split!r} (has {list(dd)})")
        return dd[split]
    if (folder / split / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(folder / split))
    raise DataSourceError(f"{folder}: neither {split}.jsonl nor a `datasets` save_to_disk folder "
                          f"(dataset_dict.json, or {split}/dataset_info.json)")


def iter_rows(source: str, split: str, hub_config: str | None = None) -> Iterator[dict]:
    """Rows (dicts) of `split` from a `datasets` folder or a hub id (see the module docstring).
    Local `<split>.jsonl` folders are the task's to read; passing one here is an error."""
    folder = Path(source).expanduser()
    try:
        import datasets  # lazy: heavy (pyarrow), hub data only
    except ImportError:
        raise DataSourceError(f"reading {source!r} needs the `datasets` library (pip install datasets), "
                              f"or point the run at a local folder with {split}.jsonl") from None
    if folder.is_dir():
        yield from _saved_split(folder, split)
        return
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise DataSourceError(f"data source {source!r} is not a local folder (it does not exist) and not a "
                              f"hub id of the form owner/name")
    local = (f"use a local folder instead (--data.source=<folder with {split}.jsonl or {split}.jsonl.gz>; the "
             f"default is the repository's copy in {REPO_DATA}), or one written by datasets' save_to_disk on a "
             f"machine with access")
    offline = hub_unreachable()
    if offline:
        raise DataSourceError(f"hub dataset {source!r} cannot be loaded: {offline}; {local}")
    try:
        ds = datasets.load_dataset(source, hub_config, split=split)
    except Exception as e:  # connection errors, unknown id, missing split: all end here
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataSourceError(f"could not load hub dataset {source!r} (config {hub_config!r}, split {split!r}): "
                              f"{first}; {local}") from None
    yield from ds


def read_jsonl(path: str | os.PathLike, make: Callable[[dict, str], T], limit: int | None = None,
               hint: str = "") -> list[T]:
    """`make(row, where)` for each non-empty line of a JSONL file (where = "file:line", for
    the errors `make` raises); a missing or empty file, or a malformed line, is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataFileMissing(f"data file not found: {path}" + (f" ({hint})" if hint else ""))
    out: list[T] = []
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFileError(f"{path}:{lineno}: malformed JSON ({e.msg}): one JSON object per line") from None
            out.append(_made(make, row, f"{path}:{lineno}"))
    if not out and limit != 0:
        raise DataFileError(f"{path} holds no rows (an empty file): one JSON object per line, or point "
                            f"--data.source at another folder")
    return out


def _made(make: Callable[[dict, str], T], row, where: str) -> T:
    """make(row, where), its ValueError (a row the task cannot use, named by `where`) a DataFileError."""
    try:
        return make(row, where)
    except UserError:
        raise
    except (ValueError, KeyError) as e:
        msg = str(e) if where in str(e) else f"{where}: {e}"
        raise DataFileError(msg) from e


def load_examples(source: str, split: str, make: Callable[[dict, str], T], limit: int | None = None,
                  hub_config: str | None = None) -> list[T]:
    """`split` of `source` (a folder with <split>.jsonl[.gz], a `datasets` folder or a hub id) as
    examples: `make(row, where)` turns one row into the task's example type, or raises naming
    `where`."""
    if is_jsonl_folder(source, split):
        return read_jsonl(jsonl_file(source, split), make, limit)
    out: list[T] = []
    for i, row in enumerate(iter_rows(source, split, hub_config)):
        if limit is not None and len(out) >= limit:
            break
        out.append(_made(make, dict(row), f"{source} [{split}] row {i}"))
    if not out and limit != 0:
        raise DataFileError(f"split {split!r} of {source} holds no rows: give a source with data")
    return out
