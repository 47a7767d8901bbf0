"""The trainer as N FSDP2 ranks on CPU (gloo, 2 ranks, tiny models): a step's updated weights,
its stats and the weights it publishes equal the one-rank step (TBA, GRPO, AReaL; odd numbers
of micro-batches, a rank with none; train.reshard "pass" and "update"); checkpoints resume across N (2 -> 1, 1 -> 2) exactly.
Whole runs with 2 ranks (learning, resume, faults) are in tests/test_ranks_e2e.py."""
from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
import torch.distributed as dist

from areal.algo import AReaL, AReaLConfig, split_by_tokens
from common.contracts.batch import Trajectory, collate
from common.engine.machine.precision import Precision
from common.contracts.micro import micro_batches
from common.contracts.ops import token_logp
from common.runtime.pickling import NotSendable
from common.runtime.ranks.fsdp import rank_device, resolve_reshard
from common.runtime.ranks.group import TrainerGroup
from common.runtime.ranks.publish import shard_rows
from common.runtime.train_config import TrainConfig, check_config
from common.runtime.trainer_start import _gen_device
from common.runtime.shared.weights import WeightStore
from common.train import trainer_ranks
from tba.algo import GRPO, TBA, GRPOConfig, TBAConfig
from tests.close import assert_update_close
from tests.tiny import save_hf

