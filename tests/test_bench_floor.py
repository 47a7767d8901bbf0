"""bench/_floor.py: the FLOPs counted from a config agree with the model's own parameter count, and
the floor measures every GEMM of a step (tiny shapes)."""
import pytest
import torch

from bench._floor import _gemm_shapes, backend_ab, frac_of_floor, gemm_floor, gemms_in_place, step_flops
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import Linear, onednn_available, set_onednn
from common.contracts.ops import token_logp
from tests.tiny import save_hf


def test_linear_flops_are_six_per_parameter_per_token_and_the_floor_covers_every_gemm(tmp_path):
    save_hf("llama3_untied", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0]
    cfg, rows, tokens, scored = model.cfg, 3, 10, 12
    block_params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, Linear))
    f = step_flops(cfg, rows, tokens, scored)
    assert f["linear"] == 6 * rows * tokens * block_params  # forward 2, backward 4 per weight per token
    assert f["head"] == 6 * scored * model.lm_head.weight.numel()
    # causal pairs: 10 * 11 / 2 per row; 7 GEMMs of 2 FLOPs per pair, head dim and head
    assert f["attention"] == 7 * 2 * rows * 55 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    shapes = _gemm_shapes(cfg, rows * tokens, scored)
    assert sum(2 * m * k * n * c for m, k, n, c in shapes["linear"]) == f["linear"]  # the floor times them all
    assert sum(2 * m * k * n * c for m, k, n, c in shapes["head"]) == f["head"]
    floor = gemm_floor(cfg, rows, tokens, scored, reps=1)
    assert set(floor["parts_s"]) == {"linear", "head", "attention"} and floor["floor_s"] > 0
    assert floor["gemm_gflops_best"] > 0 and abs(floor["tflop"] - sum(f.values()) / 1e12) < 1e-12


@pytest.mark.parametrize("onednn", [False, True])
def test_gemms_in_place_sees_every_gemm_of_a_step_once(tmp_path, onednn):
    """The in-place check times the step's block and head GEMMs (exactly the FLOPs the floor counts
    for them: the attention kernel's own GEMMs are its part), and its re-runs leave the gradients
    as a plain step computes them."""
    if onednn and not onednn_available():
        pytest.skip("no oneDNN linear in this torch build")
    save_hf("llama3_untied", tmp_path)
    model = load_model(str(tmp_path), tokenizer=False)[0]
    rows, tokens = 3, 10
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.cfg.vocab_size, (rows, tokens), generator=g)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, 4:] = True
    old = set_onednn(onednn)
    try:
        def step():
            model.zero_grad(set_to_none=True)
            token_logp(model, x, 0.7, mask).sum().backward()
        step()
        want = [p.grad.clone() for p in model.parameters()]
        res = gemms_in_place(step)
    finally:
        set_onednn(old)
    f = step_flops(model.cfg, rows, tokens, int(mask[:, 1:].sum()))
    assert res["flops"] == f["linear"] + f["head"]
    assert res["in_place_s"] > 0 and res["again_s"] > 0 and res["by_shape"]
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)


def test_frac_of_floor_is_the_median_of_each_reps_own_ratio():
    """A floor measured in a slow moment pairs with the step beside it, not with the median step."""
    floors = [{"floor_s": 1.0}, {"floor_s": 2.0}, {"floor_s": 3.0}]
    assert frac_of_floor(floors, [2.0, 2.0, 3.0]) == 1.0  # ratios 0.5, 1, 1 (median floor / median step: 2/2 too)
    assert frac_of_floor(floors, [1.25, 4.0, 3.0]) == 0.8  # ratios 0.8, 0.5, 1 (median floor / median step: 2/3)
    with pytest.raises(ValueError):
        frac_of_floor(floors, [1.0, 2.0])


def test_backend_ab_times_each_weights_three_gemms_on_both_backends(tmp_path):
    """Every weight's forward, dX and dW GEMM (blocks and head) gets a per-call ratio, and the totals
    are the two backends' seconds of a step; the caller's backend is left as it was."""
    if not onednn_available():
        pytest.skip("no oneDNN linear in this torch build")
    save_hf("llama3_untied", tmp_path)
    cfg = load_model(str(tmp_path), tokenizer=False)[0].cfg
    old = set_onednn(False)
    try:
        res = backend_ab(cfg, 3, 10, 12, pairs=2)
        assert set_onednn(False) is False  # restored
    finally:
        set_onednn(old)
    by = res["by_gemm_onednn_over_aten"]
    assert len(by) == 3 * (5 + 1) and all(v > 0 for v in by.values())  # 5 block weights + the head, x3
    assert sum(k.endswith(" dw") for k in by) == 6 and any(k.startswith("head[0] ") for k in by)
    # seconds to significant digits, never rounded to 0 (a fast backend's total is under a millisecond
    # at these shapes), and the ratio is theirs
    assert res["onednn_s"] > 0 and res["aten_s"] > 0 and res["onednn_over_aten"] > 0
    assert res["onednn_over_aten"] == pytest.approx(res["onednn_s"] / res["aten_s"], rel=2e-3)
