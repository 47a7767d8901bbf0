"""The sampler's CPU bf16 decode GEMMs on weights packed for oneDNN (`precision.decode_gemm=packed`:
common/engine/model/linear.py `pack` / `packed_linear`, common/engine/sampler/decode_model.py) against F.linear on
the same bf16 weights: the same greedy tokens and log-probs within bf16 rounding, eagerly and with
the layer body compiled, biases included; a weight update re-packs (the next step reads the new
weights); and the sampler refuses packing where it cannot apply."""
import pytest
import torch

from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import bf16_packing_available, pack, packed_linear
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from tests.test_sampler import PROMPTS
from tests.tiny import save_hf

# Greedy rows only: a sampled row's draw flips at a CDF boundary on a bf16 rounding difference
# (F.linear and the packed GEMM may round differently), and then its whole continuation differs.
PARAMS = [SamplingParams(max_new_tokens=9, temperature=0.0, n=2), SamplingParams(max_new_tokens=7, temperature=0.0)]

needs_packing = pytest.mark.skipif(not bf16_packing_available(),
                                   reason="this CPU's PyTorch cannot pack bf16 weights for oneDNN (no bf16 support)")


def _run(model, packed: bool, compile: bool = False):
    s = Sampler(model, max_batch=4, max_seq_len=48, compile=compile, packed=packed)
    ids = [s.submit(p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(PROMPTS + PROMPTS[::-1])]
    out = {}
    while s.has_work():
        out.update({(c.request_id, c.sample_idx): c for c in s.step()})
    return s, [out[k] for k in sorted(out) if k[0] in ids]


def _same(a, b):
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logp_tensor(), y.logp_tensor(), atol=2e-2, rtol=0)


@needs_packing
def test_packed_linear_equals_f_linear_at_any_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    pw = pack(w)  # packed for 64 rows, used at others
    for rows in (1, 3, 64, 130):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        torch.testing.assert_close(packed_linear(x, pw, b), torch.nn.functional.linear(x, w, b), atol=2e-2, rtol=1e-2)


@needs_packing
@pytest.mark.parametrize("arch,compile", [("llama_tied", False), ("qwen2_bias", False), ("qwen2_bias", True)])
def test_packed_decode_equals_plain(arch, compile, tmp_path):
    """Compiled: the packed GEMM as a custom op inside the compiled layer body (q/k/v biases too)."""
    save_hf(arch, tmp_path)
    model = load_model(str(tmp_path), tokenizer=False, dtype=torch.bfloat16)[0]
    _, plain = _run(model, packed=False)
    s, packed = _run(model, packed=True, compile=compile)
    assert s.dec.packed_gemm and s.dec.layers[0].packed and s.dec.compile == compile and s.stats["decode_steps"] > 5
    _same(packed, plain)


@needs_packing
def test_weight_update_repacks(tmp_path):
    save_hf("llama_tied", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False, dtype=torch.bfloat16)[0]
    s = Sampler(model, max_batch=4, max_seq_len=48, packed=True)
    before = s.generate(PROMPTS[:2], PARAMS[0])

    def load(m):  # new weights copied in place, as the weight store does
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(-1.5)
    s.update_weights(load, version=1)
    after = s.generate(PROMPTS[:2], PARAMS[0])
    fresh = Sampler(model, max_batch=4, max_seq_len=48, packed=False).generate(PROMPTS[:2], PARAMS[0])
    assert [c.tokens for c in after] == [c.tokens for c in fresh] != [c.tokens for c in before]


def test_packing_refused_where_it_cannot_apply(tmp_path):
    save_hf("llama_tied", tmp_path)
    fp32 = load_model(str(tmp_path), tokenizer=False)[0]
    with pytest.raises(ValueError, match=r"packed=True\) needs bf16 weights"):
        Sampler(fp32, max_batch=2, max_seq_len=16, packed=True)
    fp32.decode_packed = True  # a run's choice on a model it does not fit (fp32 weights): plain
    assert not Sampler(fp32, max_batch=2, max_seq_len=16).dec.packed_gemm
