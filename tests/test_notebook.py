"""notebooks/tb_loss_ablation.ipynb: matches its builder script, and runs end to end on a tiny
run directory (tiny random model + a small replay buffer, written with save_checkpoint)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.contracts.batch import Trajectory
from common.engine.checkpoints.hf_io import load_model
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.files.checkpoint import latest_checkpoint, save_checkpoint
from tests.tiny import save_hf

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks" / "tb_loss_ablation.ipynb"
BUILDER = ROOT / "notebooks" / "build_tb_loss_ablation.py"


def _builder():
    spec = importlib.util.spec_from_file_location("build_tb_loss_ablation", BUILDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trajs(seed: int = 0) -> list[Trajectory]:
    """5 groups x 4 responses; duplicates inside groups, and group 4 has one distinct response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(5):
        prompt = torch.randint(3, 97, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        comps = [torch.randint(3, 97, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
                 for _ in range(4)]
        if gid in (1, 2):
            comps[3] = comps[0].clone()  # a duplicate completion
        if gid == 4:
            comps = [comps[0].clone() for _ in range(4)]  # only one distinct response: not eligible
        for c in comps:
            n = c.numel()
            out.append(Trajectory(prompt=prompt, completion=c, logp=-torch.rand(n, generator=g) * 3,
                                  versions=torch.zeros(n, dtype=torch.long),
                                  reward=float(torch.randint(0, 2, (1,), generator=g)), group_id=100 + gid,
                                  ref_seq_logp=float(-torch.rand(1, generator=g) * 5 * n)))
    return out


@pytest.fixture
def run_dir(tmp_path):
    hf_dir = tmp_path / "hf"
    save_hf("llama_tied", hf_dir)
    model, _ = load_model(str(hf_dir), tokenizer=False)
    buf = ReplayBuffer(capacity=64, max_seq_len=32)
    buf.add(_trajs())
    run = tmp_path / "runs" / "tiny_tba"
    cfg = {"gen": {"temperature": 0.7}, "tba": {"beta_init": 0.012, "beta_final": 0.004, "beta_anneal_steps": 40}}
    save_checkpoint(run, 40, model, torch.optim.AdamW(model.parameters(), lr=1e-5), buffer=buf, config=cfg)
    assert latest_checkpoint(run) is not None
    return run


def _code_cells(nb: dict) -> list[tuple[int, dict]]:
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def _run(nb: dict, overrides: dict, upto: int | None = None) -> dict:
    ns: dict = {"__name__": "__main__"}
    cells = _code_cells(nb)
    for i, cell in cells[:upto]:
        exec(compile("".join(cell["source"]), f"cell{i}", "exec"), ns)
        if "parameters" in cell["metadata"].get("tags", []):
            ns.update(overrides)
    return ns


def test_notebook_matches_builder(tmp_path):
    nb = json.loads(NB.read_text())
    rebuilt = json.loads(_builder().write(tmp_path / "rebuilt.ipynb").read_text())
    assert nb == rebuilt, "notebooks/tb_loss_ablation.ipynb is stale: run python notebooks/build_tb_loss_ablation.py"
    assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["name"] == "python3"
    for c in nb["cells"]:
        assert {"cell_type", "metadata", "source", "id"} <= set(c) and isinstance(c["source"], list)
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None
    params = [c for _, c in _code_cells(nb) if "parameters" in c["metadata"].get("tags", [])]
    assert len(params) == 1 and "RUN_DIR" in "".join(params[0]["source"])


def test_notebook_runs_on_tiny_run(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    monkeypatch.chdir(ROOT / "notebooks")  # where Jupyter starts it
    nb = json.loads(NB.read_text())

    # no checkpoint and no tiny run asked for: a clear error that says how to make one (with
    # MAKE_TINY_RUN, the default, it makes one: tests/test_notebooks_kernel.py runs that)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="run_gsm8k.py"):
        _run(nb, {"RUN_DIR": str(empty), "MAKE_TINY_RUN": False}, upto=2)

    ns = _run(nb, {"RUN_DIR": str(run_dir), "N_GROUPS": 3})
    try:
        results, betas = ns["results"], ns["BETAS"]
        assert len(ns["picked"]) == 3 and 104 not in ns["picked"]  # group 4 has one distinct response
        assert len(ns["batch"]) == len(ns["rows"]) == sum(len(ns["groups"][g]) for g in ns["picked"])
        assert set(results) == set(ns["variants"]) and len(results) == len(betas) + 2
        for name, res in results.items():
            assert math.isfinite(res["loss"]) and math.isfinite(res["grad_norm"]) and res["grad_norm"] > 0, name
            assert res["weights"].shape == (len(ns["batch"]),) and np.isfinite(res["weights"]).all(), name
        base = ns["BASE_BETA"]
        tb, no_ref = results[f"tb (beta={base:g})"], results[f"tb, no reference (beta={base:g})"]
        assert not np.allclose(tb["weights"], no_ref["weights"])
        assert tb["loss"] != pytest.approx(no_ref["loss"])
        cos = ns["cos"]
        assert cos.shape == (len(results),) * 2 and np.allclose(np.diag(cos), 1, atol=1e-4)
        fig = ns["fig"]
        assert isinstance(fig, matplotlib.figure.Figure) and plt.fignum_exists(fig.number)
        assert len([a for a in fig.axes if a.get_visible()]) == len(results)
    finally:
        plt.close("all")
