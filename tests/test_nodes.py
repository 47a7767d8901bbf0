"""Several nodes (common/runtime/nodes/), on one CPU machine: two torchrun
agents on 127.0.0.1 play a trainer node and a generator node (gloo over the loopback).

The end-to-end tests run tests/nodes_toy.py (test_e2e's toy task) under torchrun and, for the parity
check, without it (tests/nodes_run.py runs the agents; faults: tests/test_node_faults.py). The unit tests cover the pieces without a world: the trajectory wire format,
the claim on the store, the config checks.
"""
import json
import pickle
import re
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from common.contracts.batch import Trajectory
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.generator import Control
from common.runtime.nodes.trajectories import RemoteControl, pack, unpack
from common.runtime.nodes.world import check, is_generator_node, join
from common.runtime.train_config import DistConfig
from common.runtime.train_config import TrainConfig
from common.contracts.errors import UserError
from common.runtime.wire import Seals, SecretError, bound_store
from common.task import RunConfig
from tests.close import assert_update_close
from tests.nodes_run import SCRIPT, finish, start, steps, two_nodes, weights, weights_of
from tests.tiny import save_hf

# AReaL's loss is a mean of clipped ratio x advantage terms of order 1 that nearly cancel (a loss of
# ~0.005): each term is exact to fp32 rounding (1.2e-7 at 1), and two ranks, or packed rows, sum them
# in another order; so the bound is a few roundings at the terms' scale, not at the loss's
LOSS_ABS = 1e-6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes") / "model"
    save_hf("llama_tied", d)
    return d


def _one_node(root, args):
    """The run on one node (no torchrun), in `root`: the reference the several-node runs equal."""
    root.mkdir()
    finish(start([[sys.executable, str(SCRIPT), f"--run_root={root}", *args]], root), root)
    return root


# The one-node references, each shared by the tests that compare with it (one run each, not one per test).
TBA_SYNC = ["--train.mode=sync", "--train.steps=3"]
AREAL_SYNC = ["--algo=areal", "--train.mode=sync", "--train.steps=4"]


@pytest.fixture(scope="module")
def one_tba(model, tmp_path_factory):
    return _one_node(tmp_path_factory.mktemp("one_tba") / "one", [f"--model={model}", *TBA_SYNC])


@pytest.fixture(scope="module")
def one_areal(model, tmp_path_factory):
    return _one_node(tmp_path_factory.mktemp("one_areal") / "one", [f"--model={model}", *AREAL_SYNC])


def test_two_node_sync_run_equals_one_node(model, one_tba, tmp_path):
    """The sync TBA run: same final weights on 1 node and on 2 nodes (same seed), lock-step on both."""
    out = two_nodes(tmp_path, f"--run_root={tmp_path / 'two'}", f"--model={model}", *TBA_SYNC)
    assert any("generator node 0 (rank 1" in o and "4 weight versions in" in o for o in out), out
    one, two = weights(one_tba), weights(tmp_path / "two")
    # bit for bit: one trainer rank in both runs, the same batches (the losses below are equal), the
    # same ops in the same order; only where the generator runs differs
    assert one.keys() == two.keys() and not [k for k in one if not torch.equal(one[k], two[k])]
    rows = steps(tmp_path / "two")
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)  # every token from the published weights
    assert [r["loss"] for r in rows] == [r["loss"] for r in steps(one_tba)]
    assert rows[-1]["gen_syncs"] > 0 and rows[-1]["prompts_started"] >= 12  # the generator node's stats arrive


@pytest.mark.slow  # the suite's time: N trainer ranks (test_ranks_e2e.py) and a trainer on two nodes (below) are in it
def test_two_trainer_ranks_on_the_trainer_node_areal_sync_equals_one_node(model, one_areal, tmp_path):
    """AReaL, sync: 2 nodes whose trainer runs 2 ranks (their own group; the node-link process is
    in the world) give the 1-node, 1-rank run's final weights up to rounding."""
    args = [f"--model={model}", *AREAL_SYNC]
    out = two_nodes(tmp_path, f"--run_root={tmp_path / 'two'}", *args, "--train.trainer_devices=2")
    assert any("generator node 0 (rank 1" in o and "5 weight versions in" in o for o in out), out
    pids = json.loads((tmp_path / "two" / "toy" / "workers.json").read_text())
    assert {"trainer", "trainer1", "node-link"} <= pids.keys(), pids
    one, two = weights(one_areal), weights(tmp_path / "two")
    # two ranks' sharded sums vs one rank's: equal up to rounding, relative to what the run moved each tensor
    assert_update_close(weights_of(model), two, one, msg="2 ranks vs 1")
    rows = steps(tmp_path / "two")
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in steps(one_areal)], rel=1e-5, abs=LOSS_ABS)


