"""What a checkpoint holds besides its files' bookkeeping (which is `checkpoint.py`'s): the model and
optimizer state (its `state/` directory) and the process's RNG states; and `CheckpointError`,
which every reader of a checkpoint raises (re-exported by `checkpoint.py`).

Model and optimizer state go through torch.distributed.checkpoint (DCP): one file per trainer rank,
read back into any number of ranks (DCP reshards). One rank writes alone (no process group); the
trainer's N ranks (common/runtime/ranks/fsdp.py: `write_shards`) each call the same function with
their group at the same point. RNG states are plain tensors and numbers, so `torch.load(...,
weights_only=True)` reads them back. Runs in the trainer process (and in its ranks).

Read without running code: DCP's own reader unpickles `state/.metadata` with plain `pickle.load`,
and its planner the non-tensor entries (the optimizer's param_groups) with `torch.load(...,
weights_only=False)`; a planted file would run its code on `--resume`. `SafeReader` unpickles the
metadata through an allow-list of the classes DCP's metadata holds (`_ALLOWED`: what the files
this project writes reference, listed with pickletools), `_SafePlanner` loads those entries with
weights_only=True; anything else is refused with a `CheckpointError` naming the file and the global.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import random
import re
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from common.contracts.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, corrupt, truncated, incompatible with the running model, not
    one this project wrote, or one that could not be written (the message says which)."""


_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}  # StorageMeta.checkpoint_id
_ALLOWED = {  # module -> names a DCP .metadata may reference (torch dtypes: any, see _allowed)
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "torch": {"Size"},
    "pathlib": _PATHS, "pathlib._local": _PATHS,  # Python 3.13 moved the classes
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    "collections": {"OrderedDict"},
}


def _allowed(module: str, name: str) -> bool:
    if name in _ALLOWED.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _Disallowed(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only `_ALLOWED` globals: the only way a pickle runs code
    is through a global it names (a callable it reduces with), so nothing else can run."""

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise _Disallowed(f"{module}.{name}")
        return super().find_class(module, name)


def _unpickle_metadata(f, path) -> Metadata:
    try:
        md = _MetadataUnpickler(f).load()
    except _Disallowed as e:
        raise CheckpointError(f"{path}: not a checkpoint this project wrote: it references the disallowed "
                              f"global {e} (DCP metadata never does), so it was not read: unpickling it could "
                              f"run code; restore the checkpoint from a trusted copy") from None
    except Exception as e:  # truncated, garbage: pickle raises many kinds
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: not a checkpoint this project wrote (holds a {type(md).__name__}, "
                              f"not DCP metadata)")
    return md


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader, its `.metadata` unpickled through the allow-list (module doc);
    otherwise torch's `FileSystemReader.read_metadata`, step for step (tensors it already loads
    with weights_only=True)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _unpickle_metadata(f, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, its non-tensor entries loaded with weights_only=True (plain data only)."""

    def __init__(self, d: Path):
        super().__init__()
        self.dir = d  # named in the error

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)  # refuses anything but plain data
        except pickle.UnpicklingError as e:
            glob = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the global it refused
            why = f"references the disallowed global {glob[1]}" if glob else f"is not plain data ({one_line(e)})"
            raise CheckpointError(f"{self.dir}: not a checkpoint this project wrote: its entry "
                                  f"{read_item.dest_index.fqn} {why}, so it was not read: unpickling it could run "
                                  f"code; restore the checkpoint from a trusted copy") from None
        # handed on re-serialised: the parent's torch.load(weights_only=False) now reads only plain data,
        # and where it puts the value (flattened keys) stays torch's
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


def one_line(e: BaseException) -> str:
    """An error in one line: DCP's CheckpointException (every rank's traceback) as its first
    rank's own error."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (exc, _) = min(e.failures.items(), key=lambda kv: kv[0])
        return f"{one_line(exc)} on trainer rank {rank}"
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"


def dcp_cause(e: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (its lowest rank's), else `e` itself."""
    while isinstance(e, CheckpointException) and e.failures:
        e = min(e.failures.items(), key=lambda kv: kv[0])[1][0]
    return e


