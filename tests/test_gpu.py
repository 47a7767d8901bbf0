"""CUDA paths (bf16 model, sampler on GPU, trainer + generator on GPU). Skipped without CUDA."""
import pytest
import torch

from common.engine.hf_io import load_model
from common.engine.sampler import Sampler
from common.engine.sampling import SamplingParams
from common.ops import token_logp
from tests.tiny import save_hf

pytestmark = pytest.mark.gpu


def test_bf16_sampler_logp_matches_trainer(tmp_path):
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    assert model.dtype == torch.bfloat16  # the CUDA default
    s = Sampler(model, max_batch=8, max_seq_len=64)
    outs = s.generate([[5, 6, 7], [9] * 10], SamplingParams(max_new_tokens=12, temperature=0.7, n=3, seed=0))
    for c in outs:
        seq = torch.tensor([c.prompt_tokens + c.tokens], device="cuda")
        with torch.no_grad():
            full = token_logp(model, seq, 0.7)[0, len(c.prompt_tokens):].float().cpu()
        torch.testing.assert_close(c.logp_tensor(), full, atol=5e-2, rtol=0)  # bf16 kernels differ


def test_train_on_cuda_with_ipc_weights(tmp_path):
    from tests.test_e2e import _cfg, _prompts, _tba, toy_reward
    from common.runtime.trainer import train
    cfg = _cfg(tmp_path, steps=6, device="cuda")
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert last["version"] == 3 and last["gen_syncs"] >= 1


@pytest.mark.parametrize("kw", [dict(temperature=0.0, n=2), dict(temperature=0.8, n=3, seed=4),
                                dict(temperature=1.0, top_k=7, top_p=0.9, n=2, seed=4)])
def test_cuda_graph_decode_equals_eager(tmp_path, kw):
    """The captured decode (one graph per bucket, replayed) gives the samples of the same step run
    eagerly at the same shapes (live shapes differ only by bf16 rounding: tests/test_decode.py)."""
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    prompts = [[5, 6, 7], [9] * 10, [3, 4], list(range(10, 31)), [77]]
    params = SamplingParams(max_new_tokens=14, **kw)
    eager = Sampler(model, max_batch=4, max_seq_len=64, static_shapes=True).generate(prompts, params)
    g = Sampler(model, max_batch=4, max_seq_len=64, cuda_graphs=True)
    graphed = g.generate(prompts, params)
    assert g.graphed.graphs, "no graph was captured"
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a.logp_tensor(), b.logp_tensor(), atol=1e-3, rtol=0)
