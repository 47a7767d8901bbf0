"""bench/gpu.py at the papers' shapes (`--arch`): the card lookup, the decode step's bandwidth floor and
the trainer's MFU on known numbers, and a smoke run on the CPU of each family at tiny sizes, each
giving its ratios and targets in the one JSON line."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench._gpu_paper import arch_config, card, decode_floor, hub_id, kv_bytes_per_token, mfu, paper_figures

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"pythia-1b": "gpt_neox", "rho-1b": "llama", "r1-qwen-1.5b": "qwen2"}


def test_card_from_its_name_or_the_flags():
    assert card("NVIDIA H100 80GB HBM3") | {} == {"gpu": "NVIDIA H100 80GB HBM3", "mem_bw_bytes_s": 3.35e12,
                                                  "peak_flops": 989e12, "source": "CARDS['H100']"}
    assert card("NVIDIA H200")["mem_bw_bytes_s"] == 4.8e12 and card("NVIDIA H200")["peak_flops"] == 989e12
    assert card("NVIDIA H100 PCIe")["mem_bw_bytes_s"] == 2.0e12
    c = card("NVIDIA GeForce RTX 4090")
    assert c["mem_bw_bytes_s"] is None and c["peak_flops"] is None
    c = card("NVIDIA H100 80GB HBM3", mem_bw_tbs=3.0, peak_tflops=900)
    assert c["mem_bw_bytes_s"] == 3.0e12 and c["peak_flops"] == 900e12 and "--peak-tflops" in c["source"]


def test_floor_and_mfu_arithmetic():
    # 3.35 GB of weights and K/V at 3.35 TB/s: 1 ms; 2 x 1e9 params x 256 rows at 1024 TFLOP/s: 0.5 ms
    f = decode_floor(3_000_000_000, 350_000_000, 3.35e12, 2 * 1e9 * 256, 1024e12)
    assert math.isclose(f["floor_ms"], 1.0) and math.isclose(f["compute_floor_ms"], 0.5)
    assert decode_floor(1, 1, None)["floor_ms"] is None
    # 1e9 params at 66,000 tok/s: 6 x 1e9 x 66e3 = 396 TFLOP/s, 40% of 990
    assert math.isclose(mfu(1_000_000_000, 66_000, 990e12), 0.4) and mfu(1, 1, None) is None
    # K and V over every layer: 2 x L x Hkv x hd x 2 bytes (bf16), from the published shapes
    assert kv_bytes_per_token(arch_config("r1-qwen-1.5b")) == 2 * 28 * 2 * 128 * 2
    assert kv_bytes_per_token(arch_config("rho-1b")) == 2 * 22 * 4 * 64 * 2
    assert kv_bytes_per_token(arch_config("pythia-1b")) == 2 * 16 * 8 * 256 * 2
    assert hub_id("rho-1b") == "realtreetune/rho-1b-sft-GSM8K" and hub_id("EleutherAI/pythia-1b-deduped")
    with pytest.raises(ValueError):
        hub_id("mnoukhov/pythia1b-rm-tldr6.9b")  # a reward model: no sampler, no decode


def test_paper_figures_on_a_record():
    """The targets from a record as bench/gpu.py leaves it: bf16 on an H100, 256 rows."""
    shape = arch_config("rho-1b")
    kvt = kv_bytes_per_token(shape)
    res = {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "precision": {"dtype": "bf16", "kv": "bf16"},
           "model": {"arch": "rho-1b", "shape": shape, "params": 1_100_048_384, "matmul_params": 1_034_512_384},
           "decode": {"ours_overlap": {"gpu_ms": 2.0, "rows": 256, "prompt_tokens_live": 11_000, "own_cols_profiled": 50.0}},
           "trainer": {"no_checkpointing": {"tok_s": 60_000.0, "step_s": 0.27},
                       "checkpointing": {"tok_s": 45_000.0, "step_s": 0.36}},
           "sampler": {"ours_over_hf_static_compiled": 2.5, "ours_best": "ours_overlap", "ours_overlap": {"tok_s": 25e3},
                       "hf_static_compiled": {"tok_s": 10e3}}}
    fig, t = paper_figures(res, type("A", (), {"mem_bw_tbs": None, "peak_tflops": None})())
    floor = 1e3 * (2 * 1_034_512_384 + kvt * (11_000 + 256 * 50)) / 3.35e12
    assert math.isclose(fig["decode"]["floor_ms"], floor) and 0.6 < floor < 0.8
    d = t["rho-1b_decode_over_bandwidth_floor"]
    assert math.isclose(d["value"], 2.0 / floor) and d["met"] is False and d["bar"] == 2.0
    m = t["rho-1b_trainer_mfu"]
    assert m["setting"] == "no_checkpointing" and math.isclose(m["value"], 6 * 1_100_048_384 * 60_000 / 989e12)
    assert m["met"] is True  # 0.40
    assert t["rho-1b_sampler_over_hf_static_compiled"]["met"] is True
    assert fig["sampler"] == {"ours": "ours_overlap", "ours_tok_s": 25e3, "hf_static_compiled_tok_s": 10e3,
                              "ours_over_hf_static_compiled": 2.5}


@pytest.mark.parametrize("arch", [a if a == "rho-1b" else pytest.param(a, marks=pytest.mark.slow)  # 15 s each: one
                                  for a in sorted(ARCHS)])                                       # family by default
def test_arch_smoke_on_cpu(tmp_path, arch):
    """`--arch` at its family's tiny sizes: the checkpoint built once in --workdir and reused by the
    next run, the sampler, decode and trainer sections end to end, the floor and MFU from the flags."""
    env = {**os.environ, "ASYNCRL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--device", "cpu", "--dtype", "fp32", "--arch", arch,
           "--workdir", str(tmp_path / "w"), "--mem-bw-tbs", "0.05", "--peak-tflops", "0.1", "--no-decode-schedule"]
    runs = []
    for only in ("sampler,decode,trainer", "trainer"):
        p = subprocess.run(cmd + ["--only", only, "--sampler-parts", "default"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-4000:]
        lines = p.stdout.strip().splitlines()
        assert len(lines) == 1, p.stdout[-2000:]
        runs.append(json.loads(lines[0]))
    res = runs[0]
    assert res["complete"] and res["model"]["model_type"] == ARCHS[arch] and res["model"]["shape"]["num_hidden_layers"] == 2
    assert not res["model"]["reused"] and runs[1]["model"]["reused"]
    for s in ("sampler", "decode", "trainer"):
        assert "error" not in res[s], res[s].get("traceback")
    assert "engine" not in res["sampler"] and "gsm8k" not in res["sampler"]  # --sampler-parts default
    t = res["targets"]
    for k in ("decode_over_bandwidth_floor", "trainer_mfu"):
        e = t[f"{arch}_{k}"]
        assert math.isfinite(e["value"]) and e["value"] > 0 and e["met"] in (True, False), e
    assert res["paper"]["decode"]["rows"] == 8 and res["paper"]["decode"]["kv_tokens_live"] > 0
    assert res["paper"]["sampler"]["ours_tok_s"] > 0 and res["paper"]["sampler"]["hf_static_tok_s"] > 0
    assert "decode_gpu_ms_256_rows" not in t and "trainer_no_checkpointing" not in t  # SmolLM2's bars only
