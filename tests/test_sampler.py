"""The KV-cache sampler against transformers' greedy generate and a full forward pass."""
import pytest
import torch

from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams, filter_logits
from common.contracts.ops import token_logp
from tests.tiny import ARCHS, save_hf

PROMPTS = [[5, 17, 33], [9] * 12, [40, 41, 42, 43, 44, 45, 46], [88], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def _hf_greedy(ref, prompt, n):
    out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                       eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers_with_refill(arch, tmp_path):
    ref = save_hf(arch, tmp_path)
    ours, _ = load_model(str(tmp_path), tokenizer=False)
    # 2 slots for 5 prompts of different lengths: slots are refilled mid-run
    s = Sampler(ours, max_batch=2, max_seq_len=64)
    outs = s.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0))
    for p, c in zip(PROMPTS, outs):
        assert c.tokens == _hf_greedy(ref, p, 12), arch
        assert c.finish_reason == "length"


def test_mixed_lengths_per_request_refill(pair):
    """Requests with different max_new_tokens: finished slots refill while others decode."""
    ours, ref = pair
    s = Sampler(ours, max_batch=3, max_seq_len=64)
    lens = [3, 15, 5, 9, 2]
    ids = [s.submit(p, SamplingParams(max_new_tokens=n, temperature=0)) for p, n in zip(PROMPTS, lens)]
    got = {}
    while s.has_work():
        for c in s.step():
            got[c.request_id] = c.tokens
    for rid, p, n in zip(ids, PROMPTS, lens):
        assert got[rid] == _hf_greedy(ref, p, n)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_recorded_logp_equals_full_forward(pair, temperature):
    ours, _ = pair
    s = Sampler(ours, max_batch=4, max_seq_len=64)
    outs = s.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=temperature, n=2, seed=3))
    for c in outs:
        seq = torch.tensor([c.prompt_tokens + c.tokens])
        with torch.no_grad():
            full = token_logp(ours, seq, temperature)[0, len(c.prompt_tokens):]
        torch.testing.assert_close(c.logp_tensor(), full, atol=1e-4, rtol=0)


def test_stop_tokens_and_max_new_tokens(pair):
    ours, ref = pair
    greedy = _hf_greedy(ref, PROMPTS[0], 10)
    stop = greedy[4]
    first = greedy.index(stop)
    s = Sampler(ours, max_batch=2, max_seq_len=64)
    c, = s.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(stop,)))
    assert c.tokens == greedy[:first + 1] and c.finish_reason == "stop"
    outs = s.generate(PROMPTS, SamplingParams(max_new_tokens=7, temperature=1.0, n=3))
    assert all(len(c.tokens) == 7 and c.finish_reason == "length" for c in outs)
    # max_seq_len bounds prompt + completion
    s2 = Sampler(ours, max_batch=2, max_seq_len=20)
    c, = s2.generate([PROMPTS[4]], SamplingParams(max_new_tokens=10, temperature=0))
    assert len(PROMPTS[4]) + len(c.tokens) == 20 and c.finish_reason == "length"


def test_seed_reproducible_and_n_samples_differ(pair):
    ours, _ = pair
    p = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=11)
    a = Sampler(ours, max_batch=3, max_seq_len=64).generate(PROMPTS, p)
    b = Sampler(ours, max_batch=3, max_seq_len=64).generate(PROMPTS, p)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert len({tuple(c.tokens) for c in a[:4]}) > 1  # samples of one prompt differ
    c = Sampler(ours, max_batch=3, max_seq_len=64).generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=12))
    assert [x.tokens for x in a] != [x.tokens for x in c]


def test_n_samples_share_prefill_greedy(pair):
    ours, ref = pair
    s = Sampler(ours, max_batch=3, max_seq_len=64)  # n=5 > 3 free slots: admitted in two parts
    outs = s.generate([PROMPTS[2]], SamplingParams(max_new_tokens=6, temperature=0, n=5))
    want = _hf_greedy(ref, PROMPTS[2], 6)
    assert [c.tokens for c in outs] == [want] * 5
    assert s.stats["prefill_tokens"] == len(PROMPTS[2])  # one prefill, kept for the second part


def test_interrupt_with_same_weights_is_invisible(pair):
    ours, _ = pair
    p = SamplingParams(max_new_tokens=12, temperature=0)
    plain = Sampler(ours, max_batch=3, max_seq_len=64).generate(PROMPTS, p)
    s = Sampler(ours, max_batch=3, max_seq_len=64)
    for q in PROMPTS:
        s.submit(q, p)
    got, step = {}, 0
    while s.has_work():
        if step in (2, 5, 9):
            s.update_weights(lambda m: None, version=step)
        for c in s.step():
            got[c.request_id] = c
        step += 1
    assert [got[i].tokens for i in range(len(PROMPTS))] == [c.tokens for c in plain]
    assert s.stats["interrupts"] > 0
    c0 = got[0]
    assert c0.versions[:2] == [0, 0] and c0.versions[-1] == 9 and c0.n_interrupts == 3
    assert c0.versions == sorted(c0.versions)


