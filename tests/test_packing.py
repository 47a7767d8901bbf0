"""Rows packed end to end (`train.pack_rows`, common/engine/model/packing.py): the same log-probs, losses
and gradients as the padded rows, for every family, with length-1 completions, rows without a
target, shared prompts, TBA / GRPO / AReaL's micro-batches and 2 trainer ranks; micro-batches
under a real-token budget; the config key. fp32 tiny models: the two paths differ only in the
order of float sums (GEMMs over another number of rows, attention per row), so values agree to
~1e-6 of their scale on any CPU (AVX2, AVX-512, AMX), where a wrong position, mask or row
boundary is off by O(0.1)."""
from __future__ import annotations

import pytest
import torch

from areal.algo import AReaL, AReaLConfig
from common.contracts.batch import Trajectory, collate
from common.contracts.config import ConfigError
from common.engine.model import packing
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.packing import PackedRows, layout_for, row_lengths
from common.engine.model.prefix import SharedPrefixes
from common.contracts.micro import micro_batches, pack_ffd
from common.contracts.ops import token_logp
from common.runtime.train_config import TrainConfig, check_config
from tba.algo import GRPO, TBA, GRPOConfig, TBAConfig
from tests.close import assert_scaled_close, assert_update_close, grad_scale
from tests.test_ranks import FP32, _batch as _rank_batch, _run, model_dir  # noqa: F401 (a fixture)
from tests.tiny import save_hf

V = 97
REL = 1e-5  # of the quantity's scale: fp32 sums in another order are ~1e-7 of it


def _model(arch, tmp_path):
    save_hf(arch, tmp_path)
    return load_model(str(tmp_path), tokenizer=False)[0].float()


