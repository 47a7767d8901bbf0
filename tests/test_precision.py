"""Per-machine precision: the choice logic, and bf16 numerics checked against fp32.

Tolerances (tiny random models, logits std ~1 so log-probs span a few nats):
  - bf16 (autocast or bf16 weights) token log-probs vs fp32: max |diff| < 0.05 nats (measured
    here: 0.012);
  - the sampler's recorded log-probs (bf16 weights, fp32 or bf16 KV cache) vs the trainer's
    recomputation (fp32 master weights under bf16 autocast), the train/inference mismatch:
    mean |diff| < 0.02 and max < 0.1 nats per token (measured here: mean 0.008, max 0.04; fp32
    vs fp32 agrees to ~1e-6, test_sampler.py);
  - fp32 greedy decoding equals transformers exactly, through either GEMM backend.
"""
import json
import math

import pytest
import torch

from common.engine.model.causal_attention import kernel_enabled, set_kernel
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import Linear, onednn_available, onednn_enabled, set_onednn
import common.engine.machine.cpu as machine
import common.engine.machine.decode_choice as machine_decode
import common.engine.machine.precision as P
from common.engine.machine.precision import Precision, PrecisionConfig, resolve
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.ops import token_logp
from common.runtime.shared.weights import WeightStore
from tests.tiny import save_hf

FAKE = {"shape": [256, 576, 1536], "fp32_aten_gflops": 100.0, "fp32_onednn_gflops": 200.0,
        "fp32_aten_train_ms": 20.0, "fp32_onednn_train_ms": 10.0, "fp32_onednn_over_aten_train": 0.5,
        "bf16_gflops": 500.0, "attn_fp32_ms": 1.0, "attn_bf16_ms": 5.0,
        "full_attn_kernel_ms": 5.0, "full_attn_sdpa_ms": 8.0}


def _fake_machine(monkeypatch, flags, measured=FAKE, decode=None):
    """A CPU with `flags` whose fast measurement is `measured` (its calls' bf16 flags returned) and whose
    decode measurement (`decode_*` cache entries) is `decode` (None: never taken)."""
    calls = []
    monkeypatch.setattr(P, "cpu_info", lambda: {"model": "test cpu", "flags": flags, "capability": "AVX512",
                                                "threads": 1})
    monkeypatch.setattr(P, "measured", lambda info, bf16, remeasure=False: calls.append(bf16) or dict(measured))
    monkeypatch.setattr(P, "cached_decode", lambda info: dict(decode or {}))
    return calls


def _no_decode_measurement(monkeypatch):
    """Make the slow decode measurement fail if anything starts it."""
    def refuse(*a, **kw):
        raise AssertionError("the decode measurement was started")
    monkeypatch.setattr(machine_decode, "measure_decode", refuse)
    monkeypatch.setattr(machine_decode, "compile_ab", refuse)


# ------------------------------------------------------------------------------ the choice

def test_auto_picks_bf16_only_with_bf16_hardware_and_a_measured_gain(monkeypatch):
    _fake_machine(monkeypatch, ["avx512f", "amx_bf16"])
    p = resolve(PrecisionConfig())
    assert (p.dtype, p.gemm, p.kv, p.attention) == ("bf16", "onednn", "fp32", "kernel")  # 2.5x GEMM; decode attention faster in fp32
    assert "2.50x" in p.why and p.measured["bf16_gflops"] == 500.0
    _fake_machine(monkeypatch, ["avx512f", "avx512_bf16"], {**FAKE, "bf16_gflops": 250.0, "attn_bf16_ms": 0.5})
    assert resolve(PrecisionConfig()).dtype == "fp32"  # 1.25x < BF16_MIN_GAIN
    calls = _fake_machine(monkeypatch, ["avx512f", "avx2"], {**FAKE, "fp32_onednn_over_aten_train": 1.2})
    p = resolve(PrecisionConfig())
    assert (p.dtype, p.gemm, p.kv) == ("fp32", "aten", "fp32") and calls == [False]  # bf16 not even measured
    assert "no AMX-BF16" in p.why
    _fake_machine(monkeypatch, ["avx2"], {**FAKE, "full_attn_kernel_ms": 9.0})
    p = resolve(PrecisionConfig())
    assert p.attention == "sdpa" and "causal attention kernel 9.0 vs SDPA 8.0 ms" in p.why


