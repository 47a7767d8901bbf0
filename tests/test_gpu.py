"""CUDA paths (bf16 model, sampler on GPU, trainer + generator on GPU). Skipped without CUDA."""
import pytest
import torch

from common.engine.sampler.decode_model import EAGER_SHAPES
from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.ops import token_logp
from tests.tiny import save_hf

pytestmark = pytest.mark.gpu


def _assert_logp_equals_trainer(model, outs, temperature: float = 0.7) -> None:
    """Every recorded log-prob equals the trainer's `token_logp` of the sampled sequence (bf16
    tolerance: the kernels differ)."""
    for c in outs:
        seq = torch.tensor([c.prompt_tokens + c.tokens], device="cuda")
        with torch.no_grad():
            full = token_logp(model, seq, temperature)[0, len(c.prompt_tokens):].float().cpu()
        torch.testing.assert_close(c.logp_tensor(), full, atol=5e-2, rtol=0)


def test_bf16_sampler_logp_matches_trainer(tmp_path):
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    assert model.dtype == torch.bfloat16  # the CUDA default
    s = Sampler(model, max_batch=8, max_seq_len=64)
    outs = s.generate([[5, 6, 7], [9] * 10], SamplingParams(max_new_tokens=12, temperature=0.7, n=3, seed=0))
    _assert_logp_equals_trainer(model, outs)


@pytest.mark.parametrize("dtype,graphs", [("fp32", False), ("auto", True)])
def test_train_on_cuda_with_ipc_weights(tmp_path, dtype, graphs):
    """TBA on one GPU: trainer and generator share cuda:0, weights through CUDA IPC; `auto` is bf16
    on CUDA, the generator decodes through captured graphs, each process under its memory cap."""
    from common.train import train
    from tests.test_e2e import _cfg, _prompts, _tba, toy_reward
    cfg = _cfg(tmp_path, steps=6, device="cuda")
    cfg.precision.dtype, cfg.gen.cuda_graphs = dtype, graphs
    if graphs:  # the one-GPU preset's memory caps (common/run_config.py: gpu_defaults), on device "cuda" without an index
        cfg.train.memory_fraction, cfg.gen.memory_fraction = 0.6, 0.25
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert last["version"] == 3 and last["gen_syncs"] >= 1
    # each process's allocator peak is logged (the memory plan's lines, measured): the trainer holds
    # at least fp32 master weights, grads and AdamW's moments (16 B a parameter), the generator its weights
    P = sum(p.numel() for p in load_model(cfg.model, tokenizer=False)[0].parameters())
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert 16 * P / 2**30 <= last["cuda_peak_gib"] < total and 2 * P / 2**30 <= last["gen_cuda_peak_gib"] < total


def test_areal_on_cuda_interrupts_within_the_staleness_bound(tmp_path):
    """AReaL on one GPU, bf16, captured decode: weight updates interrupt in-flight samples (re-prefill
    under the new weights) and no trained sample is staler than eta."""
    from common.train import train
    from tests.test_areal_e2e import _algo, _areal_cfg, _steps
    from tests.test_e2e import _prompts, toy_reward
    cfg = _areal_cfg(tmp_path, eta=1, steps=8, device="cuda")
    cfg.precision.dtype, cfg.gen.cuda_graphs = "auto", True
    last = train(cfg, _algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    rows = _steps(cfg)
    assert last["version"] == 8 and len(rows) == 8
    assert max(int(s) for r in rows for s in r["staleness_hist"]) <= 1


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


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_step_never_syncs_on_cuda(tmp_path, monkeypatch, flags):
    """Every decode step of a run (bucketed shapes, the CUDA attention branch) under
    set_sync_debug_mode("error"): a host read inside the step raises instead of stalling."""
    import common.engine.sampler.sampler as sampler_mod
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    real = sampler_mod.decode_step

    def guarded(*a):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*a)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    params = SamplingParams(max_new_tokens=10, temperature=0.0 if flags[1] else 0.8, top_k=5 if flags[0] else 0, n=3, seed=1)
    prompts = [[5, 6, 7], [9] * 10, [3, 4]]
    Sampler(model, max_batch=8, max_seq_len=48, static_shapes=True).generate(prompts, params)  # compiles (it syncs)
    monkeypatch.setattr(sampler_mod, "decode_step", guarded)
    s = Sampler(model, max_batch=8, max_seq_len=48, static_shapes=True)
    out = s.generate(prompts, params)
    assert len(out) == 9 and s.stats["decode_steps"] >= 9