def _trajs(sizes, seed=0, plen=(2, 9), clen=(1, 12), long=()):
    """Groups of samples of one prompt each; completions of random length, with those in `long`
    (their index) 40 tokens: a long tail."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid, n in enumerate(sizes):
        prompt = torch.randint(3, V, (int(torch.randint(*plen, (1,), generator=g)),), generator=g)
        for _ in range(n):
            c = 40 if len(out) in long else int(torch.randint(*clen, (1,), generator=g))
            out.append(Trajectory(prompt, torch.randint(3, V, (c,), generator=g), -torch.rand(c, generator=g),
                                  torch.zeros(c, dtype=torch.long), float(torch.rand(1, generator=g)), gid,
                                  ref_seq_logp=float(-10 * torch.rand(1, generator=g))))
    return out


def _pass(model, b, pack, mask=None, shared=False, T=0.7):
    """Log-probs of `b` and the gradients of a loss weighting every token differently."""
    mask = b.loss_mask if mask is None else mask
    model.zero_grad(set_to_none=True)
    model.pack_rows, model.share_prompts = pack, shared
    lp = token_logp(model, b.tokens, T, mask, prompt_lens=b.prompt_lens)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
    (lp * mask * w).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    (lp_a, g_a), (lp_b, g_b) = a, b
    assert_scaled_close(lp_a, lp_b, rel=REL)
    assert g_a.keys() == g_b.keys() and all(g.abs().sum() > 0 for g in g_b.values())
    scale = grad_scale(g_b)
    for n in g_b:
        assert_scaled_close(g_a[n], g_b[n], rel=REL, scale=scale, msg=n)


def test_layout_positions_restart_per_row():
    b = collate(_trajs([1, 1, 1], seed=1, clen=(1, 2)) + _trajs([1], seed=2, clen=(9, 10)))
    lengths = (b.prompt_lens + b.comp_lens).tolist()
    L = PackedRows.build(b.tokens, lengths)
    assert L.n_tokens == sum(lengths) < L.padded_tokens and L.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    rows, t = torch.nonzero(torch.arange(b.tokens.shape[1])[None] < torch.tensor(lengths)[:, None], as_tuple=True)
    i = L.index(rows, t)
    assert torch.equal(i, torch.arange(L.n_tokens)) and torch.equal(L.tokens[i], b.tokens[rows, t])
    assert torch.equal(L.pos[i], t) and L.max_pos == max(lengths)
    # a row ends after its last target; a row without one keeps a single token
    targets = torch.full((3, 6), -1)
    targets[0, 4], targets[1, 0] = 5, 5
    assert row_lengths(targets) == [5, 1, 1]
    with pytest.raises(ValueError, match="lengths"):
        PackedRows.build(b.tokens, [0] * len(b))


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3_qknorm", "neox_parallel_rot25", "gpt2", "gemma3"])
def test_packed_log_probs_and_gradients_equal_padded(arch, tmp_path):
    """Every family packs (RoPE, partial rotary, learned positions, sliding-window layers within
    their window); length-1 completions, a hole in the loss mask and a row without a target."""
    model = _model(arch, tmp_path)
    b = collate(_trajs([3, 1, 2, 1], seed=3, long=(2,)))
    assert (b.comp_lens == 1).any() and b.tokens.shape[1] <= 64  # gpt2's and gemma3's limits
    mask = b.loss_mask.clone()
    mask[0, int(b.prompt_lens[0])] = False  # a completion token that is no target
    mask[4] = False                         # a row with no target at all
    packed, padded = _pass(model, b, True, mask), _pass(model, b, False, mask)
    assert (packed[0][~mask] == 0).all()
    _assert_same(packed, padded)


def test_packed_rows_run_through_the_varlen_attention(tmp_path, monkeypatch):
    model = _model("llama_tied", tmp_path)
    model.checkpoint_layers = True  # the trainer's option: each block recomputed with the layout in backward
    calls = []
    real = PackedRows.attend
    monkeypatch.setattr(PackedRows, "attend", lambda self, *a: calls.append(self.n_tokens) or real(self, *a))
    b = collate(_trajs([1, 1, 1], seed=4, long=(0,)))
    packed = _pass(model, b, True)
    # each row up to its last predicting position: its last token predicts nothing and is left out;
    # every block once in the forward, once more as the backward recomputes it
    assert calls == [int((b.prompt_lens + b.comp_lens - 1).sum())] * 2 * model.cfg.num_hidden_layers
    model.checkpoint_layers = False
    _assert_same(packed, _pass(model, b, False))
    calls.clear()
    _pass(model, b, False)  # pack_rows off: the padded rows
    assert calls == []


def test_shared_prompts_only_where_they_beat_packed_rows(tmp_path):
    """Groups of even samples: each prompt once wins; a long tail: its padded suffix attention
    loses to the packed rows. Both give the padded rows' log-probs and gradients."""
    model = _model("qwen3_qknorm", tmp_path)
    even = collate(_trajs([4, 4], seed=5, plen=(20, 30), clen=(6, 9)))
    tail = collate(_trajs([4, 4], seed=6, plen=(3, 5), clen=(1, 4), long=(0,)))
    for b, kind in ((even, SharedPrefixes), (tail, PackedRows)):
        targets = torch.where(b.loss_mask, b.tokens, -1).roll(-1, 1)
        assert isinstance(layout_for(b.tokens, row_lengths(targets), b.prompt_lens, True), kind)
        _assert_same(_pass(model, b, True, shared=True), _pass(model, b, False))
    # without pack_rows, prompt sharing's rule is as before: MIN_SAVING of the padded tokens
    targets = torch.where(tail.loss_mask, tail.tokens, -1).roll(-1, 1)
    assert isinstance(layout_for(tail.tokens, row_lengths(targets), tail.prompt_lens, False), SharedPrefixes)


def test_real_token_budget_keeps_groups_whole():
    b = collate(_trajs([2, 3, 1], seed=7, long=(0, 3)))
    lengths = (b.prompt_lens + b.comp_lens).tolist()
    budget = 60
    for group_aligned in (False, True):
        parts = micro_batches(b, budget, group_aligned=group_aligned, packed=True)
        assert sorted(torch.cat(parts).tolist()) == list(range(len(b)))
        for p in parts:
            cost = sum(lengths[r] for r in p.tolist())
            assert cost <= budget or len(set(b.group_id[p].tolist()) if group_aligned else p.tolist()) == 1
            if group_aligned:  # a group never splits
                assert all(set(torch.nonzero(b.group_id == g).squeeze(1).tolist()) <= set(p.tolist())
                           for g in b.group_id[p].tolist())
    # a long row shares its micro-batch with short ones: over the budget padded, within it packed
    assert any(len(p) * max(lengths[r] for r in p.tolist()) > budget for p in micro_batches(b, budget, packed=True))
    assert all(len(p) == 1 or len(p) * max(lengths[r] for r in p.tolist()) <= budget for p in micro_batches(b, budget))
    assert pack_ffd([(2, 50, 60), (1, 50, 50)], 110, packed=True) == [[0, 1]]  # 110 real tokens, 150 padded
    assert pack_ffd([(2, 50, 60), (1, 50, 50)], 110) == [[0], [1]]


