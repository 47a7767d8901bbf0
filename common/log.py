"""Run metrics: a JSONL log (+ optional TensorBoard / W&B), plots of it, and a progress bar.

Run by the trainer process (the single writer of `<run_dir>/metrics.jsonl`); `read_metrics` and
the plot functions run anywhere (notebooks, bench scripts, after the run).

Crash-safety rules:
- One metrics record = one JSON line, written with a single `write` and flushed at once, so a
  crash loses at most the line being written.
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

import functools
import io
import json
import math
import numbers
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

_RESERVED = ("step", "time")


def _warn(msg: str) -> None:
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
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = self._wandb = None
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional dependency, asked for by a flag
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:
                _warn("use_tensorboard=True but tensorboard is not installed (pip install tensorboard); "
                      "logging to metrics.jsonl only")
        if use_wandb:
            try:
                import wandb  # optional dependency, asked for by a flag
                self._wandb = wandb.init(project=wandb_project, config=config, dir=str(self.run_dir))
            except ImportError:
                _warn("use_wandb=True but wandb is not installed (pip install wandb); "
                      "logging to metrics.jsonl only")

    def _discard_after(self, step: int) -> None:
        rows = read_metrics(self.path)
        late = [r for r in rows if r.get("step", 0) > step]
        if not late:
            return
        with open(self.run_dir / "metrics_discarded.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in late)
        tmp = self.path.with_suffix(".jsonl.tmp")  # then one rename: a crash leaves the old file or the new one
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
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
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


# ---------------------------------------------------------------- plots
# a panel is drawn only when its metric was logged (gap_mean: AReaL's prox/behav train-inference gap)
_PANELS = (("reward_mean", "train reward"), ("eval_accuracy", "test accuracy"),
           ("staleness_mean", "staleness (versions behind)"), ("gap_mean", "|prox - behav logp| per token"))


def _series(records: list[dict], key: str, x: str) -> tuple[list[float], list[float]]:
    pts = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            pts.append(((r.get("time", 0.0) / 60.0) if x == "time" else r.get("step", 0), float(v)))
    pts.sort(key=lambda p: p[0])
    return [p[0] for p in pts], [p[1] for p in pts]


def _run_source(run) -> tuple[Path, str | None]:
    """(metrics.jsonl path, label) of a `plot_runs` item: (path, label), or a path alone (a run
    directory or its metrics.jsonl; label = the run's directory name)."""
    given = isinstance(run, (tuple, list))  # (path, label): the label as given, None = no legend entry
    path = Path(run[0] if given else run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return path, run[1] if given else path.parent.name


@functools.lru_cache(maxsize=None)
def _shown_figure(figure_cls):
    """A subclass of matplotlib's Figure that a Jupyter kernel displays as a PNG image. Our figures
    are made without pyplot (no global backend state to disturb in a script or a run), so the
    kernel's inline backend never registers them and a bare Figure would show as its text repr;
    IPython displays any object with `_repr_png_` as an image."""

    class ShownFigure(figure_cls):
        def _repr_png_(self) -> bytes:
            buf = io.BytesIO()
            self.savefig(buf, format="png", dpi=100)
            return buf.getvalue()

    return ShownFigure


def plot_runs(runs, out_png=None, x: str = "time", panels=_PANELS, title: str | None = None):
    """Overlay several runs; returns the matplotlib Figure, which a notebook displays as an image
    (the last expression of a cell, or `display(fig)`), or None when matplotlib is missing or no
    panel has data. runs: [(metrics.jsonl or run dir, label), ...] or just paths (labelled by run
    directory name). One subplot per panel (metric key, panel title) that has data, one colour
    per run in every panel; x = wall-clock minutes ("time") or "step". out_png: also write the
    figure there."""
    try:
        # lazy: matplotlib takes seconds to import and only the end of a run plots (no pyplot:
        # no global backend state to disturb)
        from matplotlib import rcParams
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        _warn("matplotlib is not installed (pip install matplotlib); no plot made")
        return None
    data = [(label, read_metrics(p)) for p, label in map(_run_source, runs)]
    cycle = rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    colours = [cycle[i % len(cycle)] for i in range(len(data))]  # run i keeps its colour in every panel
    series = {key: [(label, *_series(recs, key, x)) for label, recs in data] for key, _ in panels}
    shown = [(k, t) for k, t in panels if any(xs for _, xs, _ in series[k])]
    if not shown:
        _warn(f"none of the metrics {[k for k, _ in panels]} has data points; no plot made")
        return None
    fig = _shown_figure(Figure)(figsize=(5.0 * len(shown), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, (key, panel_title) in zip(axes, shown):
        for colour, (label, xs, ys) in zip(colours, series[key]):
            if xs:  # one point only: draw a marker, a line needs two
                ax.plot(xs, ys, label=label, color=colour, markersize=3,
                        marker="o" if len(xs) < 2 or key.startswith("eval") else None)
        ax.set_title(panel_title)
        ax.set_xlabel("wall-clock minutes" if x == "time" else "step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if any(label for label, _, _ in series[key]):
            ax.legend()
    if title:
        fig.suptitle(title)
    if out_png is not None:
        out = Path(out_png)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    return fig


def plot_metrics(metrics_path, out_png, x: str = "time", panels=_PANELS, title: str | None = None) -> Path | None:
    """Plot one run's metrics.jsonl, or overlay runs given as [(path, label), ...], into
    out_png; returns its path (None if nothing was plotted)."""
    runs = metrics_path if isinstance(metrics_path, (list, tuple)) else [(metrics_path, None)]
    fig = plot_runs(runs, out_png, x=x, panels=panels, title=title)
    return Path(out_png) if fig is not None else None


# ---------------------------------------------------------------- progress bar
def _fmt(v) -> str:
    if torch.is_tensor(v) or isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if v != 0 and math.isfinite(v) and (abs(v) < 1e-2 or abs(v) >= 1e5):
        mant, exp = f"{v:.1e}".split("e")
        return f"{mant}e{int(exp)}"  # 1.2e-3, not 1.2e-03
    return f"{v:.3g}"


class Progress:
    """Trainer progress bar: `update(1, reward=0.41, loss=1.2e-3, **{"tok/s": 120})`."""

    def __init__(self, total: int | None, initial: int = 0, desc: str | None = None):
        self._bar = tqdm(total=total, initial=initial, desc=desc, mininterval=1.0, dynamic_ncols=True)
        self._last_wait = 0.0  # when `waiting` last redrew

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:  # no refresh here: tqdm redraws at most every mininterval inside update()
            self._bar.set_postfix_str(" ".join(f"{k}={_fmt(v)}" for k, v in postfix.items()), refresh=False)
        self._bar.update(n)

    def waiting(self, what) -> bool:
        """Show what the trainer is waiting for, `what` a string or a function returning one
        (evaluated at most once a second); returns False so it can sit in a wait condition."""
        now = time.monotonic()
        if now - self._last_wait >= 1.0:
            self._last_wait = now
            self._bar.set_postfix_str(f"waiting for {what() if callable(what) else what}", refresh=True)
        return False

    def close(self) -> None:
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
