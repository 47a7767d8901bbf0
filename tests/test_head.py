"""The chunked output head (common/engine/model/head.py) and per-layer activation checkpointing give
today's unchunked log-probs and gradients, with and without bf16 autocast."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from common.engine.model import head
from common.engine.model.head import head_logp
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import set_onednn
from common.contracts.ops import token_logp
from tests.close import assert_scaled_close
from tests.tiny import save_hf


def _reference(h, w, y, T):
    """The unchunked head: full logits, log-softmax, gather (what token_logp did before)."""
    z = F.linear(h, w).float() / T
    return z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


@pytest.mark.parametrize("chunk", [3, 7, 64])  # several chunks (recomputed backward), uneven, one chunk (kept softmax)
@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("onednn", [True, False])  # backward GEMMs on oneDNN or ATen, both on transposed views
@pytest.mark.parametrize("block_rows", [None, 3])  # the softmax's row blocks: one, or several (uneven)
def test_head_logp_matches_unchunked_fp32(chunk, T, onednn, block_rows, monkeypatch):
    if block_rows:
        monkeypatch.setattr(head, "_ROW_BLOCK_BYTES", 4 * 50 * block_rows)
    old = set_onednn(onednn)
    try:
        _check_fp32(chunk, T)
    finally:
        set_onednn(old)


def test_softmax_row_blocks_only_on_cpu():
    """Cache-sized row blocks are a CPU matter; on a GPU each block is ~10 kernel launches, so the
    softmax takes a chunk in one step (at V = 49152: 273 steps per chunk otherwise)."""
    V = 49152
    assert head.row_block(2730, V, torch.device("cpu")) == head._ROW_BLOCK_BYTES // (4 * V) == 10
    assert head.row_block(2730, V, torch.device("cuda")) == 2730
    assert head.row_block(3, 10**9, torch.device("cpu")) == 1


def _check_fp32(chunk, T):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (20,), generator=g)
    c = torch.randn(20, generator=g)  # a loss that weights positions differently
    want = _reference(h, w, y, T)
    gh, gw = torch.autograd.grad((want * c).sum(), (h, w))
    got = head_logp(h, w, y, T, chunk=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gh2, gw2 = torch.autograd.grad((got * c).sum(), (h, w))
    torch.testing.assert_close(gh2, gh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw2, gw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 64])
def test_head_logp_under_bf16_autocast(chunk):
    """bf16 GEMMs as F.linear under autocast would run them, fp32 master gradients."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(24, 32, generator=g, requires_grad=True)
    w = torch.randn(40, 32, generator=g, requires_grad=True)
    y = torch.randint(0, 40, (24,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(h, w, y, 0.7)
        got = head_logp(h, w, y, 0.7, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # same bf16 GEMM, same fp32 reductions
    gh, gw = torch.autograd.grad(want.sum(), (h, w))
    gh2, gw2 = torch.autograd.grad(got.sum(), (h, w))
    assert gh2.dtype == gw2.dtype == torch.float32
    torch.testing.assert_close(gh2, gh, rtol=2e-2, atol=2e-2)  # bf16 rounding of each chunk's dW
    torch.testing.assert_close(gw2, gw, rtol=2e-2, atol=2e-2)


def test_head_logp_empty_selection():
    w = torch.randn(10, 4, requires_grad=True)
    out = head_logp(torch.zeros(0, 4), w, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)
    out.sum().backward()  # connected to the graph, zero gradient
    assert w.grad is not None and not w.grad.any()


def _unchunked_token_logp(model, tokens, T, mask):
    """token_logp as it was before the chunked head: full logits of the loss positions."""
    sel = mask[:, 1:]
    logits = model.lm_head(model.hidden(tokens)[:, :-1][sel])
    lp = torch.zeros(sel.shape).masked_scatter(sel, _reference_from_logits(logits, tokens[:, 1:][sel], T))
    return F.pad(lp, (1, 0))


def _reference_from_logits(logits, y, T):
    z = logits.float() / T
    return z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3_qknorm"])
def test_token_logp_and_grads_match_unchunked_path(tmp_path, arch, monkeypatch):
    save_hf(arch, tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0].train()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 97, (4, 12), generator=g)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 5:] = True
    mask[1, 9:] = False  # a shorter completion
    want = _unchunked_token_logp(model, tokens, 0.7, mask)
    ref = torch.autograd.grad(want.sum(), list(model.parameters()))
    monkeypatch.setattr("common.engine.model.head.LOGIT_BUDGET_BYTES", 5 * 4 * 97)  # 5 positions per chunk
    got = token_logp(model, tokens, 0.7, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.sum(), list(model.parameters())), ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_same_loss_and_grads(tmp_path):
    save_hf("llama3_untied", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0].train()
    tokens = torch.randint(3, 97, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 10, dtype=torch.bool)

    calls = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))

    def loss_and_grads():
        calls.clear()
        model.zero_grad(set_to_none=True)
        loss = token_logp(model, tokens, 1.0, mask).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]
    l0, g0 = loss_and_grads()
    assert len(calls) == 1
    model.checkpoint_layers = True
    l1, g1 = loss_and_grads()
    assert len(calls) == 2  # the block ran again in backward: its activations were not kept
    assert l1 == l0
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("onednn", [True, False])
def test_compiled_blocks_same_loss_and_grads(tmp_path, onednn):
    """train.compile_blocks: the same log-probs and gradients as eager (fp32 sums reordered by the
    fusion: within 1e-5), with activation checkpointing too, and a new batch shape reuses the
    compiled function (dynamic shapes) instead of failing."""
    old = set_onednn(onednn)
    try:
        save_hf("qwen3_qknorm", tmp_path)  # q/k norms and biases: every part of a block
        model = load_model(str(tmp_path), tokenizer=False)[0].train()

        def loss_and_grads(rows, cols):
            tokens = torch.randint(3, 97, (rows, cols), generator=torch.Generator().manual_seed(rows))
            mask = torch.zeros(rows, cols, dtype=torch.bool)
            mask[:, cols // 2:] = True
            model.zero_grad(set_to_none=True)
            lp = token_logp(model, tokens, 0.7, mask)
            lp.sum().backward()
            return lp.detach(), [p.grad.clone() for p in model.parameters()]
        for rows, cols in [(3, 10), (5, 7)]:
            model.compile_blocks, model.checkpoint_layers = False, False
            want, gw = loss_and_grads(rows, cols)
            for ckpt in (False, True):
                model.compile_blocks, model.checkpoint_layers = True, ckpt
                got, gg = loss_and_grads(rows, cols)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                # sums reordered by the fusion: within rounding of the model's gradient scale (tests/close.py)
                scale = max(g.abs().max().item() for g in gw)
                for a, b in zip(gg, gw):
                    assert_scaled_close(a, b, rel=1e-5, scale=scale, rtol=1e-4)
        assert counters["stats"]["unique_graphs"] >= 1  # it really ran compiled
        assert not counters["graph_break"], dict(counters["graph_break"])  # and the whole block is one graph
    finally:
        set_onednn(old)


def test_compiled_blocks_under_bf16_autocast(tmp_path):
    """train.compile_blocks with the trainer's bf16 mixed precision (fp32 weights, blocks under CPU
    autocast, as `--precision.dtype=bf16` runs them): log-probs and gradients within bf16 rounding
    of the uncompiled autocast pass, one graph per block call (no breaks)."""
    save_hf("qwen3_qknorm", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0].train()
    model.compute_dtype = torch.bfloat16
    tokens = torch.randint(3, 97, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 6:] = True

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        lp = token_logp(model, tokens, 0.7, mask)
        lp.sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])
    breaks = sum(counters["graph_break"].values())
    model.compile_blocks = False
    want, gw = loss_and_grads()
    model.compile_blocks = True
    got, gg = loss_and_grads()
    assert sum(counters["graph_break"].values()) == breaks
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)  # bf16 GEMMs, fused differently
    assert (gg - gw).norm() <= 3e-2 * gw.norm(), float((gg - gw).norm() / gw.norm())