@pytest.mark.slow  # the suite's time: a trainer on two nodes runs in test_node_faults.py
def test_trainer_on_two_nodes_sync_equals_one_node(model, one_areal, tmp_path):
    """Three nodes: the trainer's two ranks on two trainer nodes (the second node's rank reads its
    commands from the store and sends its rows to rank 0 at each publish), one generator node. The
    sync AReaL run gives the 1-node, 1-rank run's final weights up to rounding and its losses."""
    args = [f"--model={model}", *AREAL_SYNC]
    out = two_nodes(tmp_path, f"--run_root={tmp_path / 'two'}", *args, nnodes=3, trainer_nodes=2)
    assert any("generator node 0 (rank 2" in o and "5 weight versions in" in o for o in out), out
    assert any("trainer node (rank 1" in o and "trainer ranks ['trainer1']" in o and ": stopped" in o for o in out), out
    assert "trainer1" in json.loads((tmp_path / "two" / "toy" / "node1" / "workers.json").read_text())
    one, two = weights(one_areal), weights(tmp_path / "two")
    # two ranks' sharded sums vs one rank's: equal up to rounding, relative to what the run moved each tensor
    assert_update_close(weights_of(model), two, one, msg="2 ranks vs 1")
    rows = steps(tmp_path / "two")
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)  # the generator node sampled rank 1's rows too
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in steps(one_areal)], rel=1e-5, abs=LOSS_ABS)


@pytest.mark.slow  # the suite's time: reward workers on one node are in it (test_e2e.py, test_by_value.py)
def test_reward_workers_on_the_generator_node(model, tmp_path):
    """--train.reward_workers=1: the generator node scores in its own reward worker; the sync run
    gives the same losses and weights as on one node, where the trainer's node hosts it (not the
    run without a reward worker: its batches come together in another order)."""
    args = [f"--model={model}", *TBA_SYNC, "--train.reward_workers=1"]
    one_rw = _one_node(tmp_path / "one", args)
    out = two_nodes(tmp_path, f"--run_root={tmp_path / 'two'}", *args)
    assert any("1 generator(s) ['generator0'], 1 reward worker(s)" in o for o in out), out
    assert [r["loss"] for r in steps(tmp_path / "two")] == [r["loss"] for r in steps(one_rw)]
    one, two = weights(one_rw), weights(tmp_path / "two")
    # bit for bit: one trainer rank in both runs, the same scores (the losses above are equal)
    assert one.keys() == two.keys() and not [k for k in one if not torch.equal(one[k], two[k])]


def test_two_node_async_tba_with_lora(model, tmp_path):
    """An async TBA run to the end on two nodes (k = 2, unbounded staleness), training LoRA adapters:
    the generator node's store holds the adapters alone and its generator folds each version in."""
    out = two_nodes(tmp_path, f"--run_root={tmp_path}", f"--model={model}", "--train.steps=8", "--train.lora.rank=2")
    got = [int(m[1]) for o in out for m in re.finditer(r"(\d+) weight versions in", o)]
    assert got and got[0] >= 2, out  # version 0 and updates reached the generator node, as adapters
    rows = steps(tmp_path)
    assert len(rows) == 8 and rows[-1]["version"] == 4 and all(r["buffer_fill"] >= 16 for r in rows)
    assert (tmp_path / "toy" / "checkpoints" / "step_000008" / "adapter" / "adapter_model.safetensors").is_file()
    # the generator node's statistics reach the trainer's metrics (they ride with each batch, so not every step)
    assert any(r["gen_tok_s"] > 0 for r in rows) and rows[-1]["prompts_started"] >= 8


