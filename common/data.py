"""Where a task's rows come from: a local folder, or a Hugging Face hub dataset (trainer process).

A task script names its splits and turns one row (a dict) into its example type; this file only
finds the rows. `source` is one of
  - a local folder with `<split>.jsonl` files (the offline default; errors name file:line),
  - a local folder written by the `datasets` library (`DatasetDict.save_to_disk`, or a
    `Dataset.save_to_disk` per split in `<folder>/<split>`),
  - a hub dataset id, `owner/name` (the task supplies the config name, e.g. openai/gsm8k
    "main"), loaded through `datasets.load_dataset` when the hub is reachable. Offline, or
    without `datasets` installed, the error says what to do instead.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class DataSourceError(RuntimeError):
    """The data source could not be read; the message says what was tried and the fix."""


def default_data_dir(task: str) -> Path | None:
    """First existing of $ASYNCRL_DATA_DIR/<task>, <repo>/../shared/data/<task>, <repo>/data/<task>."""
    repo = Path(__file__).resolve().parent.parent
    candidates = [Path(os.environ["ASYNCRL_DATA_DIR"]) / task] if os.environ.get("ASYNCRL_DATA_DIR") else []
    candidates += [repo.parent / "shared" / "data" / task, repo / "data" / task]
    return next((c for c in candidates if c.is_dir()), None)


def is_jsonl_folder(source: str | os.PathLike, split: str) -> bool:
    return (Path(source) / f"{split}.jsonl").is_file()


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
    try:
        ds = datasets.load_dataset(source, hub_config, split=split)
    except Exception as e:  # offline (connection errors), unknown id, missing split: all end here
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataSourceError(
            f"could not load hub dataset {source!r} (config {hub_config!r}, split {split!r}): {first}. "
            f"Offline or behind a firewall? Use a local folder instead: one with {split}.jsonl, or one "
            f"written by datasets' save_to_disk on a machine with access (HF_HUB_OFFLINE=1 makes the "
            f"failure immediate)") from e
    yield from ds


def read_jsonl(path: str | os.PathLike, make: Callable[[dict, str], T], limit: int | None = None,
               hint: str = "") -> list[T]:
    """`make(row, where)` for each non-empty line of a JSONL file (where = "file:line", for
    the errors `make` raises); a missing file or malformed line is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}" + (f" ({hint})" if hint else ""))
    out: list[T] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            out.append(make(row, f"{path}:{lineno}"))
    return out


def load_examples(source: str, split: str, make: Callable[[dict, str], T], limit: int | None = None,
                  hub_config: str | None = None) -> list[T]:
    """`split` of `source` (a folder with <split>.jsonl, a `datasets` folder or a hub id) as
    examples: `make(row, where)` turns one row into the task's example type, or raises naming
    `where`."""
    if is_jsonl_folder(source, split):
        return read_jsonl(Path(source) / f"{split}.jsonl", make, limit)
    out: list[T] = []
    for i, row in enumerate(iter_rows(source, split, hub_config)):
        if limit is not None and len(out) >= limit:
            break
        out.append(make(dict(row), f"{source} [{split}] row {i}"))
    return out