def test_the_gemm_backend_is_the_faster_on_the_trainers_gemms(monkeypatch):
    """Not the faster forward GEMM: a backend can win x W^T and lose the backward's layouts (an
    AVX2 EPYC: oneDNN ahead on forward GEMMs, its training step far behind ATen's)."""
    _fake_machine(monkeypatch, ["avx2"], {**FAKE, "fp32_aten_train_ms": 10.0, "fp32_onednn_train_ms": 12.0,
                                          "fp32_onednn_over_aten_train": 1.18})  # forward: oneDNN 200 vs 100
    p = resolve(PrecisionConfig())
    assert p.gemm == "aten" and "trainer fp32 GEMMs oneDNN 12.0 vs ATen 10.0 ms" in p.why
    no_onednn = {k: v for k, v in FAKE.items() if "onednn" not in k}  # a torch build without oneDNN's linear
    _fake_machine(monkeypatch, ["avx2"], no_onednn)
    assert resolve(PrecisionConfig()).gemm == "aten"


def test_trainer_gemms_are_timed_alternating_on_both_backends():
    m = machine._trainer_gemms(rounds=2)
    assert m["fp32_aten_train_ms"] > 0
    if onednn_available():
        assert m["fp32_onednn_train_ms"] > 0 and m["fp32_onednn_over_aten_train"] > 0
    assert onednn_enabled() == onednn_available()  # the caller's backend (tests/conftest.py's default) given back


def test_forced_choices_skip_the_measurement(monkeypatch):
    calls = _fake_machine(monkeypatch, ["amx_bf16"])
    p = resolve(PrecisionConfig(dtype="bf16", gemm="aten", kv="bf16", attention="sdpa", decode="eager",
                                decode_gemm="plain"))
    assert (p.dtype, p.gemm, p.kv, p.attention, p.why) == ("bf16", "aten", "bf16", "sdpa", "all forced") and calls == []
    assert p.decode == "eager" and resolve(PrecisionConfig(decode="compiled", dtype="fp32", gemm="aten",
                                                           attention="sdpa")).decode == "compiled"
    p = resolve(PrecisionConfig(dtype="bf16", gemm="aten", attention="kernel", decode_gemm="plain"))  # kv auto: timed
    assert p.kv == "fp32" and calls == [True]
    assert resolve(PrecisionConfig(dtype="fp32"), device="cuda").dtype == "fp32"
    assert resolve(PrecisionConfig(), device="cuda").decode == "compiled"
    p = resolve(PrecisionConfig(), device="cuda")
    assert (p.dtype, p.kv) == ("bf16", "bf16")


def test_decode_auto_reads_the_machines_decode_measurement(monkeypatch):
    """CPU `decode=auto`: compiled where this machine's recorded measurement, in the run's dtype, shows
    compiled DECODE_MIN_GAIN faster; eager below it, and eager where never measured. Resolving only
    reads: the measurement (a compile) is never started, nor the fast one when the rest is forced."""
    _no_decode_measurement(monkeypatch)
    _fake_machine(monkeypatch, ["avx2"], decode={"decode_fp32_compiled_over_eager_tok_s": 1.14})
    p = resolve(PrecisionConfig())
    assert p.decode == "compiled" and "decode compiled: compiled 1.14x eager, measured (need 1.05x)" in p.why
    assert p.measured["decode_fp32_compiled_over_eager_tok_s"] == 1.14  # saved with the run (precision.json)
    assert Precision.from_dict(json.loads(json.dumps(p.to_dict()))).measured == p.measured
    _fake_machine(monkeypatch, ["avx2"], decode={"decode_fp32_compiled_over_eager_tok_s": P.DECODE_MIN_GAIN - 0.01})
    p = resolve(PrecisionConfig())
    assert p.decode == "eager" and "decode eager: compiled 1.04x eager" in p.why
    calls = _fake_machine(monkeypatch, ["avx2"])
    p = resolve(PrecisionConfig(dtype="fp32", gemm="aten", attention="sdpa", decode_gemm="plain"))  # all else forced
    assert p.decode == "eager" and calls == [] and p.measured == {}
    assert p.why == "decode eager: not measured on this machine (python -m common.runtime.measure_decode, ~1 min once)"
    # the measurement of the run's dtype: a bf16 machine measured in fp32 only is not measured for its run
    _fake_machine(monkeypatch, ["amx_bf16"], decode={"decode_fp32_compiled_over_eager_tok_s": 1.3})
    p = resolve(PrecisionConfig())
    assert (p.dtype, p.decode) == ("bf16", "eager") and "not measured" in p.why
    _fake_machine(monkeypatch, ["amx_bf16"], decode={"decode_fp32_compiled_over_eager_tok_s": 0.9,
                                                     "decode_bf16_compiled_over_eager_tok_s": 1.3})
    assert resolve(PrecisionConfig()).decode == "compiled"
    assert resolve(PrecisionConfig(), device="cuda").decode == "compiled"  # CUDA: compiled, not measured


