"""Run metrics: a JSONL log (+ optional TensorBoard / W&B), and reading it back.

Run by the trainer process (the single writer of `<run_dir>/metrics.jsonl`); `read_metrics` runs
anywhere (notebooks, bench scripts, after the run; the plots of common/contracts/plots.py read with it).

Crash-safety rules:
- One metrics record = one JSON line, written with a single unbuffered `write`, so a crash loses
  at most the line being written.
- A write that fails (disk full, quota) raises `WriteError` naming the file and the free space,
  and the run stops there: a run that cannot log is losing its record (its last checkpoint stays;
  a partial line is cut back when the log is reopened on --resume).
- A crash can leave a partial last line. On open, `MetricsLogger` cuts the file back to its last
  newline (else the next record would be glued onto the fragment); `read_metrics` skips such a
  fragment too, so runs can be plotted while still being written.
- On resume the logger continues `time` from the last recorded value: curves stay monotone.
- On resume from step s (`keep_to=s`), rows of steps after s, written by the run that died after
  its last checkpoint, describe training that resuming discards: they move to
  `metrics_discarded.jsonl` (kept, not mixed in), so every step has one row.
TensorBoard and W&B are extras: requested but not installed -> one warning, the JSONL log goes on.
"""
from __future__ import annotations

import json
import numbers
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common.contracts.errors import WriteError, write_failed
from common.contracts.run_files import record

_RESERVED = ("step", "time")


def warn(msg: str) -> None:
    print(f"[asyncrl.log] warning: {msg}", file=sys.stderr)


def _jsonable(v, key: str):
    """Python floats for tensor / numpy scalars; nested dicts (string keys) and lists kept."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x, f"{key}.{k}") for k, x in v.items()}
    if torch.is_tensor(v):
        v = v.detach().cpu()
        return float(v) if v.numel() == 1 else [float(x) for x in v.flatten()]
    if isinstance(v, np.ndarray):
        return float(v) if v.size == 1 else [float(x) for x in v.ravel()]
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, key) for x in v]
    if isinstance(v, numbers.Integral) and not isinstance(v, np.integer):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(f"MetricsLogger.log: metric {key!r} has unsupported type {type(v).__name__}")


def _scalars(d: dict, prefix: str = ""):
    """(flat name, float) for every numeric leaf: what TensorBoard / W&B can chart."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _scalars(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + k, float(v)


def read_metrics(path) -> list[dict]:
    """All records of a metrics.jsonl; a truncated (crash) last line is skipped."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # partial write of the last record
            raise ValueError(f"{path}:{i + 1}: corrupt metrics line {line[:80]!r}") from None
    return out


class MetricsLogger:
    """Append-only metrics log of one run (see the module doc)."""

    def __init__(self, run_dir, use_tensorboard: bool = False, use_wandb: bool = False,
                 wandb_project: str | None = None, config: dict | None = None, keep_to: int | None = None):
        """keep_to: the step a resumed run continues from (later rows are discarded, module doc)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._t_offset = 0.0
        if self.path.exists():
            data = self.path.read_bytes()
            cut = data.rfind(b"\n") + 1  # 0 when no complete line at all
            if cut != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(cut)
            if keep_to is not None:
                self._discard_after(keep_to)
            times = [r["time"] for r in read_metrics(self.path) if isinstance(r.get("time"), (int, float))]
            self._t_offset = max(times, default=0.0)
        self._t0 = time.monotonic()  # monotonic: immune to wall-clock jumps (NTP) mid-run
        self._f = open(self.path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing to flush later
        record(self.path)  # the run folder's manifest (common/contracts/run_files.py): ours, for --overwrite
        self._tb = self._wandb = None
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional dependency, asked for by a flag
                record(self.run_dir / "tensorboard", tree=True)  # the library names its own files in it
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:
                warn("use_tensorboard=True but tensorboard is not installed (pip install tensorboard); "
                      "logging to metrics.jsonl only")
        if use_wandb:
            try:
                import wandb  # optional dependency, asked for by a flag
                record(self.run_dir / "wandb", tree=True)  # wandb.init(dir=) writes under dir/wandb/
                self._wandb = wandb.init(project=wandb_project, config=config, dir=str(self.run_dir))
            except ImportError:
                warn("use_wandb=True but wandb is not installed (pip install wandb); "
                      "logging to metrics.jsonl only")

    def _discard_after(self, step: int) -> None:
        rows = read_metrics(self.path)
        late = [r for r in rows if r.get("step", 0) > step]
        if not late:
            return
        record(self.run_dir / "metrics_discarded.jsonl")
        with open(self.run_dir / "metrics_discarded.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in late)
        tmp = self.path.with_suffix(".jsonl.tmp")  # then one rename: a crash leaves the old file or the new one
        record(tmp)
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= step), encoding="utf-8")
        tmp.replace(self.path)

    def elapsed(self) -> float:
        """Seconds of run time so far, resumed segments included."""
        return self._t_offset + time.monotonic() - self._t0

    def log(self, step: int, **metrics) -> dict:
        """Append one record {step, time, **metrics}; returns it as written."""
        bad = [k for k in metrics if k in _RESERVED]
        if bad:
            raise ValueError(f"MetricsLogger.log: {bad} are reserved keys")
        rec = {"step": int(step), "time": round(self.elapsed(), 3)}
        rec.update({k: _jsonable(v, k) for k, v in metrics.items()})
        line = memoryview((json.dumps(rec) + "\n").encode())
        try:
            while line:  # one write; a short one (the disk filled mid-line) goes on, and then raises
                line = line[self._f.write(line):]
        except OSError as e:
            raise WriteError(f"{write_failed('metrics', self.path, e)}; the run stops: a run that cannot log "
                             f"loses its record; free some space, then --resume") from e
        scalars = dict(_scalars({k: v for k, v in rec.items() if k not in _RESERVED}))
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, global_step=rec["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=rec["step"])
        return rec

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
