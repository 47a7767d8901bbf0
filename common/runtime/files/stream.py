"""The trajectory stream: every batch the trainer consumed, in order, on disk (record), and
read back for replay (`common/replay.py`). Written by the trainer (rank 0, the
launching process) when `train.record` is on; read anywhere, also while the run goes on.

Layout of `runs/<name>/stream/`:

    stream.json                 format, the run's resolved config and precision, the policy it
                                started from (path + fingerprint of its fp32 weights), the stop
                                tokens / sampling settings, and one entry per start or resume
                                (its first step, time, and the trainer's CPU threads)
    step_000001.safetensors     the batch of trainer step 1, and so on: one file per step
    discarded/<time>/           steps a resume threw away (trained after the checkpoint it
                                resumed from, so no longer part of the model's history)

A step file holds every `Batch` field (`tokens`, `loss_mask`, `behav_logp`, `versions`,
`reward`, `group_id`, `prompt_lens`, `comp_lens`, `ref_seq_logp`) and every `extra` tensor as
`extra.<key>` (`extra.finish`: index into `common.contracts.batch.FINISH_REASONS`), exactly as the
algorithm's `next_batch` returned them (integers stored as int32 where they fit, widened back on
reading); its safetensors metadata holds the step (1-based: the step this batch made), the
version the weights had, the learning rate, and the stats the algorithm returned.

Crash safety: a step file is written to a temporary name and renamed (atomic), so a reader
sees whole steps only, and a crash leaves the stream whole up to the last completed step. A write
that fails (disk full) removes its temporary file and stops the run with a `WriteError` naming the
file and the free space; the stream stays whole up to the step before.
Before every checkpoint the files written since the last one are fsynced, so a checkpoint
never claims steps its stream lacks. `--resume` from checkpoint S moves steps > S to
`discarded/` and continues at S + 1.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.contracts.batch import FINISH_REASONS, Batch
from common.contracts.config import to_dict
from common.contracts.errors import UserError, WriteError, write_failed
from common.contracts.run_files import forget, record, recorded

FORMAT = "asyncrl.stream/v1"
_PREFIX, _SUFFIX = "step_", ".safetensors"
_FIELDS = ("tokens", "loss_mask", "behav_logp", "versions", "reward", "group_id", "prompt_lens", "comp_lens",
           "ref_seq_logp")
_I32 = torch.iinfo(torch.int32)


class StreamError(UserError, ValueError):
    """A stream that is missing, corrupt, has a gap, or does not fit the model or run."""


def step_file(d: Path, step: int) -> Path:
    """Where step `step` (1-based) of stream directory `d` lives."""
    return Path(d) / f"{_PREFIX}{step:06d}{_SUFFIX}"


def _step_of(p: Path) -> int | None:
    if not (p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX)):
        return None
    try:
        return int(p.name[len(_PREFIX):-len(_SUFFIX)])
    except ValueError:
        return None


def step_files(d) -> list[tuple[int, Path]]:
    """(step, file) of every complete step file, by step."""
    d = Path(d)
    return sorted((s, p) for p in d.iterdir() if (s := _step_of(p)) is not None) if d.is_dir() else []


@torch.no_grad()
def fingerprint(model) -> str:
    """sha256 of the named fp32 parameters (names, shapes and bytes): which weights a stream starts from."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def encode(batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The batch as safetensors-ready tensors (new, contiguous CPU tensors: later in-place changes
    to the batch do not reach them) and the dtypes to restore."""
    items = [(k, getattr(batch, k)) for k in _FIELDS] + [(f"extra.{k}", v) for k, v in batch.extra.items()]
    out, dtypes = {}, {}
    for k, v in items:
        if not torch.is_tensor(v):
            raise TypeError(f"record: batch field {k!r} is a {type(v).__name__}, not a tensor")
        v = v.detach().to("cpu")
        dtypes[k] = str(v.dtype).removeprefix("torch.")
        if v.dtype == torch.int64 and (v.numel() == 0 or (v.min() >= _I32.min and v.max() <= _I32.max)):
            v = v.to(torch.int32)  # a copy, half the bytes
        else:
            v = v.clone()
        out[k] = v.contiguous()
    return out, dtypes


@dataclass
class StreamStep:
    """One recorded trainer step."""
    step: int          # 1-based: this batch made trainer step `step`
    version: int       # policy version of the weights it trained (staleness = version - batch.versions)
    lr: float          # learning rate of its updates
    stats: dict        # what the algorithm returned (loss, ...) and grad_norm
    batch: Batch       # as the algorithm's next_batch returned it
    nbytes: int        # size of its file

    @property
    def finish_reasons(self) -> list[str]:
        return [FINISH_REASONS[i] for i in self.batch.extra["finish"].tolist()] if "finish" in self.batch.extra else []


def decode(data: bytes, where: str) -> StreamStep:
    """A step file's bytes back into a `StreamStep` (original dtypes); `where` names it in errors."""
    try:
        tensors = st_load(data)
        meta = json.loads(_header(data)["__metadata__"]["asyncrl"])
        dtypes = meta["dtypes"]
        fields = {k: tensors[k].to(getattr(torch, dtypes[k])) for k in _FIELDS}
        extra = {k[6:]: tensors[k].to(getattr(torch, dtypes[k])) for k in tensors if k.startswith("extra.")}
        return StreamStep(int(meta["step"]), int(meta["version"]), float(meta["lr"]), dict(meta["stats"]),
                          Batch(**fields, extra=extra), len(data))
    except (SafetensorError, KeyError, ValueError, TypeError, AttributeError) as e:
        raise StreamError(f"{where}: corrupt step file ({type(e).__name__}: {e})") from None


