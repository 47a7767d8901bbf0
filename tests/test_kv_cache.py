"""The sampler's fast paths: split attention with merge, shared prompts, compaction, the
two-level draw and the oneDNN linear routing. Each is checked against the plain computation."""
import pytest
import torch
import torch.nn.functional as F

from common.engine.model import attention
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import linear, onednn_enabled, set_onednn
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams, block_sums, draw
from tests.test_sampler import PROMPTS, _hf_greedy
from tests.tiny import save_hf


@pytest.mark.parametrize("impl", ["default", "reference"])
def test_split_attention_merge_equals_full(impl, monkeypatch):
    """Attention over keys A u B == merge(attention over A, attention over B), GQA, masks, causal."""
    if impl == "reference":  # the non-CPU code path, forced on CPU
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
    torch.manual_seed(0)
    B, H, Hkv, hd, Ta, Tb = 3, 6, 2, 16, 9, 5
    q = torch.randn(B, H, Tb, hd)
    ka, va = torch.randn(B, Hkv, Ta, hd), torch.randn(B, Hkv, Ta, hd)
    kb, vb = torch.randn(B, Hkv, Tb, hd), torch.randn(B, Hkv, Tb, hd)
    seen = torch.rand(B, 1, 1, Ta) > 0.4
    seen[..., 0] = True
    # A: masked prefix; B: causal among the Tb queries (a continuation after a prompt)
    oa, la = attention.attend_lse(q, ka, va, attention.additive_mask(seen, q.dtype))
    ob, lb = attention.attend_lse(q, kb, vb, causal=True)
    out = attention.merge(oa, la, ob, lb)
    full_mask = torch.cat((seen.expand(B, 1, Tb, Ta), torch.ones(Tb, Tb, dtype=torch.bool).tril().expand(B, 1, Tb, Tb)), -1)
    want = F.scaled_dot_product_attention(q, torch.cat((ka, kb), 2), torch.cat((va, vb), 2), attn_mask=full_mask,
                                          enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    s = (q @ ka.repeat_interleave(3, 1).transpose(-1, -2)) / hd ** 0.5
    torch.testing.assert_close(la, torch.logsumexp(s.masked_fill(~seen, float("-inf")), -1), atol=1e-5, rtol=1e-5)


def test_shared_prompt_equals_separate_requests(pair):
    """n samples attending to one shared prompt entry == n separate requests (greedy, 3 rows per entry)."""
    ours, ref = pair
    shared = Sampler(ours, max_batch=6, max_seq_len=64).generate(PROMPTS[:2], SamplingParams(max_new_tokens=9, temperature=0, n=3))
    for i, p in enumerate(PROMPTS[:2]):
        want = _hf_greedy(ref, p, 9)
        assert [c.tokens for c in shared[3 * i:3 * i + 3]] == [want] * 3


def _greedy_equals_hf(s: Sampler, ref, prompts, lens) -> None:
    """Run greedy requests (prompt i for lens[i] tokens) through `s` to the end; each equals
    transformers' greedy continuation."""
    ids = [s.submit(p, SamplingParams(max_new_tokens=n, temperature=0)) for p, n in zip(prompts, lens)]
    out = {}
    while s.has_work():
        out.update({c.request_id: c for c in s.step()})
    for i, p, n in zip(ids, prompts, lens):
        assert out[i].tokens == _hf_greedy(ref, p, n)


def test_compaction_keeps_outputs_and_computes_only_busy_rows(pair):
    """Short samples finish in low slots; the long ones move down and no idle row is computed."""
    ours, ref = pair
    s = Sampler(ours, max_batch=4, max_seq_len=64)
    _greedy_equals_hf(s, ref, PROMPTS, [2, 11, 4, 11])
    assert s.stats["decode_rows"] == s.stats["decode_tokens"]  # every computed row was a live sample
    assert s.entries == [None] * len(s.entries) and s.slots == [None] * 4


def test_several_moves_in_one_step(pair):
    """Three short samples finish in the same step below three long ones of different lengths:
    the long ones (and their prompt entries) move down together, in one copy per store."""
    ours, ref = pair
    s = Sampler(ours, max_batch=6, max_seq_len=64)
    _greedy_equals_hf(s, ref, PROMPTS + [[7, 8]], [2, 2, 2, 12, 9, 11])
    assert s.stats["decode_rows"] == s.stats["decode_tokens"]


def test_partial_admission_then_interrupt_uses_new_weights(tmp_path):
    """n=4 with 2 slots: the last two samples are admitted after an interrupt; their first token
    comes from the re-prefilled prompt under the new weights."""
    save_hf("qwen3_qknorm", tmp_path / "a", seed=0)
    save_hf("qwen3_qknorm", tmp_path / "b", seed=1)
    m, _ = load_model(str(tmp_path / "a"), tokenizer=False)
    new, _ = load_model(str(tmp_path / "b"), tokenizer=False)
    s = Sampler(m, max_batch=2, max_seq_len=64)
    s.submit(PROMPTS[4], SamplingParams(max_new_tokens=3, temperature=0, n=4))
    out = s.step()  # admits samples 0, 1 (prefill + 1 decode)
    s.update_weights(lambda mod: mod.load_state_dict(new.state_dict()), version=1)
    while s.has_work():
        out += s.step()
    late = [c for c in out if c.sample_idx >= 2]
    want = Sampler(new, max_batch=1, max_seq_len=64).generate([PROMPTS[4]], SamplingParams(max_new_tokens=3, temperature=0))[0]
    assert [c.tokens for c in late] == [want.tokens] * 2 and all(c.versions == [1] * 3 for c in late)
    assert s.stats["prefill_tokens"] == 2 * len(PROMPTS[4]) + 2 * 1  # prompt twice; 2 early samples' 1 own token


def test_two_level_draw_distribution_and_zero_mass():
    """Block size 4 over a ragged vocab of 10: frequencies match, zero-mass columns never drawn."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.05, 0.0, 0.0, 0.0, 0.4, 0.25])
    e = probs.expand(20000, -1).contiguous()
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    tok = draw(e, block_sums(e, block=4), u, block=4)
    freq = torch.bincount(tok, minlength=10).float() / len(tok)
    assert set(tok.unique().tolist()) <= {1, 3, 4, 8, 9}
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


@pytest.mark.parametrize("rows,out", [(1, 32), (2, 48), (4, 32), (64, 48), (3, 9000)])
def test_linear_routing_matches_f_linear(rows, out):
    """Inference and training (oneDNN forward + backward) agree with F.linear, grads included."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, rows, 40), torch.randn(out, 40), torch.randn(out)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    grads = []
    for fn, dt in ((linear, torch.float32), (F.linear, torch.float64)):  # ours vs an fp64 reference
        xs, ws, bs = (t.detach().to(dt).clone().requires_grad_(True) for t in (x, w, b))
        y = fn(xs, ws, bs)
        (y.square() * torch.linspace(-1, 1, out, dtype=dt)).sum().backward()
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad))
    for ours, ref in zip(*grads):  # fp32 accuracy relative to each tensor's scale
        assert ours.dtype == torch.float32
        assert (ours.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    old = set_onednn(False)
    try:
        assert not onednn_enabled()
        with torch.no_grad():
            assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    finally:
        set_onednn(old)
