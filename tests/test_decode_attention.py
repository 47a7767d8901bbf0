"""The decode step's attention layouts (common/engine/sampler/decode_attention.py), checked on CPU: the flash
path's varlen layout (strided token-major views of the cache, cu_seqlens, seqused_k, the two
log-sum-exp layouts) through a reference of the kernel's semantics, against the dense masked path;
and the whole sampler through the flash layout and through the compiled layer body."""
import pytest
import torch

from common.engine.sampler import decode_attention as da
from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from tests.test_sampler import PROMPTS
from tests.tiny import save_hf


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                     seqused_k=None, padded_lse=True):
    """What `aten._flash_attention_forward` computes (varlen, non-causal, grouped heads), from plain
    indexing of the tensors it is given (so strided views are read as the kernel reads them).
    lse: (seqs, Hq, max_q) padded, as FlashAttention-2 returns it, or (Hq, total_q)."""
    assert dropout_p == 0.0 and not is_causal
    Hq, Hk, hd = q.shape[1], k.shape[1], q.shape[2]
    seqs = cu_q.numel() - 1
    out = torch.full_like(q, float("nan"))
    lse = torch.full((seqs, Hq, max_q) if padded_lse else (Hq, q.shape[0]), float("nan"))
    for b in range(seqs):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        k1 = k0 + int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1])
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        qb = q[q0:q1].float().transpose(0, 1)                                      # (Hq, tq, hd)
        kb = k[k0:k1].float().transpose(0, 1).repeat_interleave(Hq // Hk, 0)       # (Hq, tk, hd)
        vb = v[k0:k1].float().transpose(0, 1).repeat_interleave(Hq // Hk, 0)
        s = qb @ kb.transpose(1, 2) * hd ** -0.5
        out[q0:q1] = (s.softmax(-1) @ vb).transpose(0, 1).to(q.dtype)
        if padded_lse:
            lse[b, :, :q1 - q0] = s.logsumexp(-1)
        else:
            lse[:, q0:q1] = s.logsumexp(-1)
    return out, lse, None, None, None


@pytest.mark.parametrize("padded_lse", [True, False])
@pytest.mark.parametrize("B,E,n,S,P", [(5, 3, 2, 7, 9), (1, 1, 1, 1, 1), (4, 2, 3, 1, 6)])
def test_flash_layout_equals_dense_masked(monkeypatch, padded_lse, B, E, n, S, P):
    """Ragged own lengths (1 = only the new token: the first decode step) and prompt lengths,
    n = 1, unused entries: the flash path's outputs equal the dense masked attention's."""
    monkeypatch.setattr(da, "_FLASH", lambda *a, **kw: varlen_reference(*a, **kw, padded_lse=padded_lse))
    from common.engine.kv.static_cache import KVCache
    from common.engine.model.model_config import ModelConfig
    cfg = ModelConfig(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(B * 100 + S)
    cache = KVCache(cfg, max_batch=6, max_seq_len=8, dtype=torch.float32, device="cpu", max_prompt_len=10)
    for t in cache.stores:
        t.copy_(torch.randn(t.shape, generator=g))
    own = torch.randint(0, S, (B,), generator=g)
    plen = torch.randint(1, P + 1, (E,), generator=g)
    plen[-1] = 0 if E > 1 else plen[-1]  # an unused entry
    back = torch.randint(0, E * n, (B,), generator=g)
    q_own = torch.randn(B, 3, 2, 8, generator=g)
    q_prompt = torch.randn(E * n, 3, 2, 8, generator=g)
    shape = (B, E, n, S, P)
    dense = da.attend(cache, 1, q_own, q_prompt, da.plan(cache, own, plen, back, shape, flash=False))
    flash = da.attend(cache, 1, q_own, q_prompt, da.plan(cache, own, plen, back, shape, flash=True))
    used = plen > 0  # an unused entry's rows are garbage either way (never read)
    for name, a, b in zip(("o_own", "lse_own", "o_prompt", "lse_prompt"), dense, flash):
        assert a.shape == b.shape, name
        if name.endswith("prompt"):
            a, b = a[used], b[used]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_token_major_view_reads_the_store_without_a_copy():
    store = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).view(2, 3, 5, 4)
    tm, row = da._token_major(store)
    assert tm.data_ptr() == store.data_ptr() and row == 3 * 5
    for r in range(2):
        for t in range(5):
            torch.testing.assert_close(tm[r * 3 * 5 + t], store[r, :, t])  # (Hkv, hd): token t of row r


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    save_hf("qwen2_bias", d)
    return load_model(str(d), tokenizer=False)[0]


PARAMS = [SamplingParams(max_new_tokens=9, temperature=0.9, n=3, seed=5),
          SamplingParams(max_new_tokens=8, temperature=1.2, top_k=5, top_p=0.9, n=2, seed=5)]


def _run(model, **kw):
    return [c for p in PARAMS for c in Sampler(model, max_batch=3, max_seq_len=48, **kw).generate(PROMPTS, p)]


def _same(a, b, atol):
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logp_tensor(), y.logp_tensor(), atol=atol, rtol=0)


def test_sampler_through_the_flash_layout(qwen2, monkeypatch):
    """The whole sampler (slot refills, shared prompts n > 1, bucketed shapes) with decode attention
    through the varlen layout CUDA runs: the same samples as the dense path."""
    dense = _run(qwen2)
    monkeypatch.setattr(da, "_FLASH", varlen_reference)
    _same(_run(qwen2, flash=True, static_shapes=True), dense, atol=1e-5)
