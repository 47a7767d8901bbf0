"""Rows sharing a prompt run it once (common/engine/model/prefix.py through `token_logp(prompt_lens=)`):
the same log-probs and the same gradients as every row in full, for every architecture, with
ragged prompts, ragged completions, loss masks with holes, and rows that share nothing. Float64
models, so that only the head's fp32 arithmetic (common/engine/model/head.py) separates the two paths:
gradients agree to ~4e-8 of their norm, where a wrong mask or position would be off by O(0.1)."""
import pytest
import torch

from common.contracts.batch import Trajectory, collate
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.prefix import SharedPrefixes
from common.contracts.ops import reference_seq_logp, seq_logp, token_logp
from tests.tiny import ARCHS, save_hf

V = 97


def _model(arch, tmp_path, dtype=torch.float64):
    save_hf(arch, tmp_path)
    m = load_model(str(tmp_path), tokenizer=False)[0].to(dtype)
    return m


def _groups(sizes, seed=0, plen=(3, 9), clen=(1, 8)):
    """Trajectories: one random prompt per group, each sample its own random completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid, n in enumerate(sizes):
        prompt = torch.randint(3, V, (int(torch.randint(*plen, (1,), generator=g)),), generator=g)
        for _ in range(n):
            c = torch.randint(3, V, (int(torch.randint(*clen, (1,), generator=g)),), generator=g)
            out.append(Trajectory(prompt=prompt, completion=c, logp=torch.zeros(len(c)),
                                  versions=torch.zeros(len(c), dtype=torch.long), reward=0.0, group_id=gid))
    return out


def _assert_grads_close(g_s, g_f, rel: float):
    """Each parameter's gradient within `rel` of the full rows' in norm (elementwise tolerances
    would judge entries that are noise at fp32 rounding)."""
    assert g_s.keys() == g_f.keys()
    for n in g_f:
        d = float((g_s[n] - g_f[n]).norm() / g_f[n].norm().clamp(min=1e-30))
        assert d < rel, (n, d)


def _both(model, b, mask=None, T=0.7):
    """(shared, full) log-probs and the gradients of a loss on each."""
    mask = b.loss_mask if mask is None else mask
    res = []
    for plens in (b.prompt_lens, None):
        model.zero_grad(set_to_none=True)
        lp = token_logp(model, b.tokens, T, mask, prompt_lens=plens)
        w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)).to(lp.device)
        (lp * mask * w).sum().backward()  # every token its own weight: a misplaced one shows
        res.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return res


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_shared_prompts_give_the_full_rows_log_probs_and_gradients(arch, tmp_path):
    model = _model(arch, tmp_path)
    b = collate(_groups([4, 1, 3, 2]))
    (lp_s, g_s), (lp_f, g_f) = _both(model, b)
    assert lp_f.abs().sum() > 0 and (lp_s[~b.loss_mask] == 0).all()
    torch.testing.assert_close(lp_s, lp_f, rtol=1e-6, atol=1e-8)
    assert len(g_f) == len(list(model.parameters())) and all(g.abs().sum() > 0 for g in g_f.values())
    _assert_grads_close(g_s, g_f, 1e-6)


def test_packing_runs_each_prompt_once_and_drops_padding():
    b = collate(_groups([4, 1, 3], seed=3))
    lengths = b.prompt_lens + b.comp_lens
    L = SharedPrefixes.build(b.tokens, b.prompt_lens, lengths)
    assert L.n_prefixes == 3
    assert L.n_tokens == sum(int(b.prompt_lens[i]) for i in (0, 4, 5)) + int(b.comp_lens.sum())
    assert L.n_tokens < L.padded_tokens == b.tokens.numel()
    # every row's every position maps to the packed token it is, at the position it has
    rows, t = torch.nonzero(torch.arange(b.tokens.shape[1])[None] < lengths[:, None], as_tuple=True)
    i = L.index(rows, t)
    assert torch.equal(L.tokens[i], b.tokens[rows, t]) and torch.equal(L.pos[i], t)


def test_a_hole_in_the_loss_mask_and_rows_sharing_nothing(tmp_path):
    model = _model("llama_tied", tmp_path)
    b = collate(_groups([1, 1, 1], seed=5, clen=(4, 9)) + _groups([3], seed=6))
    mask = b.loss_mask.clone()
    mask[0, int(b.prompt_lens[0]) + 1] = False  # a completion token that is no target
    (lp_s, g_s), (lp_f, g_f) = _both(model, b, mask)
    assert lp_s[0, int(b.prompt_lens[0]) + 1] == 0
    torch.testing.assert_close(lp_s, lp_f, rtol=1e-6, atol=1e-8)
    _assert_grads_close(g_s, g_f, 1e-6)


def test_equal_prompts_share_whatever_their_group_ids():
    t = _groups([2], seed=7)
    t[1].group_id = 99  # the same prompt sampled twice under two ids: content decides
    b = collate(t)
    assert SharedPrefixes.build(b.tokens, b.prompt_lens, b.prompt_lens + b.comp_lens).n_prefixes == 1


def test_no_saving_runs_the_rows_unpacked(tmp_path, monkeypatch):
    """Distinct prompts of 20 tokens, one completion token each: packing would drop one token in
    21 (under MIN_SAVING), so the plain pass runs (and `share_prompts=False` always runs it)."""
    model = _model("llama_tied", tmp_path)
    calls = []
    monkeypatch.setattr(SharedPrefixes, "attend", lambda self, *a: calls.append(1) or pytest.fail("packed"))
    b = collate(_groups([1, 1], seed=8, plen=(20, 21), clen=(1, 2)))
    token_logp(model, b.tokens, 1.0, b.loss_mask, prompt_lens=b.prompt_lens)
    model.share_prompts = False
    b = collate(_groups([3], seed=8))
    token_logp(model, b.tokens, 1.0, b.loss_mask, prompt_lens=b.prompt_lens)
    assert calls == []


def test_reference_pass_shares_and_agrees(tmp_path):
    model = _model("qwen3_qknorm", tmp_path)
    trajs = _groups([5, 2], seed=9)
    with torch.no_grad():
        ref = reference_seq_logp(model, trajs, 0.7)
        b = collate(trajs)
        full = seq_logp(token_logp(model, b.tokens, 0.7, b.loss_mask), b.loss_mask)
    torch.testing.assert_close(ref, full, rtol=1e-6, atol=1e-8)


def test_fp32_with_checkpointing_and_the_machine_attention(tmp_path):
    """The trainer's setting: fp32, activation checkpointing, whatever causal kernel this machine
    picked for the prompts' attention; close to the full rows at fp32 rounding."""
    model = _model("llama_tied", tmp_path, torch.float32)
    model.checkpoint_layers = True
    b = collate(_groups([4, 4], seed=10, plen=(20, 40), clen=(5, 30)))
    (lp_s, g_s), (lp_f, g_f) = _both(model, b)
    torch.testing.assert_close(lp_s, lp_f, rtol=1e-4, atol=1e-5)
    _assert_grads_close(g_s, g_f, 1e-4)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_shared_prompts_in_the_trainers_precisions(tmp_path, device, dtype):
    """fp32 master weights, forward under autocast to `dtype` (the trainer's bf16 setting); on
    CUDA the suffixes' masked attention runs with expanded heads (SDPA's memory-efficient kernel).
    fp32 against the full rows at fp32 rounding; bf16 by the gradients' relative distance."""
    save_hf("qwen2_bias", tmp_path)
    model = load_model(str(tmp_path), device=device, tokenizer=False)[0].float()
    model.compute_dtype, model.share_prompts = dtype, True  # on CUDA it is off unless asked for
    b = collate(_groups([6, 3, 1, 4], seed=11, plen=(20, 60), clen=(5, 40))).to(device)
    (lp_s, g_s), (lp_f, g_f) = _both(model, b)
    if dtype == torch.float32:
        torch.testing.assert_close(lp_s, lp_f, rtol=1e-4, atol=1e-5)
        _assert_grads_close(g_s, g_f, 1e-4)
        return
    m = b.loss_mask
    assert (lp_s - lp_f)[m].abs().mean() < 0.02 and lp_f[m].abs().mean() > 1  # bf16: ~1e-2 nats per token
    _assert_grads_close(g_s, g_f, 0.05)
