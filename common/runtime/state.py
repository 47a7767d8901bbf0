"""What a checkpoint holds besides its files' bookkeeping (which is `checkpoint.py`'s): the model and
optimizer state (its `state/` directory) and the process's RNG states.

Model and optimizer state go through torch.distributed.checkpoint (DCP): one file per trainer rank,
read back into any number of ranks (DCP reshards). One rank writes alone (no process group); the
trainer's N ranks (common/runtime/ranks/fsdp.py: `write_shards`) each call the same function with
their group at the same point. RNG states are plain tensors and numbers, so `torch.load(...,
weights_only=True)` reads them back. Runs in the trainer process (and in its ranks).
"""
from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


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


def write_state(d: Path, model, optimizer, group: dist.ProcessGroup | None = None) -> None:
    """Model and optimizer state into directory `d` (DCP, one file per rank). `group`: the
    process group of a sharded model's ranks, every one of which calls this at the same point."""
    fresh = not optimizer.state  # get_state_dict gives a fresh AdamW zero moments and step 1 ...
    msd, osd = get_state_dict(model, optimizer)
    with _one_process_ok():
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=d, **_dcp_ranks(group))
    if fresh:
        optimizer.state.clear()  # ... which would change its first update's bias correction


def read_state(d: Path, model, optimizer, stepped: bool, group: dist.ProcessGroup | None = None) -> None:
    """Load `write_state`'s files into the model and optimizer, in place, whatever number of
    ranks wrote them (DCP reshards). `group` as for `write_state`."""
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    with _one_process_ok():
        dcp.load(state, checkpoint_id=d, **_dcp_ranks(group))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
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
