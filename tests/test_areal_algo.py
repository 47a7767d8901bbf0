"""AReaL's trainer hooks on a tiny model: micro-batch invariance, minibatch updates, batch
formation under the staleness bound, and behaviour log-probs across an interruption."""
import pytest
import torch

from areal.algo import AReaL, AReaLConfig, split_by_tokens
from areal.loss import ppo_loss
from common.contracts.batch import Trajectory
from common.engine.checkpoints.hf_io import load_model
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.ops import token_logp
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.step import update
from tests.close import assert_scaled_close, grad_scale
from tests.test_tba_algo import _batch
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    save_hf("qwen2_bias", d)
    return load_model(str(d), tokenizer=False)[0]


def _algo(budget=10_000, n_minibatches=1, loss_fn=None, **kw):
    cfg = AReaLConfig(n_minibatches=n_minibatches, **kw)
    extra = {} if loss_fn is None else {"loss_fn": loss_fn}
    return AReaL(cfg, prompts_per_step=4, n=3, temperature=0.7, micro_batch_tokens=budget, max_staleness=2, **extra)


def _prepared(model, algo, seed=0):
    """A batch with proximal log-probs off the current weights (as after a few updates), so
    ratios, clipping and behaviour weights are all non-trivial."""
    b = _batch(seed=seed)
    mb, = algo.minibatches(model, b, step=0)
    g = torch.Generator().manual_seed(seed)
    mb.extra["prox_logp"] = mb.extra["prox_logp"] + 0.3 * torch.randn(mb.tokens.shape, generator=g) * mb.loss_mask
    return mb


def _grads(model, algo, mb):
    model.zero_grad(set_to_none=True)
    stats = algo.backward(model, mb, step=0)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize("loss_fn", [None, ppo_loss])
def test_micro_batching_does_not_change_the_gradient(model, loss_fn):
    mb = _prepared(model, _algo())
    g_one, s_one = _grads(model, _algo(10_000, loss_fn=loss_fn), mb)  # one micro-batch of 12 rows
    g_rows, s_rows = _grads(model, _algo(1, loss_fn=loss_fn), mb)     # every row alone
    scale = grad_scale(g_one)
    for n in g_one:
        # sums over rows in another order: within rounding of the model's gradient scale (tests/close.py)
        assert_scaled_close(g_rows[n], g_one[n], rel=1e-5, scale=scale, rtol=1e-4, msg=n)
    assert s_one["loss"] == pytest.approx(s_rows["loss"], rel=1e-5)
    assert s_one["clip_frac"] == pytest.approx(s_rows["clip_frac"], rel=1e-5) and s_one["clip_frac"] > 0
    assert any(g.abs().sum() > 0 for g in g_one.values())


def test_prox_pass_matches_the_training_forward(model):
    """Before any update, prox_logp is what the training forward computes: u = 1 exactly."""
    algo = _algo()
    mb, = algo.minibatches(model, _batch(), step=0)
    with torch.no_grad():
        lp = token_logp(model, mb.tokens, 0.7, mb.loss_mask)
    torch.testing.assert_close(mb.extra["prox_logp"], lp, atol=1e-6, rtol=0)
    adv = mb.extra["advantages"]  # group-normalised: mean 0 inside each prompt's group
    for g in mb.group_id.unique():
        assert adv[mb.group_id == g].mean().abs() < 1e-5


def test_several_optimizer_steps_per_trainer_step(model):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshots = []
    real_step = opt.step

    def step_and_record(*a, **kw):
        out = real_step(*a, **kw)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return out
    opt.step = step_and_record
    algo = _algo(n_minibatches=4)
    stats, gnorm = update(algo, model, opt, _batch(), step=0, grad_clip=1.0)
    assert stats["opt_steps"] == 4 and len(snapshots) == 4 and gnorm > 0
    for prev, cur in zip([before] + snapshots, snapshots):  # every parameter moves at every update
        assert all(not torch.equal(prev[n], cur[n]) for n in cur)
    assert stats["clip_frac"] >= 0 and 0 < stats["behav_ess"] <= 1
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])


def test_split_by_tokens_is_balanced_and_complete():
    lengths = [50, 10, 40, 30, 30, 20, 5, 15]
    parts = split_by_tokens(lengths, 4)
    assert sorted(r for p in parts for r in p) == list(range(8))
    loads = [sum(lengths[r] for r in p) for p in parts]
    assert max(loads) - min(loads) <= 10
    assert split_by_tokens([3, 4], 4) == [[1], [0]]  # fewer rows than minibatches


def _traj(gid, version, n_tok=3):
    return Trajectory(torch.tensor([5, 6]), torch.arange(7, 7 + n_tok), -torch.ones(n_tok),
                      torch.full((n_tok,), version), 1.0, gid)


