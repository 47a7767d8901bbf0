"""Resumable training checkpoints: model (HF format), model and optimizer state (sharded),
scheduler, RNG, counters, replay buffer, run config. Written and read by the trainer: rank 0
(the launching process) writes everything but the other ranks' shards, which each rank writes
itself when rank 0 tells it to (`write` / `read`, common/runtime/ranks/group.py). The model and
optimizer state and the RNG states are `state.py`'s; this module is the directory around them.

Layout (one directory per checkpoint, named by the trainer step):

    <run_dir>/checkpoints/step_000120/
        model/             a complete Hugging Face model directory (common/engine/checkpoints/hf_save.py): config,
                           generation config, weights, tokenizer + chat template when given
        adapter/           LoRA (train.lora): PEFT's adapter files (common/engine/checkpoints/peft_io.py) and
                           the base's config; model/ then only with train.lora.export=merged|both
        state/             fp32 model and AdamW state (LoRA: the adapters'), one file per trainer rank
                           (torch.distributed.checkpoint); loads into any number of ranks, 1 included
        trainer_state.pt   scheduler state, RNG states (rank 0's), counters
        buffer.pt          ReplayBuffer.save (optional)
        config.json        the resolved run config (optional)
        meta.json          step, version, wall time, file list with sizes; written LAST

state/ holds the model again beside model/ (the export): resuming reads the exact fp32 shards,
whatever N wrote them, and a large model is never gathered to read it back.

Crash-safety rules:
- Everything is written into `checkpoints/.tmp_step_XXXXXX`, fsynced, and only then renamed to
  `step_XXXXXX` (rename is atomic on POSIX). A crash mid-write leaves at most a `.tmp_*` dir,
  which `latest_checkpoint` ignores and the next start or save deletes; the last good checkpoint
  is never touched before the new one is complete. A write that fails for any reason (disk full, quota,
  DCP's CheckpointException, a serializer's RuntimeError) removes its partial copy and raises
  `CheckpointError`: the cause, the path, the free space, the intact previous checkpoint (a
  Ctrl-C removes it too and goes on); a warning comes first when the last checkpoint's size
  is not free. Reading is `state.py`'s allow-listed unpickling, torch.load(weights_only=True), JSON;
  the buffer's sizes are checked against the run's before a ring is allocated from them.
- A checkpoint counts only if its meta.json parses; `load_checkpoint` additionally checks every
  listed file exists with its recorded size (catches truncation) and validates everything
  (architecture, tensor names/shapes, optimizer groups) BEFORE mutating the model or optimizer.
- Pruning (`keep_last`) runs after the rename and never deletes the checkpoint just written.
  Removing a checkpoint (pruned, replaced, a leftover) deletes only what the project wrote in it
  (meta.json's files, meta.json last; a leftover's from the run folder's manifest), and a prune cut
  off is finished at the next start (common/runtime/files/checkpoint_dir.py).
- Several ranks: every rank writes its shards into the same `.tmp_*` directory, rank 0 alone
  writes the rest, fsyncs every file (one node, one filesystem) and renames; loading checks the
  saved tensor names and shapes against the model before any rank loads.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from common.contracts.config import save_config
from common.contracts.errors import disk_full, free_bytes, human_bytes, write_failed
from common.engine.checkpoints.hf_save import model_config_dict, save_pretrained
from common.engine.checkpoints.peft_io import save_adapter
from common.engine.model.lora import adapters, merged
from common.engine.model.model_config import ModelConfig
from common.contracts.run_files import record
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.shared.buffer_file import BufferFileError
from common.runtime.files.checkpoint_dir import (FORMAT_VERSION, PREFIX, TMP, begin, ckpt_root, fsync, latest_checkpoint,
                                           prune, published, read_meta, remove_checkpoint)
from common.runtime.files.state import (CheckpointError, check_state, one_line, read_state, rng_state, set_rng_state,
                                  write_state)

__all__ = ["CheckpointError", "ResumeState", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

@dataclass
class ResumeState:
    step: int
    version: int
    counters: dict = field(default_factory=dict)  # step, version and the caller's extra counters
    buffer: Any = None                            # a ReplayBuffer when one was saved
    config: dict | None = None                    # the saved run config (plain JSON dict)
    path: Path | None = None                      # the checkpoint directory it came from


# ---------------------------------------------------------------- save
def _file_sizes(d: Path) -> dict[str, int]:
    return {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*")) if f.is_file()}


def _write_meta(d: Path, meta: dict) -> None:
    (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


BASE_CONFIG = "base_config.json"  # in adapter/: the base model's config (module docstring)


def _export(model, tmp: Path, tokenizer, generation, config) -> None:
    """The checkpoint's model for users: model/, a complete Hugging Face directory; with LoRA
    (train.lora.export) adapter/, PEFT's files that `peft` loads onto the base, model/ the base with
    the adapters merged, or both."""
    if not adapters(model):
        save_pretrained(model, tmp / "model", tokenizer=tokenizer, **(generation or {}))
        return
    export = _setting(config, "train", "lora", "export") or "adapter"
    if export in ("adapter", "both"):
        save_adapter(model, tmp / "adapter", base_model=str(_setting(config, "model") or ""),
                     dropout=_setting(config, "train", "lora", "dropout") or 0.0)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "adapter"))
        # the base's config, which a resume checks (not config.json: transformers would take the folder for a model)
        (tmp / "adapter" / BASE_CONFIG).write_text(json.dumps(model_config_dict(model), indent=2) + "\n")
    if export in ("merged", "both"):
        with merged(model):
            save_pretrained(model, tmp / "model", tokenizer=tokenizer, **(generation or {}))


def _setting(config, *keys):
    """config.a.b (a dataclass) or config["a"]["b"] (a dict), else None."""
    for k in keys:
        config = config.get(k) if isinstance(config, dict) else getattr(config, k, None)
        if config is None:
            return None
    return config


def _write_into(tmp: Path, model, optimizer, scheduler, counters, config, buffer, tokenizer, generation,
                step: int, write) -> None:
    """Every file of one checkpoint into `tmp` (meta.json last), fsynced."""
    begin(tmp)
    stepped = bool(optimizer.state)
    if write is None:  # one rank: its state, and the model itself is whole for the export
        write_state(tmp / "state", model, optimizer)
        export = model
    else:  # the trainer's ranks: every rank writes its shards, the whole model is gathered for the export
        export = write(tmp / "state")
    _export(export, tmp, tokenizer, generation, config)
    torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_state(), "counters": counters, "optimizer_stepped": stepped}, tmp / "trainer_state.pt")
    if buffer is not None:
        buffer.save(tmp / "buffer.pt")
    if config is not None:
        if isinstance(config, dict):
            (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        else:
            save_config(config, tmp / "config.json")
    meta = {"format_version": FORMAT_VERSION, "step": step, "version": counters["version"],
            "counters": counters, "wall_time": time.time(),
            "wall_time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _file_sizes(tmp)}
    _write_meta(tmp, meta)
    for f in tmp.rglob("*"):  # data on disk before the rename publishes it (power-loss safety)
        if f.is_file():
            fsync(f)


def _warn_if_low(run_dir, root: Path, step: int) -> None:
    """One line on stderr when the free space is below the last checkpoint's size (+10%): the
    write ahead will likely fail (it is made before the oldest is pruned)."""
    prev = latest_checkpoint(run_dir)
    free = free_bytes(root)
    if prev is None or free is None:
        return
    need = sum(read_meta(prev)["files"].values())
    if free < need * 1.1:
        print(f"[asyncrl] warning: checkpoint step {step} needs about {human_bytes(need)} (the last one's size) "
              f"and {human_bytes(free)} is free in {root}: it will likely fail; free some space or lower "
              f"train.keep_checkpoints", file=sys.stderr)


def _write_error(run_dir, step: int, tmp: Path, final: Path, e: BaseException) -> CheckpointError:
    """A failed write as one line: what failed, where, the free space left once the partial copy
    is removed (which frees what it took), and the checkpoint that is still intact. Whether the disk
    filled is asked first: removing the partial copy frees space."""
    full = disk_full(e, tmp)
    remove_checkpoint(tmp)
    removed = "its partial copy was removed" if not tmp.exists() else f"its partial copy {tmp} could not be removed"
    prev = latest_checkpoint(run_dir)
    kept = (f"the previous checkpoint {prev} is intact (free some space, then --resume continues from it)"
            if prev is not None else "there is no earlier checkpoint")
    return CheckpointError(f"{write_failed(f'checkpoint step {step} to', final, one_line(e), full)}; {removed}; "
                           f"nothing was replaced: {kept}")


def save_checkpoint(run_dir, step: int, model, optimizer, scheduler=None, *, counters: dict | None = None,
                    config=None, buffer: ReplayBuffer | None = None, tokenizer=None,
                    generation: dict | None = None, keep_last: int | None = 2,
                    write: Callable[[Path], Any] | None = None) -> Path:
    """Write checkpoint `step` atomically; prune to the newest `keep_last` (None/<=0: keep all).
    `generation` = {"stop_token_ids": ..., "sampling": {"temperature", "top_p", "top_k"}} goes
    into model/generation_config.json (`common/engine/checkpoints/hf_save.py`). Sharded (N ranks): rank 0
    calls this with `write(state_dir)`, which has every rank write its shards and returns the
    whole model to export (common/runtime/ranks/group.py)."""
    step = int(step)
    counters = dict(counters or {})
    bad = [k for k, v in counters.items() if isinstance(v, bool) or not isinstance(v, (int, float, np.number))]
    if bad:
        raise TypeError(f"save_checkpoint: counters {bad} must be numbers")
    counters = {k: (float(v) if isinstance(v, (float, np.floating)) else int(v)) for k, v in counters.items()}
    counters.update(step=step, version=int(counters.get("version", 0)))
    root = ckpt_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    record(root)
    for p in root.glob(TMP + "*"):  # leftovers of crashed writes (the project's: common/runtime/files/checkpoint_dir.py)
        remove_checkpoint(p)
    name = f"{PREFIX}{step:06d}"
    tmp, final = root / (TMP + name), root / name

    _warn_if_low(run_dir, root, step)
    try:
        _write_into(tmp, model, optimizer, scheduler, counters, config, buffer, tokenizer, generation, step, write)
    except (KeyboardInterrupt, SystemExit):  # stopping: no partial copy left behind, the stop goes on
        remove_checkpoint(tmp)
        raise
    except BaseException as e:  # disk full, quota, I/O error; DCP's CheckpointException is a BaseException
        raise _write_error(run_dir, step, tmp, final, e) from e

    if final.exists():  # re-saving a step (e.g. after a resume): swap, old one goes last
        old = root / (TMP + "replaced_" + name)
        os.rename(final, old)
        os.rename(tmp, final)
        remove_checkpoint(old, as_of=final)  # recorded under final's name
    else:
        os.rename(tmp, final)
    fsync(root)  # persist the rename itself
    published(tmp, final)
    prune(run_dir, keep_last, keep=final)
    return final


# ---------------------------------------------------------------- load
def load_checkpoint(path, model, optimizer, scheduler=None, buffer_cls=ReplayBuffer,
                    read: Callable[[Path, bool], None] | None = None,
                    buffer_size: tuple[int, int] | None = None) -> ResumeState:
    """Restore model weights and optimizer state (in place, so the optimizer keeps its
    parameters), scheduler and RNG states from checkpoint dir `path`; returns counters, buffer
    and config. Sharded (N ranks): rank 0 calls this with `read(state_dir, stepped)`, which has
    every rank load its shards, after every check passed (common/runtime/ranks/group.py).
    `buffer_size`: the run's (capacity, max_seq_len), which a saved buffer must have (None: any)."""
    path = Path(path)
    meta = read_meta(path)
    for rel, size in meta["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: file {rel} listed in meta.json is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: file {rel} has {f.stat().st_size} bytes, meta.json recorded "
                                  f"{size} (truncated or overwritten)")
    conf = path / "model" / "config.json"
    if not conf.is_file() and (path / "adapter" / BASE_CONFIG).is_file():  # LoRA: the adapters alone
        conf = path / "adapter" / BASE_CONFIG
    try:
        ck_cfg = ModelConfig.from_hf(json.loads(conf.read_text())).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{conf} unreadable ({type(e).__name__}: {e})") from None
    mine = model.cfg.to_dict()
    diff = [f"{k}: checkpoint {ck_cfg.get(k)!r} vs model {mine.get(k)!r}"
            for k in sorted(set(ck_cfg) | set(mine)) if ck_cfg.get(k) != mine.get(k)]
    if diff:
        raise CheckpointError(f"incompatible checkpoint {path}: " + "; ".join(diff))
    try:
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}/trainer_state.pt unreadable ({type(e).__name__}: {e})") from None
    if scheduler is not None and state.get("scheduler") is None:
        raise CheckpointError(f"{path}: a scheduler was given but the checkpoint saved none")
    stepped = bool(state.get("optimizer_stepped", True))
    check_state(path / "state", model, stepped)
    try:  # read and checked before its sizes allocate anything (buffer_file.py), and before anything mutates
        buffer = buffer_cls.load(path / "buffer.pt", *(buffer_size or ())) if "buffer.pt" in meta["files"] else None
    except BufferFileError as e:
        raise CheckpointError(str(e)) from None

    # Everything validated: now mutate (every rank at once when sharded).
    try:
        if read is None:
            read_state(path / "state", model, optimizer, stepped)
        else:
            read(path / "state", stepped)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"incompatible checkpoint {path}: model/optimizer state ({e})") from None
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])

    config = json.loads((path / "config.json").read_text()) if "config.json" in meta["files"] else None
    counters = dict(state["counters"])
    return ResumeState(step=int(counters["step"]), version=int(counters["version"]), counters=counters,
                       buffer=buffer, config=config, path=path)
