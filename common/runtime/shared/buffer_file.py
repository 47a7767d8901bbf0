"""Reading a saved replay buffer (a checkpoint's buffer.pt, `ReplayBuffer.save`) without trusting it:
torch.load with weights_only=True (a planted pickle is refused, never run), then every number and
column checked against the format and the run's sizes before the ring is allocated from them (a
capacity of 10^12 would otherwise reach the allocator). Runs in the trainer process, for
`ReplayBuffer.load` (common/runtime/shared/buffer.py), which owns the format's columns.
"""
from __future__ import annotations

import os
import pickle
import re

import torch

from common.contracts.errors import UserError

_INT32_MAX = 2**31 - 1


class BufferFileError(UserError, ValueError):
    """A saved buffer that is damaged, not one `ReplayBuffer.save` wrote, or sized otherwise than
    the run that loads it (the message names the file, and the sizes with their numbers)."""


def _first_line(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"


def read_buffer_file(path, fmt: str, columns: dict, capacity: int | None = None,
                     max_seq_len: int | None = None) -> dict:
    """The saved state at `path` (format `fmt`, `columns`: name -> (per-token?, dtype, ...)), each
    column checked; `capacity` and `max_seq_len` (the run's; None: any) must be the saved ones."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ReplayBuffer.load: no such file {path!r}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a global, and torch names it
        glob = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"the disallowed global {glob[1]}" if glob else "objects that are not plain data"
        raise BufferFileError(f"{path}: not a replay buffer this project wrote: it references {what}, so it was "
                              f"not read: unpickling it could run code; restore the checkpoint from a trusted "
                              f"copy") from None
    except Exception as e:  # truncated, overwritten, not a torch file: torch raises many kinds
        raise BufferFileError(f"{path}: damaged replay buffer, not readable ({_first_line(e)}); restore the "
                              f"checkpoint from a copy, or resume from an earlier one") from None
    if not isinstance(state, dict) or state.get("format") != fmt:
        raise BufferFileError(f"{path}: not a replay buffer this project wrote (it lacks the format mark {fmt!r})")
    sizes = {k: state.get(k) for k in ("capacity", "max_seq_len", "pad_id", "n_added")}
    if not all(type(v) is int for v in sizes.values()) or not isinstance(state.get("cols"), dict):
        raise BufferFileError(f"{path}: damaged replay buffer: its sizes {sizes} are not all integers, or it holds "
                              f"no columns")
    C, L = sizes["capacity"], sizes["max_seq_len"]
    if C < 1 or L < 1 or sizes["n_added"] < 0 or not 0 <= sizes["pad_id"] <= _INT32_MAX:
        raise BufferFileError(f"{path}: damaged replay buffer: capacity {C}, max_seq_len {L}, n_added "
                              f"{sizes['n_added']}, pad_id {sizes['pad_id']} (out of range)")
    if (capacity is not None and C != capacity) or (max_seq_len is not None and L != max_seq_len):
        want_c, want_l = capacity if capacity is not None else C, max_seq_len if max_seq_len is not None else L
        raise BufferFileError(f"{path}: the saved replay buffer is {C:,} rows x {L:,} tokens, this run's is {want_c:,} "
                              f"rows (--train.buffer_capacity) x {want_l:,} tokens (the longest prompt + "
                              f"--gen.max_new_tokens), so it was not loaded; resume with the settings the checkpoint "
                              f"was written with (its config.json)")
    for k, (per_tok, dtype, _) in columns.items():
        col, shape = state["cols"].get(k), (C, L) if per_tok else (C,)
        if not torch.is_tensor(col) or tuple(col.shape) != shape or col.dtype != dtype:
            have = f"{tuple(col.shape)} {col.dtype}" if torch.is_tensor(col) else type(col).__name__
            raise BufferFileError(f"{path}: damaged replay buffer: its column {k!r} is {have}, its sizes make it "
                                  f"{shape} {dtype}")
        if not col.is_contiguous() or col.untyped_storage().nbytes() < col.numel() * col.element_size():
            # what `save` writes is whole: a view that claims more than its data (a stride of 0) is not
            raise BufferFileError(f"{path}: damaged replay buffer: its column {k!r} claims {shape} but its data holds "
                                  f"{col.untyped_storage().nbytes():,} bytes")
    return state