FP32 = Precision("fp32", "aten", "fp32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    save_hf("llama_tied", d)  # tied: the head's shards are the embedding's
    return str(d)


def _batch(model_dir, n_groups=3, k=4, seed=0) -> "Batch":  # noqa: F821
    """Groups of k responses; behaviour log-probs = the model's own plus noise, so AReaL's and
    GRPO's ratios are near 1 but not equal (clipping, caps and weights all take part)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for gid in range(n_groups):
        prompt = torch.randint(3, 97, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for _ in range(k):
            c = int(torch.randint(2, 9, (1,), generator=g))
            trajs.append(Trajectory(prompt, torch.randint(3, 97, (c,), generator=g), torch.zeros(c),
                                    torch.zeros(c, dtype=torch.long), float(torch.rand(1, generator=g)), gid,
                                    ref_seq_logp=float(-20 * torch.rand(1, generator=g))))
    b = collate(trajs)
    with torch.no_grad():
        lp = token_logp(FP32.load(model_dir, role="trainer", tokenizer=False)[0], b.tokens, 0.7, b.loss_mask)
    b.behav_logp = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * b.loss_mask
    return b


def _run(model_dir, run_dir, algo, batches, world, load=None, save=None, reshard="pass", pack_rows=False):
    """Steps on `batches` through the trainer's `world` ranks (one: OneRank; more: TrainerGroup);
    returns (full weights, the weights a generator pulls from the store, last stats). Optionally
    loads / saves a checkpoint; `pack_rows`: train.pack_rows (tests/test_packing.py)."""
    tc = TrainConfig(trainer_devices=world, lr=1e-3, weight_decay=0.01, grad_clip=1.0, stall_timeout=120,
                     reshard=reshard, pack_rows=pack_rows)
    model = FP32.load(model_dir, role="trainer", tokenizer=False)[0].train()
    model.pack_rows = pack_rows  # as `trainer_model` sets it; the other ranks take it from tc
    store = WeightStore.from_module(model)
    with trainer_ranks(tc)(model, tc, FP32, model_dir, algo, store, run_dir) as g:
        sched = torch.optim.lr_scheduler.LambdaLR(g.opt, lambda s: 1.0 / (1 + s))
        step = g.load(load, sched).step if load else 0
        for b in batches:
            stats, gnorm = g.update(b, step, sched.get_last_lr()[0], tc.grad_clip)
            sched.step()
            step += 1
        if save:
            g.save(save, step, sched, counters={"version": step})
        g.publish(step + 1)
        full = {k: v.detach().clone() for k, v in g.full_model().state_dict().items()}
    reader = FP32.load(model_dir, role="generator", tokenizer=False)[0]
    assert store.load_into(reader) == step + 1
    return full, {k: v.clone() for k, v in reader.state_dict().items()}, {**stats, "grad_norm": gnorm}


def _tba(budget):
    return TBA(TBAConfig(beta_init=0.5, beta_final=0.5), 3, 4, 0.7, budget)


def _grpo(budget):
    return GRPO(GRPOConfig(), 3, 4, 0.7, budget)


def _areal(budget):
    return AReaL(AReaLConfig(n_minibatches=2, behav_imp_weight_cap=1.3), 3, 4, 0.7, budget, max_staleness=2)


@pytest.mark.parametrize("make, budget, reshard", [
    (_tba, 60, "pass"), (_tba, 10_000, "pass"), (_grpo, 40, "pass"), (_areal, 24, "pass"),
    (_tba, 60, "update"), (_areal, 24, "update")],
    ids=["tba_3_micro", "tba_1_micro", "grpo", "areal", "tba_3_micro_reshard_update", "areal_reshard_update"])
def test_two_ranks_equal_one_rank(model_dir, tmp_path, make, budget, reshard):
    batch = _batch(model_dir)
    n_micro = len(micro_batches(batch, budget, group_aligned=make is _tba))
    if make is _areal:  # the proximal pass over the whole batch, then each minibatch's micro-batches
        parts = split_by_tokens((batch.prompt_lens + batch.comp_lens).tolist(), 2)
        n_micro = [n_micro] + [len(micro_batches(batch.select(p), budget)) for p in parts]
        assert all(n % 2 for n in n_micro), n_micro  # every list leaves rank 1 a padding pass
    else:
        assert n_micro in (1, 3, 5, 7)  # odd: rank 1 runs a zero-loss pass (with 1: only that)
    one, one_pub, s1 = _run(model_dir, tmp_path / "one", make(budget), [batch], world=1)
    two, two_pub, s2 = _run(model_dir, tmp_path / "two", make(budget), [batch], world=2, reshard=reshard)
    init = FP32.load(model_dir, role="trainer", tokenizer=False)[0].state_dict()
    for k in one:
        assert not torch.equal(one[k], init[k]), k  # the step moved every parameter
        assert torch.equal(two_pub[k], two[k]), k  # the shards all landed, nothing else did (a copy: exact)
    # sharded sums run in another order: equal up to rounding, relative to the step's update (tests/close.py)
    assert_update_close(init, two, one, msg="2 ranks vs 1")
    assert_update_close(init, two_pub, one_pub, msg="published (what generators pull), 2 ranks vs 1")
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-6), k  # loss, stats: the batch's, not rank 0's part
    if make is _areal:
        assert 0 < s1["capped_frac"] < 1  # the noisy behaviour policy matters: some tokens capped, not all


def test_shard_rows_follow_torch_chunk():
    for rows in (1, 2, 5, 97, 576):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world)
            for r in range(world):
                start = shard_rows(rows, r, world)
                n = chunks[r].numel() if r < len(chunks) else 0
                assert n == 0 or int(chunks[r][0]) == start


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)], ids=["2->1", "1->2"])
def test_resume_across_rank_counts(model_dir, tmp_path, first, then):
    """Two steps with a checkpoint between, the checkpoint written with `first` ranks and read
    with `then`: the same weights as two steps without a break (model and AdamW state exact)."""
    a, b = _batch(model_dir, seed=1), _batch(model_dir, seed=2)
    ref, _, _ = _run(model_dir, tmp_path / "ref", _tba(60), [a, b], world=1)
    ck = tmp_path / "ck"
    _run(model_dir, tmp_path / "first", _tba(60), [a], world=first, save=ck)
    path = ck / "checkpoints" / "step_000001"
    assert len(list((path / "state").glob("*.distcp"))) == first  # one shard file per rank
    got, _, _ = _run(model_dir, tmp_path / "then", _tba(60), [b], world=then, load=path)
    # one of the two runs has 2 ranks: rounding as in test_two_ranks_equal_one_rank (the checkpoint
    # itself is exact: a wrong moment or weight would move the tensors by their update)
    init = FP32.load(model_dir, role="trainer", tokenizer=False)[0].state_dict()
    assert_update_close(init, got, ref, msg=f"{first} -> {then} ranks vs no break")


def test_a_loss_that_cannot_reach_the_ranks_is_refused_before_anything_starts(model_dir, tmp_path):
    """A lambda or a notebook's function reaches the ranks by value (tests/test_by_value.py); one
    holding what cannot be pickled is refused, naming it, before any rank starts."""
    lock = threading.Lock()
    algo = _tba(60)
    algo.loss_fn = lambda *a: lock.locked()  # as a notebook cell might write it
    model = FP32.load(model_dir, role="trainer", tokenizer=False)[0]
    with pytest.raises(NotSendable, match=r"algorithm cannot be sent .*attribute 'loss_fn' -> closure variable 'lock'"):
        TrainerGroup(model, TrainConfig(trainer_devices=2), FP32, model_dir, algo, WeightStore.from_module(model), tmp_path)
    assert not dist.is_initialized() and multiprocessing.active_children() == []


def test_generators_take_the_gpus_the_trainer_leaves(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    tc = check_config(TrainConfig(device="cuda", trainer_devices=4, n_generators=0))
    assert tc.n_generators == 4  # the preset's 0: one generator per GPU left
    assert [_gen_device("cuda", r, 4) for r in range(4)] == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]
    assert [rank_device("cuda", r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU: the generator shares it
    assert check_config(TrainConfig(device="cuda", n_generators=0)).n_generators == 1
    assert _gen_device("cuda", 0, 1) == "cuda:0"
    with pytest.raises(ValueError, match="trainer_devices=2: this machine has 1 GPUs"):
        check_config(TrainConfig(device="cuda", trainer_devices=2))
    assert check_config(TrainConfig(n_generators=0)).n_generators == 1  # CPU
    with pytest.raises(ValueError, match="compile_blocks with trainer_devices > 1"):
        check_config(TrainConfig(trainer_devices=2, compile_blocks=True))
    assert check_config(TrainConfig(compile_blocks=True)).compile_blocks  # one rank: allowed


def test_reshard_auto_is_update_on_cpu_and_pass_on_gpus():
    assert resolve_reshard("auto", "cpu") == "update"
    assert resolve_reshard("auto", "cuda") == resolve_reshard("auto", "cuda:1") == "pass"
    assert resolve_reshard("pass", "cpu") == "pass" and resolve_reshard("update", "cuda") == "update"
    with pytest.raises(ValueError, match="train.reshard='zero3'"):
        resolve_reshard("zero3", "cpu")