@contextlib.contextmanager
def _one_process_ok():
    """DCP warns whenever it runs without a process group; one trainer rank is meant to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _dcp_ranks(group: dist.ProcessGroup | None) -> dict:
    """DCP's arguments: a sharded model meets the trainer's other ranks in its own group; one rank
    writes alone."""
    return {"no_dist": False, "process_group": group} if group is not None else {"no_dist": True}


def _options(model) -> StateDictOptions:
    """What a checkpoint holds of `model`: every parameter, or (LoRA: a frozen base) the trainable
    ones only; the base is the run's `--model`, read again at a resume."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)  # the base is not in the state


def check_state(d: Path, model, stepped: bool) -> None:
    """The saved tensor names and shapes against the model's, before anything is loaded."""
    try:
        saved = SafeReader(str(d)).read_metadata().state_dict_metadata
    except CheckpointError:
        raise
    except Exception as e:  # missing .metadata
        raise CheckpointError(f"{d}: unreadable model/optimizer state ({type(e).__name__}: {e})") from None
    want = {f"model.{k}": tuple(v.shape) for k, v in get_model_state_dict(model, options=_options(model)).items()}
    have = {k: tuple(v.size) for k, v in saved.items() if k.startswith("model.") and hasattr(v, "size")}
    bad = ([f"missing {k[6:]}" for k in want if k not in have] + [f"unexpected {k[6:]}" for k in have if k not in want]
           + [f"{k[6:]}: saved {have[k]}, model {s}" for k, s in want.items() if k in have and have[k] != s])
    if stepped:
        # keyed by parameter, not state-dict entry: a tied head has no state of its own
        bad += [f"no optimizer state for {n}" for n, p in model.named_parameters()
                if p.requires_grad and f"optimizer.state.{n}.exp_avg" not in saved]
    if bad:
        raise CheckpointError(f"incompatible checkpoint {d.parent}: " + "; ".join(bad[:5]))


def write_state(d: Path, model, optimizer, group: dist.ProcessGroup | None = None) -> None:
    """Model and optimizer state into directory `d` (DCP, one file per rank). `group`: the
    process group of a sharded model's ranks, every one of which calls this at the same point."""
    fresh = not optimizer.state  # get_state_dict gives a fresh AdamW zero moments and step 1 ...
    msd, osd = get_state_dict(model, optimizer, options=_options(model))
    with _one_process_ok():
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=d, **_dcp_ranks(group))
    if fresh:
        optimizer.state.clear()  # ... which would change its first update's bias correction


def read_state(d: Path, model, optimizer, stepped: bool, group: dist.ProcessGroup | None = None) -> None:
    """Load `write_state`'s files into the model and optimizer, in place, whatever number of
    ranks wrote them (DCP reshards), through `SafeReader` and `_SafePlanner`. `group` as for
    `write_state`."""
    SafeReader(str(d)).read_metadata()  # a refused .metadata says so here, not inside DCP's fallbacks
    opts = _options(model)
    msd, osd = get_state_dict(model, optimizer, options=opts)
    state = {"model": msd, "optimizer": osd}
    try:
        with _one_process_ok():
            dcp.load(state, storage_reader=SafeReader(str(d)), planner=_SafePlanner(d), **_dcp_ranks(group))
    except CheckpointException as e:  # a BaseException: said as the error behind it
        if isinstance(dcp_cause(e), CheckpointError):
            raise dcp_cause(e) from None
        raise CheckpointError(f"{d}: unreadable model/optimizer state ({one_line(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=opts)
    if not stepped:  # saved before the first update: keep the optimizer fresh (see write_state)
        optimizer.state.clear()


def rng_state() -> dict:
    """Python's, numpy's, torch's (and CUDA's) RNG states, weights_only-loadable."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(s: dict) -> None:
    """Restore `rng_state()`'s states (CUDA's only on a machine with as many GPUs)."""
    v, internal, gauss = s["python"]  # lists after torch.load; random.setstate wants tuples
    random.setstate((v, tuple(internal), gauss))
    n = s["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])