def test_decode_gemm_auto_packs_where_measured_faster(monkeypatch):
    """CPU `decode_gemm=auto`: the bf16 decode GEMMs on oneDNN-packed weights where the machine measured
    them DECODE_GEMM_MIN_GAIN faster than F.linear; plain below it, in fp32, without a measurement
    (PyTorch without bf16 packing) and on CUDA; `packed` forced where it cannot apply is an error."""
    bf16 = {**FAKE, "attn_bf16_ms": 0.5}
    _fake_machine(monkeypatch, ["amx_bf16"], {**bf16, "bf16_decode_gemm_ms": 6.8, "bf16_decode_packed_ms": 3.1})
    p = resolve(PrecisionConfig())
    assert (p.dtype, p.decode_gemm) == ("bf16", "packed") and "decode GEMMs packed: F.linear 6.80 vs packed 3.10 ms" in p.why
    assert "decode_gemm=packed" in p.summary()
    model = p.configure(torch.nn.Linear(1, 1), "generator")
    assert model.decode_packed  # what a sampler on this model reads (tests/test_decode_packed.py)
    _fake_machine(monkeypatch, ["amx_bf16"], {**bf16, "bf16_decode_gemm_ms": 3.3, "bf16_decode_packed_ms": 3.1})
    assert resolve(PrecisionConfig()).decode_gemm == "plain"
    _fake_machine(monkeypatch, ["amx_bf16"], bf16)  # no packing in this PyTorch: never measured
    p = resolve(PrecisionConfig())
    assert p.decode_gemm == "plain" and "bf16 packing unavailable" in p.why
    _fake_machine(monkeypatch, ["avx2"])
    p = resolve(PrecisionConfig())
    assert (p.dtype, p.decode_gemm) == ("fp32", "plain") and "decode GEMMs" not in p.why  # nothing to choose
    with pytest.raises(ValueError, match="decode_gemm=packed needs bf16 decode"):
        resolve(PrecisionConfig(decode_gemm="packed"))
    assert resolve(PrecisionConfig(), device="cuda").decode_gemm == "plain"
    with pytest.raises(ValueError, match="for CPU bf16 decode"):
        resolve(PrecisionConfig(decode_gemm="packed"), device="cuda")
    assert Precision.from_dict({"dtype": "bf16"}).decode_gemm == "plain"  # a run saved before the choice


def test_forced_decode_skips_reading_the_decode_measurement(monkeypatch):
    _fake_machine(monkeypatch, ["avx2"])

    def refuse(info):
        raise AssertionError("read the decode measurement")
    monkeypatch.setattr(P, "cached_decode", refuse)
    assert resolve(PrecisionConfig(decode="eager")).decode == "eager"
    p = resolve(PrecisionConfig(decode="compiled"))
    assert p.decode == "compiled" and "decode" not in p.why


