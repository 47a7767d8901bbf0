"""bench/_floor.py: the FLOPs counted from a config agree with the model's own parameter count, and
the floor measures every GEMM of a step (tiny shapes)."""
from bench._floor import _gemm_shapes, gemm_floor, step_flops
from common.engine.hf_io import load_model
from common.engine.linear import Linear
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
