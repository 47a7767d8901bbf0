"""The sampler-trainer mismatch (common/contracts/mismatch.py) and the masked corrections
(areal/loss.py's icepop_ppo_loss, geo_seq_mask_ppo_loss; tba/loss.py's GRPO variants): the stats on
planted log-prob differences, the masks on planted ratios (which tokens keep a gradient, the
denominator kept), the command line's choice of loss, and the metrics of real runs: every step of a
synchronous run of each algorithm measures the mismatch, an fp32 one to rounding."""
import math

import pytest
import torch

import run_gsm8k
from areal.algo import AReaL, AReaLConfig
from areal.loss import decoupled_ppo_loss, geo_seq_mask_ppo_loss, icepop_ppo_loss
from common.contracts.log import read_metrics
from common.contracts.mismatch import mismatch_stats, same_weights
from common.task import make_algo
from common.train import train
from tba.algo import GRPO, GRPOConfig
from tba.loss import geo_seq_mask_grpo_loss, grpo_loss, icepop_grpo_loss
from tests.test_e2e import _cfg, _prompts, _tba, toy_reward


def test_mismatch_stats_on_planted_differences():
    behav = torch.zeros(2, 4)
    trainer = torch.tensor([[0.0, 0.1, -0.2, 5.0], [1e-4, 0.0, 0.0, 0.0]])
    same = torch.tensor([[True, True, True, False], [True, False, False, False]])  # the 5.0 is another version's
    st = mismatch_stats(trainer, behav, same)
    d = torch.tensor([0.0, 0.1, -0.2, 1e-4])
    assert st["mismatch_tokens"] == 4 and st["mismatch_abs_max"] == pytest.approx(0.2)
    assert st["mismatch_abs_mean"] == pytest.approx(float(d.abs().mean()))
    assert st["mismatch_kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-5)
    assert st["mismatch_frac"] == 0.5  # 0.1 and 0.2 past 1e-3; 0 and 1e-4 not
    assert mismatch_stats(trainer, behav, torch.zeros(2, 4, dtype=torch.bool)) == {}  # nothing measured: no keys


def test_same_weights_marks_the_tokens_of_the_version_held():
    versions = torch.tensor([[-1, 3, 3], [-1, 2, 3]])
    mask = versions >= 0
    assert same_weights(versions, mask, 3).tolist() == [[False, True, True], [False, False, True]]
    assert not same_weights(versions, mask, None).any()  # the weights moved since their publish


def _planted(log_w):
    """(logp, prox, behav, adv, mask) with behaviour log-ratios `log_w` and u = 1."""
    log_w = torch.tensor(log_w)
    prox = torch.zeros_like(log_w)
    logp = prox.clone().requires_grad_(True)
    return logp, prox, -log_w, torch.ones(log_w.shape[0]), torch.ones_like(log_w, dtype=torch.bool)


def test_icepop_masks_tokens_outside_the_band_both_ways():
    b = 2.0
    logp, prox, behav, adv, mask = _planted([[0.0, math.log(1.9), math.log(2.1), -math.log(2.1)]])
    loss, st = icepop_ppo_loss(logp, prox, behav, adv, mask, mask_bound=b)
    loss.backward()
    g = logp.grad[0]
    assert g[2] == 0 and g[3] == 0  # w = 2.1 and 1/2.1: out of [1/2, 2]
    assert g[0] == pytest.approx(-1 / 4) and g[1] == pytest.approx(-1.9 / 4)  # w-weighted, mean over all 4
    assert st["masked_frac"] == 0.5
    inside = _planted([[0.1, -0.3, 0.2]])
    assert torch.allclose(icepop_ppo_loss(*inside, mask_bound=b)[0], decoupled_ppo_loss(*inside)[0])
    with pytest.raises(ValueError, match="mask_bound"):
        icepop_ppo_loss(*inside, mask_bound=0.5)


def test_geo_seq_mask_drops_whole_responses_by_their_geometric_mean():
    # row 0: one token at w = 3 but a geometric mean of 3^(1/4) (kept whole); row 1: mean log w = log 2.5
    logp, prox, behav, adv, mask = _planted([[math.log(3), 0.0, 0.0, 0.0], [math.log(2.5)] * 4])
    loss, st = geo_seq_mask_ppo_loss(logp, prox, behav, adv, mask, mask_bound=2.0)
    loss.backward()
    assert (logp.grad[1] == 0).all() and (logp.grad[0] != 0).all()
    assert logp.grad[0, 0] == pytest.approx(-3 / 8)  # kept, weighted by its own w, mean over all 8 tokens
    assert st["masked_seq_frac"] == 0.5 and st["masked_frac"] == 0.5


@pytest.mark.parametrize("fn", [icepop_grpo_loss, geo_seq_mask_grpo_loss])
def test_grpo_masks_keep_the_denominator_and_equal_grpo_inside_the_band(fn):
    lp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    behav = torch.tensor([[0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])  # row 1: ratio e (> 2) at every token
    mask, adv = torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, 1.0])
    loss, st = fn(lp, behav, mask, adv, mask_bound=2.0)
    loss.backward()
    assert (lp.grad[1] == 0).all() and st["masked_frac"] == 0.5
    assert lp.grad[0, 0] == pytest.approx(-1 / 6)  # the token mean over all six tokens
    same = torch.zeros(2, 3)
    assert torch.allclose(fn(same, same, mask, adv, mask_bound=2.0)[0], grpo_loss(same, same, mask, adv)[0])


