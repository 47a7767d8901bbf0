"""The decode step's layer body through torch.compile (common/engine/sampler/decode_model.py) against the
same code run eagerly, on CPU (inductor's C++ backend), for every supported architecture: the same
greedy tokens, sampled log-probs within rounding, slot refills and shared prompts included; and
how often it compiles over a ragged schedule (once per piece for every batch of two rows or more,
rows dynamic from the first compile, once more for a single row: never once per batch size)."""
import pytest
import torch

from common.engine.sampler.decode_model import EAGER_SHAPES
from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from tests.test_sampler import PROMPTS
from tests.tiny import save_hf

# One sampler run mixes greedy, plain sampled and top-k / top-p requests (rows of each in one batch).
PARAMS = [SamplingParams(max_new_tokens=7, temperature=0.0, n=2),
          SamplingParams(max_new_tokens=9, temperature=0.9, n=3, seed=5),
          SamplingParams(max_new_tokens=8, temperature=1.2, top_k=5, top_p=0.9, n=2, seed=5)]


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


def _run(model, compile: bool, max_batch: int = 4):
    s = Sampler(model, max_batch=max_batch, max_seq_len=48, compile=compile)
    ids = [s.submit(p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(PROMPTS + PROMPTS[::-1])]
    out = {}
    while s.has_work():
        out.update({(c.request_id, c.sample_idx): c for c in s.step()})
    return s, [out[k] for k in sorted(out) if k[0] in ids]


# The layer body's code paths: plain (Llama; llama3 scaling, an untied head and Mistral differ only in
# the values the same graph reads), q/k/v biases (Qwen2), per-head q/k norms and another head size (Qwen3).
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias", "qwen3_qknorm"])
def test_compiled_decode_equals_eager(arch, tmp_path):
    save_hf(arch, tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0]
    _, eager = _run(model, compile=False)
    s, compiled = _run(model, compile=True)
    assert s.dec.compile and s.stats["decode_steps"] > 10 and len(compiled) == 2 * 7 + 3 * 3
    assert not any(EAGER_SHAPES.values()), EAGER_SHAPES  # every compile succeeded: no piece fell back to eager
    assert [c.tokens for c in compiled] == [c.tokens for c in eager], arch
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.logp_tensor(), b.logp_tensor(), atol=1e-4, rtol=0)


def test_compiles_per_piece_not_per_batch_size(tmp_path):
    """A schedule whose live rows take many sizes (8 slots, samples ending at random, refills):
    each piece compiles at most twice (a first static shape, then rows dynamic)."""
    save_hf("llama_tied", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 97, (int(L),), generator=g).tolist() for L in torch.randint(3, 20, (9,), generator=g)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=3, stop_token_ids=(3, 4, 5), seed=1)
    before = _graphs()
    s = Sampler(model, max_batch=8, max_seq_len=48, compile=True)
    sizes = []
    real = s.dec.step

    def spy(cache, tok, *a, **kw):
        sizes.append(tok.shape[0])
        return real(cache, tok, *a, **kw)
    s.dec.step = spy
    s.generate(prompts, params)
    assert len(set(sizes)) >= 5, sizes
    # attn_in, attn_out, the tail: each once for every batch size of 2 rows or more, and at most once
    # more for a single row (sizes 0 and 1 are specialised)
    assert _graphs() - before <= 6


def _single_row_schedule(model, **kw):
    """A long sample in slot 0 and four short ones after it: the live batch ends with one row."""
    s = Sampler(model, max_batch=8, max_seq_len=48, **kw)
    s.submit([9] * 12, SamplingParams(max_new_tokens=14, temperature=0.0))
    s.submit([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.9, n=4, seed=3))
    out = []
    while s.has_work():
        out += s.step()
    return s, sorted(out, key=lambda c: (c.request_id, c.sample_idx))


def test_a_shape_inductor_cannot_compile_runs_eagerly_with_a_warning(tmp_path, monkeypatch):
    """A compile that fails at one shape (inductor's Triton codegen did so at a single row on torch
    2.11) runs those shapes eagerly, warned once per shape, and the run goes on: the same samples."""
    from torch._inductor.exc import InductorError

    import common.engine.sampler.decode_model as dm
    save_hf("llama_tied", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0]
    _, eager = _single_row_schedule(model, compile=False)
    real = torch.compile

    def failing_on_one_row(fn, **kw):
        c = real(fn, **kw)

        def run(*args):
            if args[0].shape[0] == 1:
                raise InductorError(RuntimeError("CantSplit (injected)"), None)
            return c(*args)
        return run
    monkeypatch.setattr(torch, "compile", failing_on_one_row)
    monkeypatch.setattr(dm, "EAGER_SHAPES", {})
    dm._compiled.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CantSplit") as caught:
            s, compiled = _single_row_schedule(model, compile=True)
    finally:
        dm._compiled.cache_clear()  # later tests compile for real
    assert s.dec.compile
    assert {k for k, v in dm.EAGER_SHAPES.items() if v} == {"attn_in", "attn_out", "tail"}  # each piece at one row
    assert all(k[0][0] == 1 for v in dm.EAGER_SHAPES.values() for k in v), dm.EAGER_SHAPES  # x: one row
    assert len([w for w in caught if "CantSplit" in str(w.message)]) == 3  # once per piece and shape, not per step
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.logp_tensor(), b.logp_tensor(), atol=1e-4, rtol=0)
