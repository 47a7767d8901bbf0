"""notebooks/loss_ablation_replay.ipynb: matches its builder script, and its code runs end to
end on CPU (a tiny recorded async run replayed under four losses) in well under a minute."""
from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks" / "loss_ablation_replay.ipynb"
BUILDER = ROOT / "notebooks" / "build_loss_ablation_replay.py"


def _builder():
    spec = importlib.util.spec_from_file_location("build_loss_ablation_replay", BUILDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_notebook_matches_builder(tmp_path):
    nb = json.loads(NB.read_text())
    rebuilt = json.loads(_builder().write(tmp_path / "rebuilt.ipynb").read_text())
    assert nb == rebuilt, "notebooks/loss_ablation_replay.ipynb is stale: run python notebooks/build_loss_ablation_replay.py"
    params = [c for c in nb["cells"] if c["cell_type"] == "code" and "parameters" in c["metadata"].get("tags", [])]
    assert len(params) == 1 and "RUN_ROOT" in "".join(params[0]["source"])


@pytest.mark.slow  # the suite's time: test_notebooks_kernel.py runs this notebook in a kernel
def test_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    monkeypatch.chdir(ROOT / "notebooks")  # where Jupyter starts it
    ns: dict = {"__name__": "__main__"}  # the cells' functions live in a file-less __main__, as in Jupyter
    t0 = time.perf_counter()
    try:
        for i, cell in enumerate(c for c in json.loads(NB.read_text())["cells"] if c["cell_type"] == "code"):
            exec(compile("".join(cell["source"]), f"cell{i}", "exec"), ns)
            if "parameters" in cell["metadata"].get("tags", []):
                ns.update(RUN_ROOT=str(tmp_path / "runs"), STEPS=12, EVAL_EVERY=4)
    finally:
        plt.close("all")
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, elapsed
    assert ns["max_diff"] <= 1e-6
    summary = ns["summary"]
    assert len(summary) == 5 and all(math.isfinite(v) for s in summary.values() for v in s.values())
    losses = {k: s["final loss"] for k, s in summary.items()}
    assert len({round(v, 6) for k, v in losses.items() if k != "recorded run"}) == 4  # four different losses
    assert ns["fig"] is not None and len(ns["fig"].axes) >= 2  # the side-by-side figure, shown inline
    assert (tmp_path / "runs" / "replays_side_by_side.png").is_file() and (tmp_path / "runs" / "recorded" / "replays.png").is_file()
    assert ns["reinforce_group_baseline"].__module__ == "__main__"
