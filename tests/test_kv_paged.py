"""The sampler on the paged KV cache (common/engine/kv/paged_cache.py, preempt.py) against the static one:
the same tokens, greedy and sampled, with and without preemption, overlap, interruption, a
pending finish-mode update and an abort while samples wait preempted; every page given back; a
sample that could never fit refused at submit; the flash layout over gathered pages."""
import pytest
import torch

from common.engine.sampler import decode_attention as da
from common.engine.checkpoints.hf_io import load_model
from common.engine.kv.paged_cache import PagedKVCache
from common.engine.model.model_config import ModelConfig
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from tests.test_decode_attention import varlen_reference
from tests.test_sampler import PROMPTS
from tests.tiny import save_hf

GREEDY = SamplingParams(max_new_tokens=30, temperature=0, n=2)
SAMPLED = SamplingParams(max_new_tokens=27, temperature=1.0, top_p=0.9, n=3, seed=11)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_hf("llama3_untied", d)
    return load_model(str(d), tokenizer=False)[0]


def _gen(model, params, **kw):
    s = Sampler(model, max_batch=4, max_seq_len=64, **kw)
    return s, s.generate(PROMPTS, params)


def _same(a, b):
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):  # the same draws from K/V refilled by a batched prefill: rounding only
        torch.testing.assert_close(torch.tensor(x.logp), torch.tensor(y.logp), atol=1e-4, rtol=0)
        assert x.versions == y.versions and x.finish_reason == y.finish_reason


def _all_returned(s):
    pool = s.cache.pool
    assert pool.n_free == pool.n_pages and not any(pool.ref), "pages still held after the run"


@pytest.mark.parametrize("arch", ["llama3_untied", "qwen3_qknorm", "neox_parallel_rot25", "gpt2", "gemma3"])
def test_paged_equals_static_and_survives_preemption(arch, tmp_path):
    """Greedy tokens identical paged (roomy and tight: preempting) vs static, every family."""
    save_hf(arch, tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0]
    static = _gen(model, GREEDY, kv_layout="static")[1]
    s, roomy = _gen(model, GREEDY, page_size=8)
    _same(static, roomy)
    assert s.stats["preemptions"] == 0
    s, tight = _gen(model, GREEDY, page_size=4, kv_tokens=64)  # 16 pages for 4 rows of up to 47 tokens
    _same(static, tight)
    assert s.stats["preemptions"] > 0 and s.stats["reprefill_tokens"] > 0 and s.stats["kv_peak_occupancy"] == 1.0
    assert sum(c.n_preemptions for c in tight) == s.stats["preemptions"]
    _all_returned(s)


@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_tokens_survive_preemption(llama, overlap):
    static = _gen(llama, SAMPLED, kv_layout="static", overlap=overlap)[1]
    s, tight = _gen(llama, SAMPLED, page_size=4, kv_tokens=60, overlap=overlap)
    _same(static, tight)
    assert s.stats["preemptions"] > 0
    _all_returned(s)


def test_memory_follows_the_budget_not_the_slots(llama):
    static = Sampler(llama, max_batch=16, max_seq_len=512, kv_layout="static")
    paged = Sampler(llama, max_batch=16, max_seq_len=512, kv_tokens=1024, page_size=16)
    assert paged.cache.nbytes() * 8 < static.cache.nbytes()
    assert paged.cache.pool.n_pages == 64  # + the scratch page in memory


def test_a_sample_that_cannot_fit_the_pool_is_refused_at_submit(llama):
    s = Sampler(llama, max_batch=4, max_seq_len=64, page_size=4, kv_tokens=40)
    with pytest.raises(ValueError, match=r"needs 56 tokens of KV pool \(14 pages of 4\); the pool has 40: raise gen.kv_tokens to 56"):
        s.submit(list(range(1, 11)), SamplingParams(max_new_tokens=40))
    assert not s.queue
    s.submit(list(range(1, 11)), SamplingParams(max_new_tokens=20))  # 3 + 6 pages: fits