def test_next_batch_oldest_first_with_staleness_bound():
    algo = AReaL(AReaLConfig(), prompts_per_step=1, n=2, temperature=1.0, micro_batch_tokens=64, max_staleness=1)
    buf = ReplayBuffer(16, 16)
    for gid, v in [(0, 0), (1, 2), (2, 3)]:
        buf.add([_traj(gid, v), _traj(gid, v)], trainer_version=v)
    b = algo.next_batch(buf, step=3, version=3, sync=False)  # group 0 is 3 versions old: dropped
    assert b.group_id.tolist() == [1, 1] and buf.n_dropped_stale == 2
    sync = AReaL(AReaLConfig(), 1, 2, 1.0, 64, max_staleness=0)  # sync mode's eta (check_config settles it)
    assert sync.next_batch(buf, 4, 4, sync=True) is None     # sync: version-3 rows are stale at 4
    assert buf.n_dropped_stale == 4
    buf.add([_traj(3, 4), _traj(3, 4)], trainer_version=4)
    assert sync.next_batch(buf, 4, 4, sync=True).group_id.tolist() == [3, 3]
    assert algo.next_batch(buf, 4, 4, sync=False) is None    # each row used once
    with pytest.raises(ValueError, match="buffer_capacity"):
        algo.next_batch(ReplayBuffer(5, 16), 0, 0, sync=False)


def test_the_success_rate_filter_drops_groups_that_all_failed_or_all_passed():
    """AReaL's coding run: success_rate_lb 0.05, ub 0.95 over a group's mean reward; the dropped groups
    are counted (`n_filtered`: their places go back to the generators) and never trained."""
    algo = AReaL(AReaLConfig(success_rate_lb=0.05, success_rate_ub=0.95), prompts_per_step=2, n=2, temperature=1.0,
                 micro_batch_tokens=64, max_staleness=4)
    buf = ReplayBuffer(32, 16)
    for gid, rewards in [(0, (0.0, 0.0)), (1, (1.0, 0.0)), (2, (1.0, 1.0)), (3, (0.0, 1.0)), (0, (0.0, 1.0))]:
        buf.add([Trajectory(torch.tensor([5, 6]), torch.arange(7, 10), -torch.ones(3), torch.zeros(3, dtype=torch.long),
                            r, gid) for r in rewards], trainer_version=0)
    b = algo.next_batch(buf, step=0, version=0, sync=False)
    assert b.group_id.tolist() == [1, 1, 3, 3] and buf.n_filtered == 4 and buf.n_dropped_stale == 0
    b = algo.next_batch(buf, step=1, version=0, sync=False)  # prompt 0 again, this time half right: kept
    assert b is None and buf.stats()["n_unconsumed"] == 2   # one group short of a batch, and waiting
    off = AReaL(AReaLConfig(), 1, 2, 1.0, 64, max_staleness=4)
    assert off.next_batch(buf, 1, 0, sync=False).reward.tolist() == [0.0, 1.0]


def test_a_filter_that_drops_every_group_says_why_the_run_waits(caplog):
    algo = AReaL(AReaLConfig(success_rate_lb=0.05, success_rate_ub=0.95), 1, 2, 1.0, 64, max_staleness=8)
    buf = ReplayBuffer(64, 16)
    for gid in range(5):  # every answer wrong: nothing to train on, ever
        buf.add([Trajectory(torch.tensor([5]), torch.arange(7, 9), -torch.ones(2), torch.zeros(2, dtype=torch.long),
                            0.0, gid) for _ in range(2)], trainer_version=0)
        assert algo.next_batch(buf, 0, 0, sync=False) is None
    assert buf.n_filtered == 10 and caplog.text.count("the run waits for groups whose mean reward is in") == 1
    with pytest.raises(ValueError, match="max_staleness"):
        AReaL(AReaLConfig(), 1, 2, 1.0, 64, max_staleness=None)


def test_interrupted_trajectory_keeps_each_versions_logp(tmp_path):
    """Samples span a weight update: every token keeps the version and the log-prob of the
    weights that drew it (checked by recomputing with each version), through buffer and batch."""
    save_hf("llama_tied", tmp_path / "a", seed=0)
    save_hf("llama_tied", tmp_path / "b", seed=1)
    m0 = load_model(str(tmp_path / "a"), tokenizer=False)[0]
    m1 = load_model(str(tmp_path / "b"), tokenizer=False)[0]
    live = load_model(str(tmp_path / "a"), tokenizer=False)[0]
    s = Sampler(live, max_batch=4, max_seq_len=48, seed=3)
    prompts = [[5, 17, 33], [40, 41, 42, 43, 44], [9, 9]]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, n=2)
    for p in prompts:
        s.submit(p, params)
    done, steps = [], 0
    while s.has_work():
        if steps == 4:
            s.update_weights(lambda mod: mod.load_state_dict(m1.state_dict()), version=1, mode="interrupt")
        done += s.step()
        steps += 1
    spans = [c for c in done if 0 in c.versions and 1 in c.versions]
    assert spans and all(c.versions == sorted(c.versions) for c in done)
    buf = ReplayBuffer(32, 48)
    buf.add([Trajectory(torch.tensor(c.prompt_tokens), torch.tensor(c.tokens), c.logp_tensor(),
                        torch.tensor(c.versions), 0.0, c.request_id) for c in done])
    batch = buf.pop_oldest(len(done), max_staleness=None, current_version=1)
    with torch.no_grad():
        by_version = {0: token_logp(m0, batch.tokens, 0.7, batch.loss_mask),
                      1: token_logp(m1, batch.tokens, 0.7, batch.loss_mask)}
    for v, lp in by_version.items():
        sel = batch.loss_mask & (batch.versions == v)
        assert sel.any()
        torch.testing.assert_close(batch.behav_logp[sel], lp[sel], atol=1e-4, rtol=0)
    # and the other version's weights would not have given those log-probs
    sel = batch.loss_mask & (batch.versions == 1)
    assert (batch.behav_logp[sel] - by_version[0][sel]).abs().max() > 1e-2
