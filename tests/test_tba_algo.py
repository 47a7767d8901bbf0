"""TBA / GRPO trainer hooks: micro-batching invariance, batch composition, packing."""
import pytest
import torch

from common.contracts.batch import Trajectory, collate
from common.engine.checkpoints.hf_io import load_model
from common.contracts.micro import micro_batches, pack_ffd
from common.runtime.shared.buffer import ReplayBuffer
from tba.algo import GRPO, TBA, GRPOConfig, TBAConfig
from tests.close import assert_scaled_close, grad_scale
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    save_hf("qwen2_bias", d)
    return load_model(str(d), tokenizer=False)[0]


def _batch(n_groups=4, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for gid in range(n_groups):
        prompt = torch.randint(3, 97, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        for _ in range(k):
            c = int(torch.randint(1, 9, (1,), generator=g))
            trajs.append(Trajectory(prompt, torch.randint(3, 97, (c,), generator=g), -torch.rand(c, generator=g),
                                    torch.zeros(c, dtype=torch.long), float(torch.rand(1, generator=g)), gid * 7,
                                    ref_seq_logp=float(-10 * torch.rand(1, generator=g))))
    return collate(trajs)


def _grads(model, algo, batch):
    model.zero_grad(set_to_none=True)
    stats = algo.backward(model, batch, step=0)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize("make", [
    lambda budget: TBA(TBAConfig(beta_init=0.5), 4, 3, 0.7, budget),
    lambda budget: GRPO(GRPOConfig(kl_coef=0.1), 4, 3, 0.7, budget),
])
def test_micro_batching_does_not_change_the_gradient(model, make):
    batch = _batch()
    g_one, s_one = _grads(model, make(10_000), batch)  # 1 micro-batch of 4 groups
    g_four, s_four = _grads(model, make(1), batch)     # every group (TBA) / row (GRPO) alone
    assert len(micro_batches(batch, 1, group_aligned=True)) == 4
    scale = grad_scale(g_one)
    for n in g_one:
        # sums over rows in another order: within rounding of the model's gradient scale (tests/close.py)
        assert_scaled_close(g_four[n], g_one[n], rel=1e-5, scale=scale, rtol=1e-4, msg=n)
    assert s_one["loss"] == pytest.approx(s_four["loss"], rel=1e-5)
    assert any(g.abs().sum() > 0 for g in g_one.values())


def test_tba_step_changes_parameters_and_batch_rows(model):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    algo = TBA(TBAConfig(), 4, 3, 0.7, 1000)
    _grads(model, algo, _batch())
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])


def test_tba_next_batch_async_and_sync():
    buf = ReplayBuffer(64, 32)
    b = _batch(n_groups=4, k=3)
    trajs = [Trajectory(b.tokens[i, :int(b.prompt_lens[i])], b.tokens[i, int(b.prompt_lens[i]):int(b.prompt_lens[i] + b.comp_lens[i])],
                        b.behav_logp[i, int(b.prompt_lens[i]):int(b.prompt_lens[i] + b.comp_lens[i])],
                        torch.zeros(int(b.comp_lens[i]), dtype=torch.long), float(b.reward[i]), int(b.group_id[i]))
             for i in range(len(b))]
    algo = TBA(TBAConfig(m=1.0), 2, 3, 0.7, 1000)
    assert algo.next_batch(buf, 0, 0, sync=False) is None  # an empty buffer (--train.min_buffer=0): wait
    for g in range(4):
        buf.add(trajs[3 * g:3 * g + 3], trainer_version=0)
    a = algo.next_batch(buf, 0, 0, sync=False)
    assert len(a) == 6 and len(set(a.group_id.tolist())) == 2
    assert len(buf) == 12  # replay: nothing consumed
    s = algo.next_batch(buf, 0, 0, sync=True)
    assert len(s) == 6 and s.group_id.tolist() == [0] * 3 + [7] * 3  # oldest first, consumed
    assert algo.next_batch(buf, 0, 0, sync=True).group_id.tolist() == [14] * 3 + [21] * 3
    assert algo.next_batch(buf, 0, 0, sync=True) is None


def test_pack_ffd_respects_budget_and_balances():
    items = [(1, 50), (1, 40), (1, 30), (1, 30), (1, 20), (1, 10)]
    bins = pack_ffd(items, 100)
    assert sorted(i for b in bins for i in b) == list(range(6))
    for b in bins:
        assert len(b) * max(items[i][1] for i in b) <= 100
    assert pack_ffd([(1, 500)], 100) == [[0]]  # too large alone: its own micro-batch


def test_grpo_advantage_ignores_kl_noise_when_rewards_tie(model):
    """Equal rewards and pi = pi_ref up to float noise: advantages stay ~0 (not normalised noise)."""
    b = _batch(n_groups=2, k=3)
    b.reward[:] = 1.0
    b.ref_seq_logp = (b.behav_logp * b.loss_mask).sum(1) + 1e-5 * torch.randn(len(b))  # KL ~ 1e-5
    g, stats = _grads(model, GRPO(GRPOConfig(kl_coef=0.004), 2, 3, 0.7, 1000), b)
    assert stats["adv_abs"] < 1e-6
    b.reward[0] = 0.0  # a real reward difference still gives O(1) advantages
    _, stats = _grads(model, GRPO(GRPOConfig(kl_coef=0.004), 2, 3, 0.7, 1000), b)
    assert stats["adv_abs"] > 0.3
