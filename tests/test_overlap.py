"""`Sampler(overlap=True)`: each decode step is launched before the previous one is recorded
(common/engine/sampler/inflight.py). On the CPU the lag is all there is to see (a CPU step runs when it is
launched), so these tests check what the lag must not change: the same samples, token for token,
through refills, compaction, stop tokens, both length limits, weight updates and aborts."""
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.ops import token_logp
from tests.close import assert_scaled_close
from tests.tiny import save_hf


def _schedule():
    """9 prompts of 1..30 tokens, n = 3: 27 samples through 5 slots (refills; compaction at the tail)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 97, (int(L),), generator=g).tolist() for L in torch.randint(1, 31, (9,), generator=g)]


def _run(model, overlap: bool, static: bool = False, top_k: int = 0):
    """Every sample of the schedule, keyed (request, sample): random stop tokens end some early,
    max_new_tokens others, and max_seq_len = 44 cuts the long prompts' samples shorter still."""
    s = Sampler(model, max_batch=5, max_seq_len=44, static_shapes=static, overlap=overlap)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=top_k, n=3, stop_token_ids=(7, 11, 13), seed=5)
    outs = s.generate(_schedule(), params)
    return {(c.request_id, c.sample_idx): c for c in outs}, s


@pytest.mark.parametrize("arch,static,top_k", [("llama_tied", False, 0), ("llama_tied", True, 5),
                                               ("qwen3_qknorm", False, 0)])
def test_overlap_draws_the_same_samples(tmp_path, arch, static, top_k):
    save_hf(arch, tmp_path)
    model, _ = load_model(str(tmp_path), tokenizer=False)
    plain, ps = _run(model, overlap=False, static=static, top_k=top_k)
    lagged, ls = _run(model, overlap=True, static=static, top_k=top_k)
    assert plain.keys() == lagged.keys() and len(plain) == 27
    reasons = {c.finish_reason for c in plain.values()}
    assert reasons == {"stop", "length"} and len({len(c.tokens) for c in plain.values()}) > 5  # ragged
    assert any(len(c.prompt_tokens) + len(c.tokens) == 44 for c in plain.values())  # max_seq_len reached
    # the same tokens; log-probs up to rounding (rows batched otherwise: other GEMM shapes), relative
    # to their scale (tests/close.py)
    scale = max(a.logp_tensor().abs().max().item() for a in plain.values() if a.tokens)
    for k, a in plain.items():
        b = lagged[k]
        assert (b.tokens, b.finish_reason, b.versions) == (a.tokens, a.finish_reason, a.versions), k
        assert_scaled_close(b.logp_tensor(), a.logp_tensor(), rel=2e-6, scale=scale, msg=str(k))
    # the lag's cost: a sample that ends in a decode step is computed once more, its token dropped
    assert ls.stats["decode_tokens"] > ps.stats["decode_tokens"]
    assert ls._inflight is None or all(ls.slots[q.slot] is not q for q in ls._inflight.seqs)  # nothing live left


def test_no_scalar_assignment_through_an_index_in_the_sampler(pair, monkeypatch):
    """The CPU's guard for a hidden sync a GPU run found: a sampler schedule (admissions, rows
    ending, compaction, under overlap) assigns no Python scalar through an index tensor. On CUDA
    `t[rows] = True` sends the scalar to the device as a host tensor with the host waiting (a sync
    that set_sync_debug_mode catches only on a GPU); `index_fill_` takes the scalar itself."""
    model, _ = pair
    sites, setitem = set(), torch.Tensor.__setitem__

    def checked(self, index, value):
        by_tensor = isinstance(index, torch.Tensor) or (
            isinstance(index, tuple) and any(isinstance(i, torch.Tensor) for i in index))
        if by_tensor and isinstance(value, (bool, int, float)):
            f = traceback.extract_stack()[-2]
            sites.add(f"{Path(f.filename).name}:{f.lineno}")
        return setitem(self, index, value)
    monkeypatch.setattr(torch.Tensor, "__setitem__", checked)
    outs, _ = _run(model, overlap=True)
    assert len(outs) == 27
    assert not sites, f"t[index] = scalar at {sorted(sites)}: use index_fill_"


def test_a_step_stays_in_flight_and_finished_samples_arrive_one_step_later(pair):
    model, _ = pair
    got = {}
    for overlap in (False, True):
        s = Sampler(model, max_batch=2, max_seq_len=32, overlap=overlap)
        s.submit([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0))
        steps = [len(s.step())]
        assert (s._inflight is not None) == overlap  # launched, not recorded
        steps += [len(s.step()) for _ in range(4)]
        got[overlap] = steps
        assert s._inflight is None and not s.has_work()
    # 4 tokens: the first from the prefill, then 3 decode steps; overlap hands the sample out a step later
    assert got[False] == [0, 0, 1, 0, 0] and got[True] == [0, 0, 0, 1, 0]


