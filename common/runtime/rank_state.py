"""The model and optimizer state of a checkpoint (its `state/` directory): written and read through
torch.distributed.checkpoint (DCP) by every trainer rank at the same point (rank 0 from
`checkpoint.py`, the others on rank 0's command, `trainer_rank.py`), one file per rank, and read
back into any number of ranks (DCP reshards). The rest of a checkpoint is `checkpoint.py`'s.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from common.runtime.ranks.fsdp import full_model, group_of


@contextlib.contextmanager
def _one_process_ok():
    """DCP warns whenever it runs without a process group; one trainer rank is meant to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _dcp_ranks(model) -> dict:
    """DCP's arguments for `model`: a sharded model meets the trainer's other ranks in its own
    group; an unsharded trainer is one rank that writes alone."""
    return {"no_dist": False, "process_group": group_of(model)} if isinstance(model, FSDPModule) else {"no_dist": True}


def write_state(d: Path, model, optimizer):
    """Model and optimizer state into directory `d` (DCP, one file per rank), then the whole
    model as a plain module for the export (`common/runtime/ranks/fsdp.py: full_model`: rank 0 gets
    it, other ranks None). Sharded, every rank calls this at the same point."""
    fresh = not optimizer.state  # get_state_dict gives a fresh AdamW zero moments and step 1 ...
    msd, osd = get_state_dict(model, optimizer)
    with _one_process_ok():
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=d, **_dcp_ranks(model))
    if fresh:
        optimizer.state.clear()  # ... which would change its first update's bias correction
    return full_model(model)


def read_state(d: Path, model, optimizer, stepped: bool) -> None:
    """Load `write_state`'s files into the model and optimizer, in place, whatever number of
    ranks wrote them (DCP reshards). Sharded, every rank calls this at the same point."""
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    with _one_process_ok():
        dcp.load(state, checkpoint_id=d, **_dcp_ranks(model))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if not stepped:  # saved before the first update: keep the optimizer fresh (see write_state)
        optimizer.state.clear()