def test_interrupt_applies_new_weights_at_once(tmp_path):
    """After an interrupt, new tokens follow the new model exactly (KV recomputed), old tokens keep logp."""
    save_hf("qwen2_bias", tmp_path / "a", seed=0)
    save_hf("qwen2_bias", tmp_path / "b", seed=1)
    m, _ = load_model(str(tmp_path / "a"), tokenizer=False)
    new, _ = load_model(str(tmp_path / "b"), tokenizer=False)
    s = Sampler(m, max_batch=2, max_seq_len=64)
    s.submit(PROMPTS[2], SamplingParams(max_new_tokens=10, temperature=0))
    out = s.step() + s.step() + s.step()  # 4 tokens: 1 from prefill + 3 decode steps
    s.update_weights(lambda mod: mod.load_state_dict(new.state_dict()), version=1)
    while s.has_work():
        out += s.step()
    c, = out
    assert c.versions == [0] * 4 + [1] * 6 and c.n_interrupts == 1
    # tokens after the interrupt are what the new model generates greedily from that prefix
    ref = Sampler(new, max_batch=1, max_seq_len=64).generate([PROMPTS[2] + c.tokens[:4]], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert c.tokens[4:] == ref.tokens
    seq = torch.tensor([c.prompt_tokens + c.tokens])
    with torch.no_grad():
        lp_new = token_logp(new, seq, 1.0)[0, len(PROMPTS[2]):]
    torch.testing.assert_close(c.logp_tensor()[5:], lp_new[5:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_finish_mode_drains_then_applies(pair, overlap):
    ours, _ = pair
    s = Sampler(ours, max_batch=2, max_seq_len=64, overlap=overlap)
    p = SamplingParams(max_new_tokens=5, temperature=0)
    for q in PROMPTS[:4]:
        s.submit(q, p)
    s.step()
    s.update_weights(lambda m: None, version=7, mode="finish")
    outs = []
    while s.has_work():
        outs += s.step()
    by_id = {c.request_id: c for c in outs}
    assert by_id[0].versions == [0] * 5 and by_id[1].versions == [0] * 5  # in flight: old weights
    assert by_id[2].versions == [7] * 5 and by_id[3].versions == [7] * 5  # admitted after the sync
    assert s.stats["interrupts"] == 0


def test_bad_input_rejected_others_unaffected(pair):
    ours, ref = pair
    s = Sampler(ours, max_batch=2, max_seq_len=16)
    good = s.submit(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0))
    for bad, msg in [([[]], "empty prompt"), ([list(range(3, 20))], "max_seq_len"),
                     ([PROMPTS[0]], "n=0")]:
        params = SamplingParams(max_new_tokens=4, temperature=0, n=0 if msg == "n=0" else 1)
        with pytest.raises(ValueError, match=msg):
            s.generate([PROMPTS[1]] + bad, params)
    for kw, msg in [(dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")]:
        with pytest.raises(ValueError, match=msg):
            s.submit(PROMPTS[1], SamplingParams(**kw))
    out = []
    while s.has_work():
        out += s.step()
    assert len(out) == 1 and out[0].request_id == good and out[0].tokens == _hf_greedy(ref, PROMPTS[0], 4)


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_logits(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.8, 0.5]))
    keep = torch.isfinite(out)
    assert keep.tolist() == [[True, True, False, False], [True, True, False, False], [True, False, False, False]]
    from common.engine.sampler.sampling import sample  # sampling is restricted to the nucleus too
    u = torch.rand(2000, generator=torch.Generator().manual_seed(0))
    toks, _ = sample(logits[:1].expand(2000, -1), torch.zeros(2000, dtype=torch.bool), torch.zeros(2000, dtype=torch.long),
                     torch.full((2000,), 0.8), u)
    assert set(toks.tolist()) == {0, 1}
    frac0 = (toks == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.05


def test_abort_returns_partial(pair):
    ours, _ = pair
    s = Sampler(ours, max_batch=2, max_seq_len=64)
    for q in PROMPTS[:3]:
        s.submit(q, SamplingParams(max_new_tokens=20, temperature=0))
    s.step(); s.step()
    part = s.abort_all()
    assert len(part) == 2 and all(c.finish_reason == "interrupted" and len(c.tokens) == 3 for c in part)  # prefill + 2 decodes
    assert not s.has_work()


def test_masked_token_logp_equals_full(pair):
    """Skipping logits on prompt positions changes nothing on the completion positions, grads included."""
    ours, _ = pair
    tokens = torch.randint(3, 97, (3, 12))
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, 4:9], mask[1, 2:12], mask[2, 7:8] = True, True, True
    full = token_logp(ours, tokens, 0.7)
    part = token_logp(ours, tokens, 0.7, mask)
    torch.testing.assert_close(part, full * mask, atol=1e-5, rtol=0)
    g1 = torch.autograd.grad((full * mask).sum(), ours.lm_head.weight)[0]
    g2 = torch.autograd.grad(part.sum(), ours.lm_head.weight)[0]
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


def test_progress_counts_samples_and_waits_for_a_wave_before_an_eta(pair, capsys):
    """`generate(progress=...)`: a bar of the samples finished under the label given, with no ETA
    while every sample runs at once (5 prompts x 2 in 16 rows), one once a wave has finished (2 rows)."""
    ours, _ = pair
    params = SamplingParams(max_new_tokens=6, temperature=0, n=2)
    Sampler(ours, max_batch=16, max_seq_len=64).generate(PROMPTS, params, progress="eval: test")
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("eval: test: 100%") and "10/10 [" in last and "<" not in last
    Sampler(ours, max_batch=2, max_seq_len=64).generate(PROMPTS, params, progress=True)
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("generate: 100%") and "10/10 [" in last and "<00:00" in last