def test_the_loss_is_chosen_on_the_command_line():
    algo = make_algo(run_gsm8k.make_config(["--algo=areal", "--areal.loss=icepop", "--areal.mask_bound=3"]))
    assert isinstance(algo, AReaL) and algo.loss_fn is icepop_ppo_loss and algo.cfg.mask_bound == 3
    algo = make_algo(run_gsm8k.make_config(["--algo=grpo", "--grpo.loss=geo_seq_mask"]))
    assert isinstance(algo, GRPO) and algo.loss_fn is geo_seq_mask_grpo_loss
    assert make_algo(run_gsm8k.make_config(["--algo=areal"])).loss_fn is decoupled_ppo_loss
    with pytest.raises(ValueError, match="areal.loss='nope'"):
        AReaL(AReaLConfig(loss="nope"), 2, 2, 1.0, 256, max_staleness=0)
    with pytest.raises(ValueError, match="grpo.loss='nope'"):
        GRPO(GRPOConfig(loss="nope"), 2, 2, 1.0, 256)


@pytest.mark.parametrize("algo", ["tba", "areal", "grpo"])
def test_every_step_of_a_sync_run_measures_the_mismatch(tmp_path, algo):
    """Lock-step (k = 1): every step trains on rows the weights it holds sampled, so every row of
    metrics has the mismatch; in fp32 the sampler's decode step and the trainer's full pass agree
    to rounding (their kernels differ: the sum over the sequence runs in another order)."""
    cfg = _cfg(tmp_path, mode="sync", steps=2, sync_every=1)
    cfg.algo = algo
    if algo == "tba":
        a = _tba(cfg)
    elif algo == "areal":
        a = AReaL(AReaLConfig(loss="icepop"), 4, cfg.gen.n, 1.0, 256, max_staleness=0)
        cfg.gen.ref_logp = False
    else:
        a = GRPO(GRPOConfig(), 4, cfg.gen.n, 1.0, 256)
    train(cfg, a, _prompts(), toy_reward, stop_token_ids=())
    rows = [r for r in read_metrics(f"{cfg.run_root}/{cfg.name}/metrics.jsonl") if "step_s" in r]
    assert len(rows) == 2 and all(r["mismatch_tokens"] > 0 for r in rows), rows[0].keys()
    assert all(r["mismatch_abs_max"] < 1e-3 and r["mismatch_kl"] < 1e-6 for r in rows), [
        (r["mismatch_abs_max"], r["mismatch_kl"]) for r in rows]
    if algo == "areal":
        assert all(r["masked_frac"] == 0.0 for r in rows)  # fp32: no token near the band's edge
