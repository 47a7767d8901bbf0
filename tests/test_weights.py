"""Tests for `common/runtime/shared/weights.py`: in-process round trip, errors, and a spawned reader that must
never observe a torn (mixed-version) set of weights while the parent publishes rapidly."""
import pickle
import queue as queue_mod
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from common.runtime.shared.weights import WeightStore


class Tiny(nn.Module):
    """A few Linear layers plus an embedding tied to the output head."""

    def __init__(self, d=32, vocab=50, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: appears once in named_parameters()


def _fill(module, value):
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


def _same(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_round_trip_in_process():
    src = Tiny()
    store = WeightStore.from_module(src)
    assert "head.weight" not in store.names and "embed.weight" in store.names
    assert store.nbytes == sum(p.numel() * 4 for p in src.parameters())
    assert store.version == -1
    dst = Tiny()
    assert not _same(src, dst)
    assert store.apply_to(dst) is None  # nothing published yet

    store.publish(src, 3)
    assert store.version == 3
    assert store.apply_to(dst) == 3
    assert _same(src, dst)
    assert dst.head.weight is dst.embed.weight  # still tied: copied in place
    assert store.apply_to(dst) is None  # nothing new

    # Publish from a state dict (carries the tied alias key, ignored) into the other slot.
    _fill(src, 7.0)
    store.publish(src.state_dict(), 4)
    assert store.apply_to(dst, min_version=5) is None  # not new enough
    assert store.apply_to(dst) == 4 and _same(src, dst)
    assert store.load_into(Tiny()) == 4  # always applies

    with pytest.raises(ValueError, match="versions must increase"):
        store.publish(src, 4)


def test_bind_loads_with_one_copy_in_place():
    """A bound reader's parameters live in one flat buffer: loads land in the same memory
    (captured graphs keep reading valid weights), tied weights stay tied, values equal."""
    src, dst = Tiny(), Tiny()
    store = WeightStore.from_module(src)
    assert store.bind(dst)
    ptrs = [p.data_ptr() for p in dst.parameters()]
    for v in (0, 1):
        _fill(src, float(v + 2))
        store.publish(src, version=v)
        assert store.load_into(dst) == v and _same(src, dst)
        assert [p.data_ptr() for p in dst.parameters()] == ptrs
    assert dst.head.weight is dst.embed.weight
    with torch.no_grad():
        dst.head.weight.data = dst.head.weight.data.clone()  # moved out of the buffer: per-parameter copies
    _fill(src, 7.0)
    store.publish(src, version=2)
    assert store.load_into(dst) == 2 and _same(src, dst)
    assert not WeightStore.from_module(src, dtype=torch.bfloat16).bind(Tiny())  # dtypes differ: no binding


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias"])
def test_bound_generator_decodes_from_merged_views(arch, tmp_path):
    """A generator bound to the store decodes from views of its q/k/v and gate/up weights (and
    biases): no packed copy; a published update reaches the decode step with the one slot copy."""
    from common.engine.checkpoints.hf_io import load_model
    from common.engine.sampler.sampler import Sampler
    from common.engine.sampler.sampling import SamplingParams
    from tests.tiny import save_hf
    save_hf(arch, tmp_path)
    trainer, gen, fresh = (load_model(str(tmp_path), tokenizer=False)[0] for _ in range(3))
    store = WeightStore.from_module(trainer)
    store.publish(trainer, 0)
    assert store.bind(gen)
    s = Sampler(gen, max_batch=4, max_seq_len=32)
    assert s.dec.packed == []
    params = SamplingParams(max_new_tokens=6, temperature=0, n=2)
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            p.mul_(-1.5)
            fresh.get_parameter(n).copy_(p)
    store.publish(trainer, 1)
    s.update_weights(store.load_into, 1)
    assert s.dec.packed == [] and s.generate([[5, 6, 7]], params)[0].tokens == \
        Sampler(fresh, max_batch=4, max_seq_len=32).generate([[5, 6, 7]], params)[0].tokens


def test_dtype_conversion():
    src = Tiny()
    store = WeightStore.from_module(src, dtype=torch.bfloat16)
    store.publish(src, 1)
    dst = Tiny()
    store.load_into(dst)
    for (n, p), q in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(p.to(torch.bfloat16).float(), q), n


def test_name_and_shape_mismatch():
    store = WeightStore.from_module(Tiny())
    store.publish(Tiny(), 1)
    with pytest.raises(ValueError, match="'layers.0.weight' has shape"):
        store.publish({**Tiny().state_dict(), "layers.0.weight": torch.zeros(3, 3)}, 2)
    with pytest.raises(ValueError, match="'embed.weight' has shape"):
        store.apply_to(Tiny(vocab=51))
    with pytest.raises(ValueError, match=r"missing \['layers.2.weight'"):
        store.apply_to(Tiny(layers=2))
    with pytest.raises(ValueError, match=r"unexpected \['layers.3.weight'"):
        store.load_into(Tiny(layers=4))
    sd = Tiny().state_dict()
    del sd["norm.bias"]
    with pytest.raises(ValueError, match="norm.bias"):
        store.publish(sd, 2)


def test_plain_pickle_refuses_private_copy():
    store = WeightStore.from_module(Tiny())
    with pytest.raises(RuntimeError, match="torch.multiprocessing"):
        pickle.loads(pickle.dumps(store))


def _reader(store, q, final, seconds):
    """Spawned generator: apply as often as possible, check every snapshot is one version."""
    torch.set_num_threads(1)
    model = Big().requires_grad_(False)
    q.put(("ready", None))
    seen, bad, deadline = set(), [], time.time() + seconds
    while time.time() < deadline:
        v = store.apply_to(model)
        if v is None:
            continue
        seen.add(v)
        vals = {float(x) for p in model.parameters() for x in (p.min(), p.max())}
        if vals != {float(v)}:
            bad.append((v, sorted(vals)[:4]))
        if v == final:
            break
    q.put(("done", (sorted(seen), bad)))


class Big(nn.Module):
    """~4 MB of fp32: one copy takes long enough for writer and reader to overlap."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))


def _spawn_reader(store, final, seconds):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_reader, args=(store, q, final, seconds), daemon=True)
    proc.start()
    return proc, q


def _finish(proc, q, timeout):
    try:
        tag, payload = q.get(timeout=timeout)
        assert tag == "done"
        return payload
    except queue_mod.Empty:
        pytest.fail("reader process did not report back in time")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()


def test_cross_process_no_torn_reads():
    final = 200
    src = Big()
    store = WeightStore.from_module(src)
    proc, q = _spawn_reader(store, final, seconds=20)
    try:
        tag, _ = q.get(timeout=30)  # child imported torch and built its model
        assert tag == "ready"
    except queue_mod.Empty:
        proc.terminate()
        pytest.fail("reader process did not start")
    for v in range(1, final + 1):
        _fill(src, float(v))
        store.publish(src, v)
        time.sleep(5e-4)  # leave the reader a chance on 2 shared cores; still ~1 publish / ms
    seen, bad = _finish(proc, q, timeout=40)
    assert proc.exitcode == 0
    assert bad == [], f"torn reads: {bad[:5]}"
    assert len(seen) >= 3, seen
    assert seen[-1] == final


def _gpu_reader(store, q):
    torch.set_num_threads(1)
    model = Big().cuda()
    v = store.load_into(model)
    q.put(("done", (v, all(bool((p == float(v)).all()) for p in model.parameters()))))


@pytest.mark.gpu
def test_cuda_ipc_store():
    src = Big().cuda()
    store = WeightStore.from_module(src, device="cuda")
    _fill(src, 5.0)
    store.publish(src, 5)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_gpu_reader, args=(store, q), daemon=True)
    proc.start()
    v, ok = _finish(proc, q, timeout=120)
    assert v == 5 and ok
