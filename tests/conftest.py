"""Shared test setup: one thread, fp32, deterministic seeds, default kernels; skip `gpu` tests without CUDA."""
import pytest
import torch

from common.engine.causal_attention import set_kernel
from common.engine.fused import set_fused
from common.engine.linear import set_onednn

torch.set_num_threads(1)


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
    from common.engine.hf_io import load_model
    from tests.tiny import save_hf
    d = tmp_path_factory.mktemp("llama")
    ref = save_hf("llama_tied", d)
    ours, _ = load_model(str(d), tokenizer=False)
    return ours, ref