def test_cuda_graphs_over_a_ragged_schedule(tmp_path):
    """Samples that stop at different times, more samples than slots: bucket changes, captures,
    replays; the samples equal the eager run at the same bucket shapes."""
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    prompts = [list(range(5, 5 + L)) for L in (3, 17, 8, 30, 12, 5)]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, n=5, stop_token_ids=(3, 4, 5, 6), seed=2)
    eager = Sampler(model, max_batch=16, max_seq_len=72, static_shapes=True).generate(prompts, params)
    g = Sampler(model, max_batch=16, max_seq_len=72, cuda_graphs=True)
    graphed = g.generate(prompts, params)
    assert g.graphed.stats["captures"] >= 3 and g.graphed.stats["replays"] > g.graphed.stats["captures"]
    assert len({len(c.tokens) for c in graphed}) > 3
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]


def test_head_backward_on_cuda_equals_cpu():
    """The head's backward on CUDA (GEMMs on transposed views) against the CPU path, fp32."""
    from common.engine.model.head import head_logp
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(37, 16, generator=g), torch.randn(101, 16, generator=g)
    y = torch.randint(0, 101, (37,), generator=g)
    grads = []
    for dev in ("cpu", "cuda"):
        hd, wd = h.to(dev).detach().requires_grad_(), w.to(dev).detach().requires_grad_()  # leaves on each device
        (head_logp(hd, wd, y.to(dev), temperature=0.7, chunk=8) * torch.linspace(0, 1, 37, device=dev)).sum().backward()
        grads.append((hd.grad.cpu(), wd.grad.cpu()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_graphs_dropped_when_the_rope_table_is_rebuilt(tmp_path):
    """A graph reads the model's RoPE table by address: a rebuilt (longer) table drops every graph,
    and the recaptured ones give the same samples."""
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    s = Sampler(model, max_batch=4, max_seq_len=48, cuda_graphs=True)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, n=2, seed=3)
    eager = Sampler(model, max_batch=4, max_seq_len=48, static_shapes=True)
    for x in (s, eager):
        x.generate([[5, 6, 7], [9] * 10], params)  # request ids 0, 1
    model.rope(torch.zeros(1, 1, dtype=torch.long, device="cuda"), bound=model._rope_cache[0].shape[0] + 1)
    again, want = (x.generate([[5, 6, 7], [9] * 10], params) for x in (s, eager))  # ids 2, 3
    assert s.graphed.stats["invalidations"] == 1
    assert [c.tokens for c in again] == [c.tokens for c in want]


@pytest.mark.parametrize("B,E,n,S,P", [(256, 16, 20, 384, 256), (7, 3, 2, 5, 9), (1, 1, 1, 1, 1)])
def test_flash_decode_attention_equals_dense(B, E, n, S, P):
    """The bundled flash kernel on the decode layouts (strided views of the cache, seqused_k, its
    log-sum-exp layout) against the dense masked attention, bf16, ragged lengths, unused entries."""
    from common.engine.sampler import decode_attention as da
    from common.engine.kv.static_cache import KVCache
    from common.engine.model.model_config import ModelConfig
    assert da.flash_available("cuda", torch.bfloat16), "no flash kernel with seqused_k in this torch build"
    cfg = ModelConfig(num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    g = torch.Generator(device="cuda").manual_seed(B + S)
    cache = KVCache(cfg, max_batch=B, max_seq_len=S + 3, dtype=torch.bfloat16, device="cuda", max_prompt_len=P + 2)
    for t in cache.stores:
        t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
    own = torch.randint(0, S, (B,), generator=g, device="cuda")
    plen = torch.randint(1, P + 1, (E,), generator=g, device="cuda")
    if E > 1:
        plen[-1] = 0
    back = torch.randint(0, E * n, (B,), generator=g, device="cuda")
    q_own = torch.randn(B, 3, 3, 64, generator=g, device="cuda").bfloat16()
    q_prompt = torch.randn(E * n, 3, 3, 64, generator=g, device="cuda").bfloat16()
    dense = da.attend(cache, 1, q_own, q_prompt, da.plan(cache, own, plen, back, (B, E, n, S, P), flash=False))
    flash = da.attend(cache, 1, q_own, q_prompt, da.plan(cache, own, plen, back, (B, E, n, S, P), flash=True))
    used = (plen > 0).cpu()
    for name, a, b in zip(("o_own", "lse_own", "o_prompt", "lse_prompt"), dense, flash):
        a, b = a.float().cpu(), b.float().cpu()
        if name.endswith("prompt"):
            a, b = a[used], b[used]
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


def _fused_vs_plain(tmp_path, dtype):
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False, dtype=dtype)
    prompts = [list(range(5, 5 + L)) for L in (3, 17, 8, 30, 12, 5)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, n=4, stop_token_ids=(3, 4, 5, 6))
    plain = Sampler(model, max_batch=16, max_seq_len=72, static_shapes=True, compile=False, flash=False).generate(prompts, params)
    c0 = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
    s = Sampler(model, max_batch=16, max_seq_len=72, cuda_graphs=True, compile=True)
    fused = s.generate(prompts, params)
    compiles = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0) - c0
    return s, plain, fused, compiles


