"""Shared test setup: one thread, fp32, deterministic seeds; skip `gpu` tests without CUDA."""
import pytest
import torch

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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, reference): our model and the transformers model of one tiny random Llama."""
    from common.engine.hf_io import load_model
    from tests.tiny import save_hf
    d = tmp_path_factory.mktemp("llama")
    ref = save_hf("llama_tied", d)
    ours, _ = load_model(str(d), tokenizer=False)
    return ours, ref