def _run_with_update(model, mode, **kw):
    """Step a run; after 12 steps an update (same weights, new version) in `mode`; return all samples."""
    s = Sampler(model, max_batch=4, max_seq_len=64, **kw)
    for p in PROMPTS:
        s.submit(p, SAMPLED)
    s.seed = SAMPLED.seed
    out, steps = [], 0
    while s.has_work():
        out += s.step()
        steps += 1
        if steps == 12:
            s.update_weights(lambda m: None, 1, mode=mode)
    return s, sorted(out, key=lambda c: (c.request_id, c.sample_idx))


@pytest.mark.parametrize("mode", ["interrupt", "finish"])
def test_weight_updates_while_samples_wait_preempted(llama, mode):
    _, static = _run_with_update(llama, mode, kv_layout="static")
    s, tight = _run_with_update(llama, mode, page_size=4, kv_tokens=60)
    assert s.stats["preemptions"] > 0
    assert [c.tokens for c in tight] == [c.tokens for c in static]
    # which token an update lands on depends on the schedule (preemption changes it); each sample's
    # versions only ever step from 0 to 1, and every sample in flight then, preempted ones too, counts it
    assert all(c.versions == sorted(c.versions) and set(c.versions) <= {0, 1} for c in tight)
    assert sum(c.n_interrupts for c in tight) == s.stats["interrupts"]
    if mode == "finish":  # nothing sampled on the old weights after the update was asked for
        assert s.stats["interrupts"] == 0
    _all_returned(s)


def test_abort_hands_back_preempted_samples_partial(llama):
    s = Sampler(llama, max_batch=4, max_seq_len=64, page_size=4, kv_tokens=60)
    for p in PROMPTS:
        s.submit(p, SAMPLED)
    done = []
    while not s.preempted:
        done += s.step()
    waiting = {(q.out.request_id, q.out.sample_idx): len(saved[0]) for q, saved in s.preempted}
    out = s.abort_all()
    got = {(c.request_id, c.sample_idx): c for c in out}
    for key, n in waiting.items():
        assert got[key].finish_reason == "interrupted" and len(got[key].tokens) == n == len(got[key].logp)
    assert not s.has_work()
    _all_returned(s)