def _header(data: bytes) -> dict:
    """The safetensors JSON header (an 8-byte little-endian length, then the JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])


def _write_file(final: Path, data: bytes, what: str, then: str) -> None:
    """`data` into `final` through a temporary name and a rename: a failure removes the temporary
    file (nothing half-written is left as if valid) and raises `WriteError`, its line ending in `then`."""
    tmp = final.parent / f".tmp_{final.name}"
    record(tmp, final)  # in a run folder: ours (common/contracts/run_files.py), the temporary too (a crash may leave it)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"{write_failed(what, final, e)}; its partial file was removed; {then}") from e


class StreamWriter:
    """The recording side (trainer rank 0): `open`, then `capture` before and `write` after every
    step, `sync` before every checkpoint."""

    def __init__(self, d: Path):
        self.dir, self._unsynced, self.steps = Path(d), [], 0
        self.bytes = self.written = 0  # by this process (since the start or resume)
        self._capture_s = 0.0

    def capture(self, batch: Batch):
        """The batch as drawn (`encode`), taken before the update can touch it."""
        t = time.perf_counter()
        out = encode(batch)
        self._capture_s = time.perf_counter() - t
        return out

    @classmethod
    def open(cls, d, cfg, precision: dict, model, checkpoint, generation: dict) -> "StreamWriter":
        """Start a stream (checkpoint None: a fresh run; `model` holds its initial weights), or
        continue it at the checkpoint's step (a resume): later steps move to discarded/."""
        w = cls(d)
        start = 0 if checkpoint is None else int(json.loads((Path(checkpoint) / "meta.json").read_text())["step"])
        w.dir.mkdir(parents=True, exist_ok=True)
        for p in w.dir.glob(".tmp_*"):  # a step file a crash left half-written (ours only: recorded when written)
            if recorded(p):
                p.unlink()
        have = step_files(w.dir)
        later = [p for s, p in have if s > start]
        if later:
            dest = w.dir / "discarded" / time.strftime("%Y%m%dT%H%M%S")
            dest.mkdir(parents=True, exist_ok=True)
            record(dest, *(dest / p.name for p in later))
            for p in later:
                os.replace(p, dest / p.name)
            forget(*later)
            print(f"[asyncrl] record: steps {_step_of(later[0])}..{_step_of(later[-1])} were trained after the "
                  f"checkpoint of step {start}; moved to {dest}")
        meta_path = w.dir / "stream.json"
        kept = [s for s, _ in have if s <= start]
        if start == 0:
            meta = {"format": FORMAT, "run": cfg.name, "model": cfg.model, "init_fingerprint": fingerprint(model),
                    "generation": generation, "segments": []}
        elif not meta_path.is_file() or kept != list(range(1, start + 1)):
            raise StreamError(f"train.record: resuming at step {start}, but {w.dir} does not hold steps 1..{start} "
                              f"(found {len(kept)}): a stream must start at step 1 to be replayable; resume without "
                              f"--train.record=true, or record a new run")
        else:
            meta = read_meta(w.dir)
        meta.update(config=to_dict(cfg), precision=precision)
        # the trainer's CPU threads: a replay reproduces the bits only with the same count (recorded_threads)
        meta["segments"].append({"start_step": start, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "threads": torch.get_num_threads()})
        _write_file(meta_path, (json.dumps(meta, indent=2, default=str) + "\n").encode(), "record stream file",
                    "the run did not start: free some space, or turn train.record off")
        w.steps = start
        return w

    def write(self, step: int, version: int, lr: float, encoded, stats: dict) -> dict:
        """Write trainer step `step` (1-based) from `capture(batch)`; returns the metrics
        record_bytes (the file's size) and record_s (seconds spent capturing and writing)."""
        t = time.perf_counter()
        if step != self.steps + 1:
            raise StreamError(f"record: step {step} after step {self.steps}")
        tensors, dtypes = encoded
        meta = {"step": step, "version": version, "lr": lr, "dtypes": dtypes,
                "stats": {k: float(v) for k, v in stats.items()}}
        data = st_save(tensors, metadata={"asyncrl": json.dumps(meta)})
        final = step_file(self.dir, step)
        held = f"steps 1..{self.steps}" if self.steps else "no step"
        _write_file(final, data, "record stream file", f"the stream holds {held}; the run stops: free some space, "
                    f"then --resume from the last checkpoint")
        self._unsynced.append(final)
        self.steps, self.bytes, self.written = step, self.bytes + len(data), self.written + 1
        return {"record_bytes": len(data), "record_s": self._capture_s + time.perf_counter() - t}

    def bytes_per_step(self) -> float:
        return self.bytes / max(1, self.written)

    def sync(self) -> None:
        """fsync the step files written since the last call, and the directory (a failure: a
        `WriteError`, before the checkpoint that would claim those steps)."""
        for p in [*self._unsynced, self.dir]:
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise WriteError(f"{write_failed('the record stream (fsync)', p, e)}; no checkpoint was written "
                                 f"for these steps; the run stops: free some space, then --resume") from e
        self._unsynced.clear()