def test_overlap_interrupt_records_the_step_in_flight_under_the_old_weights(tmp_path):
    """An interrupt first records the step in flight (stamped with the old version), then loads and
    re-prefills: the tokens after it are what the new model generates from that prefix."""
    save_hf("qwen2_bias", tmp_path / "a", seed=0)
    save_hf("qwen2_bias", tmp_path / "b", seed=1)
    m, _ = load_model(str(tmp_path / "a"), tokenizer=False)
    new, _ = load_model(str(tmp_path / "b"), tokenizer=False)
    prompt = [40, 41, 42, 43, 44, 45, 46]
    s = Sampler(m, max_batch=2, max_seq_len=64, overlap=True)
    s.submit(prompt, SamplingParams(max_new_tokens=10, temperature=0))
    out = s.step() + s.step() + s.step()  # the prefill's token, 2 decode steps recorded, a third in flight
    s.update_weights(lambda mod: mod.load_state_dict(new.state_dict()), version=1)
    while s.has_work():
        out += s.step()
    c, = out
    assert c.versions == [0] * 4 + [1] * 6 and c.n_interrupts == 1  # the step in flight counts as old
    ref = Sampler(new, max_batch=1, max_seq_len=64).generate([prompt + c.tokens[:4]],
                                                             SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert c.tokens[4:] == ref.tokens
    with torch.no_grad():
        lp_new = token_logp(new, torch.tensor([c.prompt_tokens + c.tokens]), 1.0)[0, len(prompt):]
    torch.testing.assert_close(c.logp_tensor()[5:], lp_new[5:], atol=1e-4, rtol=0)


def test_overlap_abort_records_the_step_in_flight(pair):
    """(A finish-mode update under overlap: tests/test_sampler.py, parametrized.) An abort with a
    step in flight: the partial samples include that step's token."""
    model, _ = pair
    s = Sampler(model, max_batch=2, max_seq_len=64, overlap=True)
    for q in ([5, 17, 33], [9] * 12, [40, 41, 42]):
        s.submit(q, SamplingParams(max_new_tokens=20, temperature=0))
    s.step(), s.step(), s.step()
    assert s._inflight is not None
    part = s.abort_all()
    assert len(part) == 2 and all(c.finish_reason == "interrupted" and len(c.tokens) == 4 for c in part)
    assert not s.has_work() and s._inflight is None


@pytest.mark.gpu
def test_overlap_over_cuda_graphs_draws_the_same_samples(tmp_path):
    """On CUDA the step in flight really runs while the host records: pinned copies, alternating
    buffers, frees and compaction queued behind it; the samples equal the graphs without overlap."""
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    prompts = [list(range(5, 5 + L)) for L in (3, 17, 8, 30, 12, 5)]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, n=5, stop_token_ids=(3, 4, 5, 6), seed=2)
    runs = {o: Sampler(model, max_batch=16, max_seq_len=72, cuda_graphs=True, overlap=o) for o in (False, True)}
    outs = {o: s.generate(prompts, params) for o, s in runs.items()}
    assert len({len(c.tokens) for c in outs[True]}) > 3 and runs[True].graphed.stats["replays"] > 10
    assert [c.tokens for c in outs[True]] == [c.tokens for c in outs[False]]
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b.logp_tensor(), a.logp_tensor(), atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_overlap_steps_never_make_the_host_wait_implicitly(tmp_path, monkeypatch):
    """Every step of a schedule (admissions with their prefill and first tokens, rows ending,
    compaction, plan rewrites, replays) queues its copies without a hidden sync: under
    set_sync_debug_mode("warn") the only waits are the explicit ones on the copies' events
    (`HostRing.wait`: reading sampled tokens, reusing a buffer; let through here). Every line
    that synchronised is reported at once, not only the first."""
    from common.engine.sampler.inflight import HostRing
    save_hf("qwen3_qknorm", tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda", tokenizer=False)
    prompts = [[5, 6, 7], [9] * 10, [3, 4, 8, 8], [7] * 6]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, n=4, stop_token_ids=(3, 4, 5, 6), seed=3)
    s = Sampler(model, max_batch=8, max_seq_len=48, cuda_graphs=True, overlap=True)  # 16 samples, 8 slots

    def round_():  # the same request ids every round: the same random streams, samples and buckets
        for i, p in enumerate(prompts):
            s.submit(p, params, request_id=i)
        done = []
        while s.has_work():
            done += s.step()
        return sorted(done, key=lambda c: (c.request_id, c.sample_idx))
    first = round_()  # captures every bucket this schedule meets (a capture syncs) ...
    round_()  # ... from the state a round leaves (its last step in flight), as the next round starts
    real_wait = HostRing.wait

    def explicit_wait(self, i):
        torch.cuda.set_sync_debug_mode("default")
        try:
            real_wait(self, i)
        finally:
            torch.cuda.set_sync_debug_mode("warn")
    monkeypatch.setattr(HostRing, "wait", explicit_wait)
    syncs = set()  # where each hidden sync was called from: the stack's frames outside torch

    def record(message, *_a, **_kw):
        if "called a synchronizing" in str(message):  # not the mode's own notice ("... synchronizing operations")
            syncs.add(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(traceback.extract_stack())
                                  if "site-packages" not in f.filename)[:300])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = round_()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not syncs, f"hidden syncs at {sorted(syncs)}"
    assert len({len(c.tokens) for c in out}) > 2  # samples ended at different steps: frees, refills, compaction
    assert [c.tokens for c in out] == [c.tokens for c in first]