def test_the_decode_command_measures_the_runs_dtype(tmp_path, monkeypatch):
    """`take` (python -m common.runtime.measure_decode): fp32, and the dtype and KV dtype `auto` picks
    where that is bf16; recorded under the machine's key, kept beside the fast measurement."""
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    info = {"model": "test cpu", "flags": ["amx_bf16"], "capability": "AVX512", "threads": 1}
    monkeypatch.setattr(P, "cpu_info", lambda: dict(info))
    monkeypatch.setattr(P, "measured", lambda info, bf16, remeasure=False: dict(FAKE))
    taken = []

    def fake_measure(dtype, kv, rounds, **kw):
        taken.append((dtype, kv))
        return {f"decode_{dtype}_compiled_over_eager_tok_s": 1.2 if dtype == "bf16" else 0.9, f"decode_{dtype}_kv": kv}
    monkeypatch.setattr(machine_decode, "measure_decode", fake_measure)
    out = machine_decode.take(rounds=1)
    assert taken == [("fp32", "fp32"), ("bf16", "fp32")]  # FAKE: bf16 GEMMs 2.5x, decode attention faster in fp32
    assert out["decode"] == "compiled" and "compiled 1.20x eager" in out["why"]
    assert machine.cached_decode(info) == {"decode_fp32_compiled_over_eager_tok_s": 0.9, "decode_fp32_kv": "fp32",
                                           "decode_bf16_compiled_over_eager_tok_s": 1.2, "decode_bf16_kv": "fp32"}
    assert out["cache"] == str(machine._cache_file(info))


def test_decode_measurement_is_real_and_read_by_resolve(tmp_path, monkeypatch):
    """The real measurement at a tiny width into a fresh cache; `resolve` then reads it. The compile is
    what costs: the sizes, eps and sequence length are tests/test_decode_compile.py's llama_tied's, so
    in a suite inductor's cache holds some of these graphs already."""
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    out = machine_decode.take(rounds=2, prompts=2, prompt_len=16, n=2, new_tokens=32, hidden_size=32,
                              intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              vocab_size=97, rms_norm_eps=1e-6)
    saved = json.loads(machine._cache_file(P.cpu_info()).read_text())
    assert out["cache"] == str(machine._cache_file(P.cpu_info())) and "fp32_aten_train_ms" in saved  # merged
    for k in ("compiled_over_eager_tok_s", "eager_tok_s", "compiled_tok_s"):
        v = saved[f"decode_fp32_{k}"]
        assert math.isfinite(v) and v > 0, (k, v)
    # a cost, so >= 0; it may be ~0 (inductor's cache warm from the suite) and the bare difference of
    # two warm-ups then goes negative under load (seen: -0.0038 s): machine_decode clamps it
    assert math.isfinite(saved["decode_fp32_compile_s"]) and saved["decode_fp32_compile_s"] >= 0
    assert saved["decode_shape"]["hidden_size"] == 32 and len(saved["decode_fp32_ratios"]) == 2
    p = resolve(PrecisionConfig(dtype="fp32"))
    gain = saved["decode_fp32_compiled_over_eager_tok_s"]
    assert p.decode == ("compiled" if gain >= P.DECODE_MIN_GAIN else "eager") and f"compiled {gain:.2f}x eager" in p.why
    assert p.measured["decode_fp32_eager_tok_s"] == saved["decode_fp32_eager_tok_s"]