def test_two_node_async_areal_keeps_eta(model, tmp_path):
    """An async AReaL run to the end on two nodes with eta = 2, one generator on each node (the
    trainer node's beside the trainer, claiming on the same store): no trained row is staler, and
    both generators generated. The trainer step is paced to 1 s: unpaced, the 6 toy steps (~40 ms
    each) could end before the trainer node's generator had loaded its model on a busy 2-core box
    (seen once in CI: tokens per generator [864, 0]); real steps take seconds."""
    out = two_nodes(tmp_path, f"--run_root={tmp_path}", f"--model={model}", "--algo=areal", "--train.steps=6",
                    "--train.max_staleness=2", "--dist.trainer_node_generators=1", NODES_TOY_STEP_S="1.0")
    rows = steps(tmp_path)
    assert len(rows) == 6 and rows[-1]["version"] == 6
    assert max(int(s) for r in rows for s in r["staleness_hist"]) <= 2  # eta holds across nodes
    tokens = [json.loads(m[1]) for o in out for m in re.finditer(r"tokens per generator: (\[[^\]]*\])", o)]
    assert len(tokens) == 1 and len(tokens[0]) == 2 and min(tokens[0]) > 0, (tokens, out[0][-2000:])
    pids = json.loads((tmp_path / "toy" / "workers.json").read_text())
    assert "generator1" in pids  # numbered after the generator node's generator0
    cfg = json.loads((tmp_path / "toy" / "config.json").read_text())
    assert cfg["dist"]["trainer_nodes"] == 1 and cfg["algo"] == "areal" and cfg["gen"]["update_mode"] == "interrupt"


@pytest.mark.slow  # the suite's time: a killed generator node and its resume are in it (test_node_faults.py)
def test_a_failing_generator_node_stops_the_trainer_naming_it_and_the_run_resumes(model, tmp_path):
    """A generator process dies on the generator node: that node reports it and leaves, the trainer
    stops with NodeFailed naming the node, after a checkpoint of its last step; nothing is left
    running; the same command with --resume finishes the run from that checkpoint."""
    args = [f"--run_root={tmp_path}", f"--model={model}", "--train.mode=sync", "--train.steps=4"]
    out = two_nodes(tmp_path, *args, ok=False, NODES_TOY_DIE_AFTER="40")  # 10 groups: during step 3
    trainer = next(o for o in out if "[asyncrl] 2 nodes" in o)
    assert "NodeFailed" in trainer and "generator node 0 (rank 1" in trainer and "generator0" in trainer, trainer[-3000:]
    assert "a worker failed; checkpoint" in trainer
    assert [c.name for c in (tmp_path / "toy" / "checkpoints").glob("step_*")] == ["step_000002"]
    two_nodes(tmp_path, *args, "--resume")
    rows = steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["version"] == 4
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)  # lock-step across the restart too


# ---------------------------------------------------------------- pieces, no world
def _group(buffer: ReplayBuffer, gid: int, n: int = 3, v: int = 0):
    g = torch.Generator().manual_seed(gid)
    trajs = [Trajectory(torch.randint(3, 90, (2 + i,), generator=g), torch.randint(3, 90, (1 + 2 * i,), generator=g),
                        -torch.rand(1 + 2 * i, generator=g), torch.full((1 + 2 * i,), v + i % 2), float(i), gid, "stop")
             for i in range(n)]
    for t in trajs:
        t.ref_seq_logp = -1.5 * gid
    buffer.add(trajs, trainer_version=v)