@pytest.mark.parametrize("padded_lse", [True, False])
def test_flash_layout_over_pages_equals_dense(monkeypatch, padded_lse):
    """The flash path over gathered pages (the CUDA kernel's semantics, run by a reference on CPU)
    equals the dense path, with tables that scatter rows over the pool."""
    monkeypatch.setattr(da, "_FLASH", lambda *a, **kw: varlen_reference(*a, **kw, padded_lse=padded_lse))
    cfg = ModelConfig(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(cfg, max_batch=4, max_seq_len=24, dtype=torch.float32, device="cpu", kv_tokens=64 * 4,
                         page_size=4, max_prompt_len=10)
    for t in cache.stores:
        t.copy_(torch.randn(t.shape, generator=g))
    cache.own_table.copy_(torch.randperm(64, generator=g)[:4 * 7].view(4, 7) + 1)
    cache.prompt_table.copy_(torch.randperm(64, generator=g)[:5 * 3].view(5, 3) + 1)
    B, E, n, S, P = 4, 2, 3, 17, 9
    own = torch.tensor([0, 16, 5, 9])
    plen = torch.tensor([9, 4])
    back = torch.tensor([0, 3, 1, 4])
    q_own, q_prompt = torch.randn(B, 3, 2, 8, generator=g), torch.randn(E * n, 3, 2, 8, generator=g)
    dense = da.attend(cache, 1, q_own, q_prompt, da.plan(cache, own, plen, back, (B, E, n, S, P), flash=False))
    flash = da.attend(cache, 1, q_own, q_prompt, da.plan(cache, own, plen, back, (B, E, n, S, P), flash=True))
    for name, a, b in zip(("o_own", "lse_own", "o_prompt", "lse_prompt"), dense, flash):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_rows_at_equal_memory_simulation_drives_the_allocator_sanely():
    """bench/long_outputs.py (a): answers all at the cap still run at least as many rows paged as
    static (rows at different stages share the pool: about twice, paid in re-prefill), and
    long-tailed ones many more."""
    from bench.long_outputs import lognormal_lengths, rows_at_equal_memory
    full = rows_at_equal_memory([1024] * 200, 64, 1024, 8 * (64 + 1024), 64)
    assert full["static_rows"] == 8 and 8 <= full["paged_rows_mean"] <= 2 * 8 * 17 / 16
    assert full["preemptions"] > 0 and full["reprefill_over_generated"] > 0
    tail = rows_at_equal_memory(lognormal_lengths(600, 128, 1.0, 1024), 64, 1024, 8 * (64 + 1024), 64)
    assert tail["rows_paged_over_static"] > 3 and tail["preemptions"] >= 0


def test_cpu_own_part_in_length_groups_gives_the_same_samples(llama, monkeypatch):
    """One long sample among short ones refilling the other slots: on a CPU the own part reads rows
    in groups of similar length (`PagedKVCache.own_groups`), and the samples stay the static cache's."""
    prompts = [[1 + i, 2, 3 + i][: 1 + i % 3] for i in range(12)]
    params = [SamplingParams(max_new_tokens=200 if i == 0 else 6 + 5 * i, temperature=1.0, seed=3) for i in range(12)]

    def run(**kw):
        s = Sampler(llama, max_batch=4, max_seq_len=224, **kw)
        s.seed = 3
        for p, q in zip(prompts, params):
            s.submit(p, q)
        out = []
        while s.has_work():
            out += s.step()
        return sorted(out, key=lambda c: (c.request_id, c.sample_idx))

    calls = []
    group_kv = PagedKVCache.group_kv
    monkeypatch.setattr(PagedKVCache, "group_kv", lambda self, *a: calls.append(a[2:]) or group_kv(self, *a))
    static, paged = run(kv_layout="static"), run(page_size=16)
    _same(static, paged)
    assert len(calls) > 100 and min(c[1] for c in calls) < 64 < max(c[1] for c in calls)  # short groups and long


@pytest.mark.parametrize("page_size", [4, 64])
def test_the_default_pool_admits_every_batch_the_static_cache_ran(llama, page_size):
    """The default budget holds every slot at full length plus the admission watermark on top: the
    same steps as static slots, all rows at once, nothing preempted."""
    params = SamplingParams(max_new_tokens=60, temperature=0, n=1)  # every sample to the end of its slot
    runs = {}
    for layout in ("static", "paged"):
        s = Sampler(llama, max_batch=10, max_seq_len=60, max_prompt_len=17, kv_layout=layout, page_size=page_size)
        runs[layout] = (s.generate((PROMPTS * 2)[:10], params), s.stats)
    _same(runs["static"][0], runs["paged"][0])
    assert runs["paged"][1]["decode_steps"] == runs["static"][1]["decode_steps"]
    assert runs["paged"][1]["preemptions"] == 0


def test_the_cuda_default_pool_stays_within_the_process_cap(monkeypatch):
    """On CUDA the default pool is KV_FRACTION of the memory this process may still take: the
    device's free memory, or less under `--gen.memory_fraction`'s cap (stand-ins for the CUDA calls)."""
    from common.engine.kv import budget as kv_budget
    cfg = ModelConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
    per_token = 2 * 2 * 2 * 16 * 2  # K and V, layers, kv heads, head dim, bf16 bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * 2**30)
    for cap, room in ((1.0, 60), (0.25, 18)):  # uncapped: the free 60 GiB; capped: 20 GiB less the 2 reserved
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d, cap=cap: cap)
        got = kv_budget.default_kv_tokens(cfg, "cuda", torch.bfloat16, 10**6, 32768, 256, 256)
        assert got == int(room * 2**30 * kv_budget.KV_FRACTION) // per_token
    small = kv_budget.default_kv_tokens(cfg, "cuda", torch.bfloat16, 2, 100, 10, 16)  # at most what static would hold
    assert small == kv_budget.default_kv_tokens(cfg, "cpu", torch.bfloat16, 2, 100, 10, 16) < 1000