def test_measurement_is_real_and_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    info = P.cpu_info()
    m = P.measured(info, bf16=True)
    assert m["fp32_aten_gflops"] > 0 and m["bf16_gflops"] > 0 and m["attn_fp32_ms"] > 0 and "cached" not in m
    assert m["fp32_aten_train_ms"] > 0
    assert m["full_attn_kernel_ms"] > 0 and m["full_attn_sdpa_ms"] > 0
    files = list((tmp_path / "precision").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["bf16_gflops"] == m["bf16_gflops"]
    again = P.measured(info, bf16=True)
    assert again["cached"] == str(files[0]) and again["bf16_gflops"] == m["bf16_gflops"]
    machine.record_decode(info, {"decode_fp32_compiled_over_eager_tok_s": 1.5})
    assert "cached" not in P.measured(info, bf16=True, remeasure=True)
    assert machine.cached_decode(info) == {"decode_fp32_compiled_over_eager_tok_s": 1.5}  # kept: taken only on request
    p = resolve(PrecisionConfig())  # on this machine, whatever it is: a valid, explained choice
    assert p.dtype in ("fp32", "bf16") and p.gemm in ("onednn", "aten") and p.why and p.cpu["model"]
    assert p.attention in ("kernel", "sdpa")
    old = {k: v for k, v in p.to_dict().items() if k != "attention"}  # saved before the field existed
    assert Precision.from_dict(old).attention == "sdpa" and Precision.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("flags, picked", [([], ("fp32", "onednn", "kernel")), (["amx_bf16"], ("bf16", "onednn", "kernel"))])
def test_machine_precision_applies_what_a_run_would_pick_outside_a_run(tmp_path, monkeypatch, flags, picked):
    """One line in a notebook: the process's kernels become the run's choice, and a model loaded
    through it for the trainer's role gets the run's dtype (autocast over fp32 weights)."""
    _fake_machine(monkeypatch, flags, {**FAKE, "full_attn_kernel_ms": 5.0, "full_attn_sdpa_ms": 8.0})
    set_onednn(False)
    set_kernel(False)
    prec = P.machine_precision()
    assert (prec.dtype, prec.gemm, prec.attention) == picked
    assert onednn_enabled() == onednn_available() and kernel_enabled()
    save_hf("llama_tied", tmp_path / "m")
    model = prec.load(str(tmp_path / "m"), role="trainer", tokenizer=False)[0]
    assert model.dtype == torch.float32 and model.compute_dtype == (torch.bfloat16 if flags else None)


# ------------------------------------------------------------------------------ numerics

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("prec")
    m = save_hf("llama3_untied", d)
    with torch.no_grad():  # spread the logits (std ~1) so bf16 rounding shows in log-probs
        m.lm_head.weight.mul_(1.0 / m.lm_head.weight.std() / 32 ** 0.5 / m.model.norm.weight.abs().mean())
    m.save_pretrained(d)
    return str(d)


def _seqs(n=6, T=24, V=97):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, V, (n, T), generator=g)
    mask = torch.zeros(n, T, dtype=torch.bool)
    mask[:, 6:] = True
    return tokens, mask


def test_autocast_token_logp_close_to_fp32(ckpt):
    tokens, mask = _seqs()
    fp32 = Precision("fp32", "onednn", "fp32")
    bf16 = Precision("bf16", "onednn", "fp32")
    master, _ = bf16.load(ckpt, role="trainer", tokenizer=False)
    assert master.dtype == torch.float32 and master.compute_dtype == torch.bfloat16
    ref, _ = fp32.load(ckpt, role="trainer", tokenizer=False)
    assert ref.compute_dtype is None
    with torch.no_grad():
        want = token_logp(ref, tokens, 0.7, mask)
        assert want[mask].std() > 0.3  # log-probs that differ: the check below is not vacuous
        got = token_logp(master, tokens, 0.7, mask)
        gen = token_logp(bf16.load(ckpt, tokenizer=False)[0], tokens, 0.7, mask)  # bf16 weights
    assert got.dtype == torch.float32
    assert 0 < (got - want).abs().max() < 0.05  # bf16 really ran (not a silent fp32 path), and stayed close
    assert (gen - want).abs().max() < 0.05