def test_fused_decode_equals_plain_fp32(tmp_path):
    """Compiled layer body + captured graphs against the uncompiled step, fp32 (dense attention):
    the same greedy tokens over a ragged schedule; each piece compiled at most twice (a static
    first shape, then the dynamic one), not once per bucket."""
    s, plain, fused, compiles = _fused_vs_plain(tmp_path, torch.float32)
    assert not s.dec.flash and s.graphed.stats["captures"] >= 3
    assert compiles <= 6, compiles
    assert not any(EAGER_SHAPES.values()), EAGER_SHAPES
    assert [c.tokens for c in fused] == [c.tokens for c in plain]
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a.logp_tensor(), b.logp_tensor(), atol=1e-4, rtol=0)


def test_fused_decode_logp_equals_trainer_bf16(tmp_path):
    """bf16 with flash attention, the compiled layer body and captured graphs: every recorded
    log-prob equals the trainer's `token_logp` of the sampled sequence (bf16 tolerance)."""
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    s = Sampler(model, max_batch=16, max_seq_len=72, cuda_graphs=True)
    assert s.dec.flash and s.dec.compile
    prompts = [list(range(5, 5 + L)) for L in (3, 17, 8, 30, 12, 5)]
    outs = s.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.7, n=4, stop_token_ids=(3, 4), seed=0))
    _assert_logp_equals_trainer(model, outs)


def test_compiled_live_decode_down_to_a_single_row(tmp_path):
    """The compiled layer body on live shapes (nothing captured), bf16 + flash, over a schedule that
    ends with one row: the single-row recompile (sizes 0 and 1 are specialised) compiles, which it did
    not with size-oblivious tracing on torch 2.11 (inductor's CantSplit), and every recorded
    log-prob equals the trainer's."""
    save_hf("llama_tied", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    s = Sampler(model, max_batch=8, max_seq_len=64, cuda_graphs=False)
    assert s.dec.compile and s.dec.flash and s.graphed is None
    rows, real = [], s.dec.step

    def spy(cache, tok, *a, **kw):
        rows.append(tok.shape[0])
        return real(cache, tok, *a, **kw)
    s.dec.step = spy
    s.submit([9] * 12, SamplingParams(max_new_tokens=20, temperature=0.7, seed=0))  # slot 0: the last one left
    s.submit([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=0.7, n=4, seed=0))
    outs = []
    while s.has_work():
        outs += s.step()
    assert rows[0] == 5 and rows[-1] == 1, rows
    assert not any(EAGER_SHAPES.values()), EAGER_SHAPES  # compiled at one row, not fallen back to eager
    _assert_logp_equals_trainer(model, outs)


@pytest.mark.parametrize("arch", ["llama_tied", "neox_parallel_rot25", "gpt2", "gemma3"])
@pytest.mark.parametrize("kv_layout", ["static", "paged"])
def test_every_family_through_the_fused_cuda_step(tmp_path, arch, kv_layout):
    """The papers' families beside Qwen (TBA's Pythia is GPT-NeoX: parallel residual, a quarter
    rotary; its red-teaming attacker GPT-2: learned positions, tied head; Gemma 3: sliding-window and
    full layers with their own RoPE, within the window) through the CUDA step the generators run: bf16, the compiled
    layer body, captured graphs, flash decode attention where the family takes it, both KV layouts
    (the paged pool small enough to preempt). Each recorded log-prob equals the trainer's."""
    save_hf(arch, tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    paged = dict(page_size=16, kv_tokens=320) if kv_layout == "paged" else {}
    s = Sampler(model, max_batch=16, max_seq_len=64, cuda_graphs=True, kv_layout=kv_layout, **paged)
    prompts = [list(range(5, 5 + L)) for L in (3, 17, 8, 30, 12, 5)]
    outs = s.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.7, n=4, seed=0))
    assert s.graphed.stats["replays"] > 0 and len(outs) == 24
    assert kv_layout == "static" or s.stats["preemptions"] > 0
    _assert_logp_equals_trainer(model, outs)


def test_paged_kv_under_cuda_graphs_and_preemption(tmp_path):
    """The paged cache on CUDA, decoding through captured graphs with overlap and the flash kernel over
    gathered pages, in a pool small enough to preempt: the static cache's greedy tokens."""
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    prompts = [[5, 6, 7], [9] * 10, [3, 4], [11] * 17, [8]]
    params = SamplingParams(max_new_tokens=40, temperature=0, n=2)
    static = Sampler(model, max_batch=4, max_seq_len=64, kv_layout="static", cuda_graphs=True).generate(prompts, params)
    s = Sampler(model, max_batch=4, max_seq_len=64, cuda_graphs=True, overlap=True, page_size=16, kv_tokens=160)
    paged = s.generate(prompts, params)
    assert s.stats["preemptions"] > 0 and s.graphed.stats["replays"] > 0
    assert [c.tokens for c in paged] == [c.tokens for c in static]
    _assert_logp_equals_trainer(model, paged, temperature=1.0)
