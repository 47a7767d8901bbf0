"""The decode step a CUDA graph captures (common/engine/sampler/decode.py), run eagerly on CPU: the same
tokens and log-probs as the live-shaped step, also through the attention code CUDA runs; the
counter-based random numbers; batched prefill."""
import math

import pytest
import torch

from common.engine.model import attention
from common.engine.sampler.decode import bucket
from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams, row_keys, uniforms
from tests.test_sampler import PROMPTS, _hf_greedy
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    save_hf("qwen3_qknorm", d)
    return load_model(str(d), tokenizer=False)[0]


def _run(model, max_batch=3, **kw):
    params = [SamplingParams(max_new_tokens=9, temperature=0.9, n=3, seed=5),
              SamplingParams(max_new_tokens=7, temperature=0.0, n=2),
              SamplingParams(max_new_tokens=8, temperature=1.2, top_k=5, top_p=0.9, n=2, seed=5)]
    out = []
    for p in params:  # greedy, sampled, filtered; prompts of different lengths, slots refilled
        out += Sampler(model, max_batch=max_batch, max_seq_len=48, **kw).generate(PROMPTS, p)
    return out


def _same(a, b, atol):
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logp_tensor(), y.logp_tensor(), atol=atol, rtol=0)


def test_captured_shapes_give_the_live_result(qwen3):
    """Rows padded to a power of two, every entry and slot column attended: same samples."""
    live = _run(qwen3)
    _same(_run(qwen3, static_shapes=True), live, atol=1e-5)


def test_gpu_attention_code_gives_the_same_samples(qwen3, monkeypatch):
    """The grouped-query matmul attention (what CUDA runs and captures), forced on CPU."""
    live = _run(qwen3)
    monkeypatch.setattr(attention, "_CPU_FLASH", None)
    _same(_run(qwen3, static_shapes=True), live, atol=1e-5)


def test_samples_do_not_depend_on_batching(qwen3):
    """Counter-based uniforms: the same seed gives the same samples with 1, 3 or 16 slots and
    with one prompt per prefill forward (a sample is a function of its request, not its slot)."""
    base = _run(qwen3, max_batch=3)
    _same(_run(qwen3, max_batch=1), base, atol=1e-5)
    _same(_run(qwen3, max_batch=16, prefill_tokens=1), base, atol=1e-5)


def test_batched_prefill_matches_transformers(pair):
    """Several prompts of different lengths per prefill forward (right-padded), greedy == HF."""
    ours, ref = pair
    s = Sampler(ours, max_batch=8, max_seq_len=64)
    outs = s.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    assert s.stats["prefill_forwards"] == 1 and s.stats["prefill_tokens"] == sum(map(len, PROMPTS))
    assert [c.tokens for c in outs] == [_hf_greedy(ref, p, 6) for p in PROMPTS]
    s = Sampler(ours, max_batch=8, max_seq_len=64, prefill_tokens=20)  # a budget: several forwards
    assert [c.tokens for c in s.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))] == \
        [c.tokens for c in outs]
    assert s.stats["prefill_forwards"] > 1


def test_uniforms_are_uniform_and_keyed():
    keys = row_keys(7, torch.arange(2000), torch.arange(2000) % 4)
    u = uniforms(keys.repeat_interleave(50), torch.arange(50).repeat(2000))  # 100k draws
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    counts = torch.histc(u, bins=50, min=0, max=1)
    chi2 = float(((counts - 2000) ** 2 / 2000).sum())  # 49 degrees of freedom: 99.9% quantile ~86
    assert chi2 < 86, chi2
    assert len(set(u.tolist())) > 99_000  # no short cycles or collisions
    assert abs(float(torch.corrcoef(torch.stack((u[:-1], u[1:])))[0, 1])) < 0.02  # successive tokens of a sample
    again = uniforms(row_keys(7, torch.tensor([3]), torch.tensor([3])), torch.tensor([4]))
    assert again.item() == u[3 * 50 + 4].item()  # a pure function of (seed, request, sample, token)
    assert uniforms(row_keys(8, torch.tensor([3]), torch.tensor([3])), torch.tensor([4])).item() != again.item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model: the CUDA path is tests/test_gpu.py's")
def test_bucket_and_graphs_need_cuda(qwen3):
    assert [bucket(x, 256) for x in (1, 2, 3, 5, 200, 256)] == [1, 2, 4, 8, 256, 256]
    assert bucket(300, 256) == 256 and math.log2(bucket(17, 1024)) == 5
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Sampler(qwen3, max_batch=4, max_seq_len=32, cuda_graphs=True)