def test_autocast_linear_runs_in_bf16_and_grads_reach_fp32_master(ckpt):
    lin = Linear(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.randn(3, 8)).dtype == torch.bfloat16  # not the fp32 oneDNN route
    model, _ = Precision("bf16", "onednn", "fp32").load(ckpt, role="trainer", tokenizer=False)
    tokens, mask = _seqs()
    token_logp(model, tokens, 1.0, mask).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_bf16_sampler_logp_vs_trainer_recompute(ckpt, kv):
    prec = Precision("bf16", "onednn", kv)
    gen, _ = prec.load(ckpt, tokenizer=False)
    master, _ = prec.load(ckpt, role="trainer", tokenizer=False)
    assert gen.dtype == torch.bfloat16 and gen.kv_dtype == prec.kv_dtype
    s = Sampler(gen, max_batch=6, max_seq_len=48)
    assert s.cache.k[0].dtype == prec.kv_dtype
    outs = s.generate([[5, 17, 33], [9] * 10, [40, 41, 42, 43]], SamplingParams(max_new_tokens=16, temperature=0.7,
                                                                               n=2, seed=0))
    diffs = []
    for c in outs:
        seq = torch.tensor([c.prompt_tokens + c.tokens])
        with torch.no_grad():
            lp = token_logp(master, seq, 0.7)[0, len(c.prompt_tokens):]
        diffs.append((c.logp_tensor() - lp).abs())
    d = torch.cat(diffs)
    assert d.mean() < 0.02 and d.max() < 0.1, (d.mean(), d.max())


@pytest.mark.parametrize("onednn", [True, False])
def test_fp32_greedy_equals_transformers_on_either_backend(onednn, tmp_path):
    from tests.test_sampler import PROMPTS, _hf_greedy
    ref = save_hf("qwen2_bias", tmp_path)
    old = set_onednn(onednn)
    try:
        ours, _ = Precision("fp32", "onednn" if onednn else "aten", "fp32").load(str(tmp_path), tokenizer=False)
        outs = Sampler(ours, max_batch=2, max_seq_len=64).generate(PROMPTS, SamplingParams(max_new_tokens=12,
                                                                                            temperature=0))
    finally:
        set_onednn(old)
    assert [c.tokens for c in outs] == [_hf_greedy(ref, p, 12) for p in PROMPTS]


def test_store_publishes_fp32_master_as_bf16(ckpt):
    master, _ = load_model(ckpt, tokenizer=False)
    gen, _ = Precision("bf16", "aten", "fp32").load(ckpt, tokenizer=False)
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.01)
    store = WeightStore.from_module(master, dtype=torch.bfloat16)
    assert store.nbytes == sum(p.numel() * 2 for p in master.parameters())  # half of fp32
    store.publish(master, 1)
    assert store.load_into(gen) == 1
    for (n, a), b in zip(master.named_parameters(), gen.parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(b, a.detach().bfloat16()), n


def test_inference_copy_for_eval(ckpt):
    prec = Precision("bf16", "onednn", "fp32")
    master, _ = prec.load(ckpt, role="trainer", tokenizer=False)
    m = prec.inference_copy(master)
    assert m.dtype == torch.bfloat16 and m.compute_dtype is None and m.kv_dtype == torch.float32
    assert master.dtype == torch.float32  # the master weights are untouched
    fp32 = Precision("fp32", "onednn", "fp32")
    plain, _ = fp32.load(ckpt, role="trainer", tokenizer=False)
    assert fp32.inference_copy(plain) is plain


def test_train_end_to_end_in_bf16(tmp_path):
    """Trainer (fp32 master + autocast) and a spawned generator (bf16 weights) through the
    bf16 weight store; the choice is saved with the run; the checkpoint keeps fp32 weights."""
    from common.contracts.log import read_metrics
    from common.train import train
    from tests.test_e2e import _cfg, _prompts, _tba, toy_reward
    cfg = _cfg(tmp_path, steps=4, mode="sync")  # sync: every step needs the generator to apply new weights
    cfg.precision = PrecisionConfig(dtype="bf16", gemm="aten")
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    run = tmp_path / "runs" / cfg.name
    saved = json.loads((run / "precision.json").read_text())
    assert saved["dtype"] == "bf16" and saved["gemm"] == "aten" and saved["kv"] in ("fp32", "bf16")
    assert read_metrics(run / "metrics.jsonl")[0]["precision"]["dtype"] == "bf16"
    assert last["version"] == 4 and last["gen_syncs"] >= 3 and torch.isfinite(torch.tensor(last["loss"]))
    model, _ = load_model(str(sorted((run / "checkpoints").iterdir())[-1] / "model"), tokenizer=False)
    before, _ = load_model(cfg.model, tokenizer=False)
    assert model.dtype == torch.float32
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters()))