def recorded_threads(meta: dict) -> int | None:
    """The CPU threads the recorded trainer ran with, for a replay to run with (the count decides
    how a GEMM splits its sums); None where the stream does not say (written before it was
    recorded) or its segments ran with different counts (printed: no count replays all of them)."""
    counts = {seg["threads"] for seg in meta["segments"] if "threads" in seg}
    if len(counts) > 1:
        print(f"[asyncrl] replay: the recorded run's segments used {sorted(counts)} CPU threads; "
              f"the replay uses one count, so it may differ from the run in the last bits")
    return counts.pop() if len(counts) == 1 else None


def read_meta(d) -> dict:
    """stream.json of stream directory `d` (checked)."""
    d = Path(d)
    f = d / "stream.json"
    if not f.is_file():
        hint = " (a run directory: its stream is in stream/)" if (d / "stream" / "stream.json").is_file() else ""
        raise StreamError(f"{d}: not a recorded stream, no stream.json{hint}; record one with --train.record=true")
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StreamError(f"{f}: corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StreamError(f"{f}: format {meta.get('format') if isinstance(meta, dict) else None!r}, this code "
                          f"reads {FORMAT}")
    return meta


def stream_steps(d) -> list[int]:
    """The steps a stream holds, checked to be 1..n without a gap."""
    steps = [s for s, _ in step_files(d)]
    if steps != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, (steps[-1] if steps else 0) + 1)) - set(steps))
        raise StreamError(f"{d}: steps {missing[:5]} are missing (the stream has a gap)")
    return steps


def read_steps(d, limit: int | None = None):
    """Yield the stream's `StreamStep`s in order (up to `limit` steps): what is on disk now,
    so a stream being written can be read."""
    for s in stream_steps(d)[:limit]:
        f = step_file(d, s)
        st = decode(f.read_bytes(), str(f))
        if st.step != s:
            raise StreamError(f"{f}: holds step {st.step}")
        yield st
