"""What a captured decode step runs (common/engine/sampler/decode.py), checked on CPU: on a schedule shaped
like the GSM8K GPU preset the graph buckets stay within 2x of the live batch, bucketed shapes give
the live samples, the few distinct buckets fit the graph cap, and the step reads nothing back to
the host (a captured step that did would fail or silently stall on the GPU)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import common.engine.sampler.sampler as sampler_mod
from common.engine.model import attention
from common.engine.sampler.decode import Rows, Shape, bucket_grain, captured_shape, decode_step
from common.engine.sampler.decode_model import DecodeModel
from common.engine.checkpoints.hf_io import load_model
from common.engine.kv.static_cache import KVCache
from common.engine.model.transformer import Transformer
from common.engine.model.model_config import ModelConfig
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_hf("llama_tied", d)
    return load_model(str(d), tokenizer=False)[0]


def _preset_schedule(model, static: bool, shapes: list | None = None):
    """14 prompts of 20..119 tokens x n = 20 through 256 slots: more samples than slots, so
    requests are admitted in parts; random stop tokens end samples at different times."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 97, (int(L),), generator=g).tolist() for L in torch.randint(20, 120, (14,), generator=g)]
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=20, stop_token_ids=(3, 4), seed=1)
    s = Sampler(model, max_batch=256, max_seq_len=160, max_prompt_len=120, static_shapes=static)
    real = sampler_mod.decode_step

    def spy(model, cache, rows, shape, *flags):
        if shapes is not None:
            shapes.append((shape, *flags))
        return real(model, cache, rows, shape, *flags)
    sampler_mod.decode_step = spy
    try:
        return s.generate(prompts, params), s.stats
    finally:
        sampler_mod.decode_step = real


def test_buckets_stay_within_2x_of_the_live_batch(model):
    shapes: list = []
    outs, st = _preset_schedule(model, static=True, shapes=shapes)
    live_outs, live = _preset_schedule(model, static=False)
    assert st["decode_steps"] > 30 and len({len(c.tokens) for c in outs}) > 10  # ragged, long enough
    for what in ("prompt_rows", "own_cols", "prompt_cols"):
        assert st[f"live_{what}"] == live[f"live_{what}"]
        ratio = st[f"run_{what}"] / st[f"live_{what}"]
        assert 1 <= ratio <= 2, (what, ratio)
    assert st["decode_rows"] <= 2 * live["decode_rows"]
    assert len(set(shapes)) <= 64, len(set(shapes))  # GraphedDecode's default cap: no graph evicted here
    # padding computes nothing anyone reads: same samples as the live shapes
    assert [c.tokens for c in outs] == [c.tokens for c in live_outs]
    for a, b in zip(outs, live_outs):
        torch.testing.assert_close(a.logp_tensor(), b.logp_tensor(), atol=1e-5, rtol=0)


def test_bucket_sizes():
    assert [bucket_grain(x, 4, 256) for x in (1, 3, 4, 5, 20, 21)] == [1, 4, 4, 8, 20, 24]
    assert [bucket_grain(x, 128, 512) for x in (1, 100, 129, 300, 600)] == [1, 128, 256, 384, 512]
    # the GSM8K GPU preset at full batch: 13 prompts x 20 in 256 rows (was (256, 257, 32) at full columns)
    shape = captured_shape(Shape(B=256, E=13, n=20, S=200, P=180), 256, 257, 1024, 512)
    assert shape == Shape(B=256, E=16, n=20, S=256, P=256)
    assert shape.E * shape.n <= 2 * 13 * 20


class NoHostRead(TorchDispatchMode):
    """Fails on every op that makes the host wait for a device value (what a CUDA graph cannot
    capture): .item() / int() / bool() of a tensor, nonzero, masked_select, unique, a copy to CPU."""
    FORBIDDEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in self.FORBIDDEN:
            raise AssertionError(f"decode_step reads a device value on the host: aten.{name}")
        kwargs = kwargs or {}
        if name in ("_to_copy", "copy_") and any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu":
                raise AssertionError(f"decode_step copies to the host: aten.{name}")
        return func(*args, **kwargs)


def _meta_setup(B=8, E=3, n=4, S=16, P=12):
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        model = DecodeModel(Transformer(cfg).to(torch.bfloat16))
    cache = KVCache(cfg, max_batch=B, max_seq_len=S, dtype=torch.bfloat16, device="meta", max_prompt_len=P)
    rows = Rows.allocate(B, cache.max_prefixes, "meta")
    return model, cache, rows, Shape(B, E, n, S, P)


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_step_reads_nothing_back_on_meta(flags):
    """On the meta device (no data at all) with the matmul attention CUDA runs: any host read
    raises, and the step's outputs have the bucket's shape."""
    model, cache, rows, shape = _meta_setup()
    with torch.inference_mode(), NoHostRead():  # as Sampler.step runs it
        out = decode_step(model, cache, rows, shape, *flags)
    assert out.shape == (2, shape.B) and out.dtype == torch.float64  # tokens and log-probs, one copy to the host


@pytest.mark.parametrize("flags", [(False, False), (True, True)])
def test_decode_step_reads_nothing_back_on_cpu(model, monkeypatch, flags):
    """The same on real CPU tensors through the CUDA attention branch (real values: a data-
    dependent branch would run here, where it can be caught)."""
    monkeypatch.setattr(attention, "_CPU_FLASH", None)
    s = Sampler(model, max_batch=8, max_seq_len=32, static_shapes=True)
    for p in ([5, 6, 7], [9] * 6):
        s.submit(p, SamplingParams(max_new_tokens=8, temperature=0.0 if flags[1] else 0.9,
                                   top_k=5 if flags[0] else 0, n=3))
    real = sampler_mod.decode_step
    calls = []

    def guarded(*a):
        calls.append(a[3])
        with NoHostRead():
            return real(*a)
    monkeypatch.setattr(sampler_mod, "decode_step", guarded)
    while s.has_work():
        s.step()
    assert len(calls) >= 7