def test_rows_travel_packed_and_land_as_added():
    outbox, a, b = ReplayBuffer(8, 16), ReplayBuffer(64, 16), ReplayBuffer(64, 16)
    for gid in range(2):
        _group(outbox, gid, v=gid)
        _group(a, gid, v=gid)  # what the trainer's buffer would hold on one node
    cols, end = outbox.take_rows(0)
    assert end == 6 and cols["tokens"].shape == (6, int((cols["prompt_len"] + cols["comp_len"]).max()))
    buf, header = pack(cols)
    assert buf.dtype == torch.uint8 and buf.numel() == header["nbytes"]
    b.add_rows(unpack(buf, header, b))
    for k in a.cols:  # exactly (empty rows' NaN reference log-probs included)
        torch.testing.assert_close(a.cols[k], b.cols[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert torch.equal(a.get(list(range(6))).tokens, b.get(list(range(6))).tokens)
    _group(outbox, 2)
    _group(outbox, 3)
    cols, end2 = outbox.take_rows(end)
    assert end2 == 12 and cols["group_id"].tolist() == [2, 2, 2, 3, 3, 3]
    _group(outbox, 4)
    _group(outbox, 5)
    with pytest.raises(RuntimeError, match="overwritten"):  # 12 rows since 0 in a ring of 8
        outbox.take_rows(end2 - 6)


def test_claims_on_the_store_are_atomic_and_bounded():
    """Four claimers race for a quota of 40 prompts: each index once, never past the quota."""
    seals = Seals(b"s" * 32, "run-1")
    server, _ = bound_store("127.0.0.1")
    rc = RemoteControl("127.0.0.1", server.port, 2, timedelta(seconds=30), seals)
    assert rc.claim() is None  # no quota published yet
    server.set("started", seals.seal("started", b"0 trainer", seq=0))
    server.set("quota", seals.seal("quota", b"40"))
    got, lock = [], threading.Lock()

    def claimer():
        c = RemoteControl("127.0.0.1", server.port, 2, timedelta(seconds=30), pickle.loads(pickle.dumps(seals)))
        while (i := c.claim()) is not None:
            with lock:
                got.append(i)

    ts = [threading.Thread(target=claimer) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(got) == list(range(40))
    server.set("quota", seals.seal("quota", b"42"))
    assert [rc.claim(), rc.claim(), rc.claim()] == [40, 41, None]
    assert rc.stats.shape == (2, len(Control.STAT_FIELDS))


def test_config_checks_and_single_node_path(monkeypatch):
    tc = TrainConfig()
    for dc, world, tc_kw, msg in [(DistConfig(trainer_nodes=2), 2, {}, "trainer_nodes < nodes"),
                                  (DistConfig(trainer_nodes=0), 2, {}, "trainer_nodes < nodes"),
                                  (DistConfig(trainer_nodes=2), 3, {"compile_blocks": True}, "compile_blocks"),
                                  (DistConfig(), 2, {"device": "cuda"}, "CPU"),
                                  (DistConfig(timeout=0), 2, {}, "timeout")]:
        with pytest.raises(ValueError, match=msg):
            check(dc, TrainConfig(**tc_kw), world)
    monkeypatch.delenv("ASYNCRL_RUN_SECRET", raising=False)
    with pytest.raises(SecretError, match="several nodes need a per-run secret"):  # before any connection
        check(DistConfig(), tc, 2)
    monkeypatch.setenv("ASYNCRL_RUN_SECRET", "x" * 32)
    with pytest.raises(SecretError, match="not a random token"):
        check(DistConfig(), tc, 2)
    monkeypatch.setenv("ASYNCRL_RUN_SECRET", "4f0c9e2b7a61d8355e9a0b6c1f7d2e48")
    check(DistConfig(), tc, 2)
    with pytest.raises(UserError, match="every interface"):
        check(DistConfig(bind="0.0.0.0"), tc, 2)
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")  # torchrun --master-addr=0.0.0.0, no --dist.bind: refused too
    with pytest.raises(UserError, match=r"MASTER_ADDR=0\.0\.0\.0 .*is every interface"):
        check(DistConfig(), tc, 2)
    check(DistConfig(bind="127.0.0.1"), tc, 2)  # --dist.bind names the one address: MASTER_ADDR is not listened on
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nproc-per-node=1"):
        check(DistConfig(), tc, 2)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert join(None, tc) is None  # no torchrun: the single-node path, no process group
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert join(None, tc) is None and not dist.is_initialized()  # a world of one is one node too
    cfg = RunConfig()
    assert not is_generator_node(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_generator_node(cfg)  # rank 0: the trainer (it plots)
    monkeypatch.setenv("RANK", "1")
    assert is_generator_node(cfg)  # rank 1 of 2 with one trainer node: it neither logs nor plots
