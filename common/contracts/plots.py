"""Plots of runs' metrics (metrics.jsonl, common/contracts/log.py): one panel per metric, one colour per run,
against wall-clock minutes or the step. Run anywhere: by the task scripts at the end of a run
(runs/<name>/curves.png), by a replay, a notebook, the bench scripts. matplotlib is optional and
imported only when a plot is made, without pyplot.
"""
from __future__ import annotations

import functools
import io
import math
from pathlib import Path

from common.contracts.log import read_metrics, warn
from common.contracts.run_files import record


# a panel is drawn only when its metric was logged (gap_mean: AReaL's prox/behav train-inference gap;
# eta, eta_ess: train.max_staleness=auto's decisions, common/runtime/staleness_control.py)
_PANELS = (("reward_mean", "train reward"), ("eval_accuracy", "test accuracy"),
           ("staleness_mean", "staleness (versions behind)"), ("gap_mean", "|prox - behav logp| per token"),
           ("mismatch_abs_mean", "sampler vs trainer |logp|, same weights"),
           ("eta", "staleness bound eta (auto)"), ("eta_ess", "ESS fraction (auto's window)"))


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
        warn("matplotlib is not installed (pip install matplotlib); no plot made")
        return None
    data = [(label, read_metrics(p)) for p, label in map(_run_source, runs)]
    cycle = rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    colours = [cycle[i % len(cycle)] for i in range(len(data))]  # run i keeps its colour in every panel
    series = {key: [(label, *_series(recs, key, x)) for label, recs in data] for key, _ in panels}
    shown = [(k, t) for k, t in panels if any(xs for _, xs, _ in series[k])]
    if not shown:
        warn(f"none of the metrics {[k for k, _ in panels]} has data points; no plot made")
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
        record(out)  # in a run folder: ours (common/contracts/run_files.py)
        fig.savefig(out, dpi=100)
    return fig


def plot_metrics(metrics_path, out_png, x: str = "time", panels=_PANELS, title: str | None = None) -> Path | None:
    """Plot one run's metrics.jsonl, or overlay runs given as [(path, label), ...], into
    out_png; returns its path (None if nothing was plotted)."""
    runs = metrics_path if isinstance(metrics_path, (list, tuple)) else [(metrics_path, None)]
    fig = plot_runs(runs, out_png, x=x, panels=panels, title=title)
    return Path(out_png) if fig is not None else None
