"""Shared test setup: one thread, fp32, deterministic seeds, default kernels; skip `gpu` tests without CUDA;
nothing beside the clone may be opened."""
import os
import sys
from pathlib import Path

import pytest
import torch

from common.engine.model.causal_attention import set_kernel
from common.engine.model.fused import set_fused
from common.engine.model.linear import set_onednn

torch.set_num_threads(1)

# A fresh clone has nothing beside it, so no test (and nothing a test runs in this process) may read
# there: an audit hook makes every open or listing of a path under the clone's parent's "shared"
# folder fail. (Processes a test spawns are not covered; tests/test_data.py also checks that no
# file of the repository names such a path.)
BESIDE = Path(__file__).resolve().parents[1].parent / "shared"
_BESIDE = os.path.join(str(BESIDE), "")


def _refuse_beside(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(_BESIDE) or path == str(BESIDE):
            raise PermissionError(f"{path}: tests may not read beside the clone (a fresh clone has nothing there)")


sys.addaudithook(_refuse_beside)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _default_kernels():
    """Every test starts on the process-wide defaults: oneDNN routing where available, our attention
    kernel, the blocked MLP/RMSNorm. A test that runs a trainer in this process applies the precision
    this machine resolves (`Precision.apply`), and on a CPU where `auto` picks ATen or SDPA that
    choice would otherwise stay for every later test."""
    set_kernel(True)
    set_onednn(True)
    set_fused(True)
    yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, reference): our model and the transformers model of one tiny random Llama."""
    from common.engine.checkpoints.hf_io import load_model
    from tests.tiny import save_hf
    d = tmp_path_factory.mktemp("llama")
    ref = save_hf("llama_tied", d)
    ours, _ = load_model(str(d), tokenizer=False)
    return ours, ref