def _algo_grads(model, algo, batch, pack):
    model.pack_rows, model.share_prompts = pack, None if pack else False  # packed: the trainer's CPU default
    model.zero_grad(set_to_none=True)
    mbs = algo.minibatches(model, batch, 0)
    stats = algo.backward(model, mbs[0], step=0)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize("make", [
    lambda budget: TBA(TBAConfig(beta_init=0.5), 3, 4, 0.7, budget),
    lambda budget: GRPO(GRPOConfig(kl_coef=0.1), 3, 4, 0.7, budget),
    lambda budget: AReaL(AReaLConfig(n_minibatches=1, behav_imp_weight_cap=1.3), 3, 4, 0.7, budget, max_staleness=2),
], ids=["tba", "grpo", "areal"])
def test_losses_and_gradients_equal_padded(make, tmp_path):
    """The trainer's own loops (micro-batches under the budget, weighted by their share): packed
    micro-batches (fewer, fuller) give the padded ones' stats and gradient."""
    model = _model("qwen2_bias", tmp_path)
    b = collate(_trajs([4, 4, 4], seed=8, long=(1, 6)))
    with torch.no_grad():
        b.behav_logp = (token_logp(model, b.tokens, 0.7, b.loss_mask) + 0.1 * torch.randn(b.tokens.shape)) * b.loss_mask
    g_pad, s_pad = _algo_grads(model, make(100), b, False)
    g_pack, s_pack = _algo_grads(model, make(100), b, True)
    scale = grad_scale(g_pad)
    for n in g_pad:
        assert_scaled_close(g_pack[n], g_pad[n], rel=REL, scale=scale, msg=n)
    assert s_pack.keys() == s_pad.keys()
    # TBA's residual std is a per-micro-batch spread: the micro-batches differ, so only its loss compares
    for k in ["loss"] if isinstance(make(1), TBA) else s_pad:
        assert s_pack[k] == pytest.approx(s_pad[k], rel=1e-5, abs=1e-6), k


def test_two_ranks_packed_equal_one_rank_padded(model_dir, tmp_path):  # noqa: F811
    """train.pack_rows with 2 FSDP2 ranks: the step of one padded rank (micro-batch shares and
    zero-loss passes as with padding)."""
    batch = _rank_batch(model_dir)
    make = lambda: TBA(TBAConfig(beta_init=0.5, beta_final=0.5), 3, 4, 0.7, 30)  # noqa: E731
    one, _, s1 = _run(model_dir, tmp_path / "one", make(), [batch], world=1)
    two, _, s2 = _run(model_dir, tmp_path / "two", make(), [batch], world=2, pack_rows=True)
    init = FP32.load(model_dir, role="trainer", tokenizer=False)[0].state_dict()
    assert_update_close(init, two, one, msg="2 packed ranks vs 1 padded")
    for k in s1:
        assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-6), k


def test_config_key():
    assert check_config(TrainConfig()).pack_rows is True                       # CPU: measured faster
    assert check_config(TrainConfig(compile_blocks=True)).pack_rows is False   # compiled blocks run padded rows
    assert check_config(TrainConfig(pack_rows=False)).pack_rows is False
    with pytest.raises(ConfigError, match="compile_blocks"):
        check_config(TrainConfig(pack_rows=True, compile_blocks=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_in_bf16_autocast(device, tmp_path):
    """fp32 master weights under bf16 autocast (the trainer's bf16 setting), with activation
    checkpointing: per-row SDPA on CPU, the varlen flash kernel on CUDA (the only test that runs
    it); against the padded rows to bf16's rounding."""
    save_hf("qwen2_bias", tmp_path)
    model = load_model(str(tmp_path), device=device, tokenizer=False)[0].float()
    model.compute_dtype, model.checkpoint_layers = torch.bfloat16, True
    b = collate(_trajs([3, 2], seed=9, plen=(20, 40), clen=(1, 30), long=(0,))).to(device)
    with model.autocast():
        assert packing._flash_ok(torch.zeros(1, 4, 8, 8, device=device)) == (device == "cuda")
    (lp_p, g_p), (lp_f, g_f) = _pass(model, b, True), _pass(model, b, False)
    m = b.loss_mask
    assert (lp_p - lp_f)[m].abs().mean() < 0.02 and lp_f[m].abs().mean() > 1  # bf16: ~1e-2 nats per token
    for n in g_f:
        assert float((g_p[n] - g_f[n]).norm() / g_f[n].norm()) < 0.05, n
