"""The settings the paper presets need, each with the meaning read from the papers' code: the
learning-rate schedule (warmup-stable-decay, linear, cosine or constant, transformers' stepping),
AdamW's beta2 and epsilon reaching the optimizer, and AReaL's reward shaping, token-weighted batch
normalisation, `early_stop_imp_ratio` and `mask_too_long` (areal/algo.py, areal/loss.py)."""
import inspect
import math

import pytest
import torch

from areal.loss import shaped_reward, token_normalised_advantages
from common.contracts.batch import FINISH_REASONS
from common.runtime.step import OneRank, make_optimizer
from common.runtime.train_config import TrainConfig, lr_lambda, warmup_steps
from tests.test_areal_algo import _algo, _batch, _grads, model  # noqa: F401 - the module fixture


@pytest.mark.parametrize("kw, want", [
    ({"warmup_steps": 2, "decay_steps": 0}, [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ({"warmup_steps": 0, "decay_steps": 10}, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]),  # TL;DR's
    ({"warmup_steps": 0, "decay_steps": 4}, [1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0]),  # the last 4
    ({"warmup_steps": 2, "stable_steps": 2, "decay_steps": 4, "lr_schedule": "cosine"},
     [0.5, 1, 1, 1, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0, 0, 0]),
    ({"warmup_steps": 2, "stable_steps": 2, "decay_steps": 12, "lr_schedule": "linear"},  # ends mid-decay
     [0.5, 1, 1, 1, 11 / 12, 10 / 12, 9 / 12, 8 / 12, 7 / 12, 6 / 12]),
    ({"warmup_steps": 3, "decay_steps": 5, "lr_schedule": "constant"}, [1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 1, 1]),
    ({"warmup_fraction": 0.2, "warmup_steps": 7}, [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1]),  # int(0.2 x 10) = 2
])
def test_the_lr_schedule_is_transformers_warmup_stable_decay_stepped_before_each_update(kw, want):
    tc = TrainConfig(steps=10, **kw)
    f = lr_lambda(tc)
    assert [f(s) for s in range(10)] == pytest.approx(want)
    assert warmup_steps(TrainConfig(steps=73, warmup_fraction=0.001)) == 0  # AReaL's int(): none at 73


def test_adams_beta2_and_eps_reach_the_optimizer(model):  # noqa: F811
    opt = make_optimizer(model, 1e-3, 0.0, beta2=0.999, eps=1e-5)
    g = opt.param_groups[0]
    assert (g["betas"], g["eps"]) == ((0.9, 0.999), 1e-5)
    assert "tc.adam_beta2, tc.adam_eps" in inspect.getsource(OneRank.__init__)  # the trainer's own, from train.adam_*


def test_areals_reward_shaping_and_token_weighted_normalisation():
    s = torch.tensor([0.0, 1.0, 1.0])
    assert shaped_reward(s, bias=0.5, scaling=10.0, clip=20.0).tolist() == [-5.0, 5.0, 5.0]  # AReaL's +-5
    assert shaped_reward(torch.tensor([10.0]), scaling=5.0, clip=20.0).tolist() == [20.0]
    r, n = torch.tensor([1.0, 0.0]), torch.tensor([3, 1])
    adv = token_normalised_advantages(r, n)  # mean over tokens: 0.75, std: sqrt(3/16)
    assert adv.tolist() == pytest.approx([(1 - 0.75) / (0.75 ** 0.5 / 2 + 1e-5), -0.75 / (0.75 ** 0.5 / 2 + 1e-5)])
    assert (adv * n).sum().abs() < 1e-5  # zero mean over tokens, not over sequences


def test_a_micro_batch_past_early_stop_imp_ratio_adds_no_gradient(model):  # noqa: F811
    algo = _algo(budget=1, early_stop_imp_ratio=2.0)  # every row its own micro-batch
    mb, = algo.minibatches(model, _batch(), step=0)
    g_all, st = _grads(model, algo, mb)
    assert st["early_stopped"] == 0.0  # u = 1 before any update
    mb.extra["prox_logp"][0] = mb.extra["prox_logp"][0] - 2.0 * mb.loss_mask[0]  # row 0: u = e^2 > 2
    g_stop, st = _grads(model, algo, mb)
    solo = _algo(budget=1, early_stop_imp_ratio=None)
    g_free, _ = _grads(model, solo, mb)
    assert 0 < st["early_stopped"] < 1  # row 0 only (its share of the tokens)
    rest = mb.select(torch.arange(1, mb.tokens.shape[0]))
    rest.extra = {k: v[1:] for k, v in mb.extra.items()}
    g_rest, _ = _grads(model, solo, rest)
    w = float(rest.loss_mask.sum() / mb.loss_mask.sum())  # the dropped row stays in the denominator
    for k in g_stop:
        torch.testing.assert_close(g_stop[k], g_rest[k] * w, atol=1e-6, rtol=1e-4)
    assert any((g_stop[k] - g_free[k]).abs().max() > 0 for k in g_stop)


def test_mask_too_long_takes_cut_rows_out_of_the_loss_and_the_statistics(model):  # noqa: F811
    b = _batch()
    b.extra["finish"][:3] = FINISH_REASONS.index("length")  # group 0 cut at the token limit
    algo = _algo(mask_too_long=True, adv_norm="batch")
    mb, = algo.minibatches(model, b, step=0)
    assert not mb.loss_mask[:3].any() and mb.loss_mask[3:].any()
    assert mb.extra["advantages"][:3].abs().sum() == 0 and mb.extra["advantages"][3:].mean().abs() < 1e-5
    _, st = _grads(model, algo, mb)
    assert st["masked_too_long"] == 3
    kept, = _algo(adv_norm="batch").minibatches(model, _batch(), step=0)
    assert kept.loss_mask[:3].any()  # off by default
