"""Whole nodes failing, on one CPU machine (two torchrun agents on 127.0.0.1, tests/nodes_run.py):
a generator node SIGKILLed or hung (SIGSTOP) mid-run, the trainer node SIGKILLed; and torchrun's
own restart (`--max-restarts`, on one node and across two) resuming the run by itself.

Each test asserts what the runtime promises: the run stops within `train.stall_timeout` (plus a
bounded slack for the checkpoint and the agents' exit), naming the node and its role; every
process the run listed (trainer, its workers, each node's main process and generators) is gone;
nothing new of the run's is left in /dev/shm (bench/leaks.py); the run continues from its last checkpoint.
"""
import os
import re
import signal
import sys
import time

import pytest

from tests.nodes_run import SCRIPT, agent, alive, finish, free_port, logs_dir, output, run_pids, start, steps, \
    two_nodes, wait_for
from bench.leaks import leaked, shm_entries
from tests.tiny import save_hf

# train.stall_timeout in these runs. A node is silent until its main loop beats, so this must also
# cover a node's start (imports, model, the world): 8 s was too short for three nodes on a 2-core
# AVX2 box, where a resumed run named its generator node silent before it had started.
STALL_S = 20
SLACK_S = 25  # what a stop may take past the stall timeout: checkpoint, leaving the world, the agents' exit


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults") / "model"
    save_hf("llama_tied", d)
    return d


def _shm() -> set:
    """Our kind of /dev/shm entries now (torch's segments, multiprocessing's named semaphores): the
    `before` that `_all_gone` compares with (bench/leaks.py)."""
    return shm_entries()


def _args(tmp_path, model, *more) -> list[str]:
    # a paced async run long enough to be hit mid-way; a checkpoint every 2 steps to resume from
    return [f"--run_root={tmp_path}", f"--model={model}", "--train.steps=14", "--train.checkpoint_every=2",
            f"--train.stall_timeout={STALL_S}", *more]


def _running(tmp_path, model, *more, nnodes: int = 2, trainer_nodes: int = 1):
    """Start a two-node run and wait until it trained 3 steps; (agents, logs, pids of the run)."""
    logs, port = logs_dir(tmp_path), free_port()
    # static rendezvous: torchrun's own store on the trainer's node, so a generator node's agent
    # leaving does not take the trainer's agent down with it (tests/nodes_run.py: agent)
    procs = start([agent(port, *_args(tmp_path, model, *more), node_rank=k, nnodes=nnodes, trainer_nodes=trainer_nodes)
                   for k in range(nnodes)], logs, NODES_TOY_STEP_S="0.5")
    try:
        wait_for(lambda: len(steps(tmp_path)) >= 3, 300)
        pids = wait_for(lambda: (p := run_pids(tmp_path / "toy")) and "node1/node" in p and p, 30)
    except BaseException:
        for p in procs:  # the agents' sessions; the workers' own sessions end with their agents
            os.killpg(p.pid, signal.SIGKILL)
        raise
    return procs, logs, pids


def _trainer_out(logs, nnodes: int = 2) -> str:
    return next(o for o in output(logs, nnodes) if f"[asyncrl] {nnodes} nodes" in o)


def _all_gone(pids: dict, shm_before: set) -> None:
    """Every process the run listed has ended, and no new entry of the run's stays in /dev/shm (one
    that another program holds, or a torch segment another process made, is not the run's: bench/leaks.py)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and ({n for n, p in pids.items() if alive(p)} or leaked(shm_before, pids.values())):
        time.sleep(0.2)
    assert not {n: p for n, p in pids.items() if alive(p)}, "left running"
    left = leaked(shm_before, pids.values())
    assert not left, f"left in /dev/shm: {sorted(left)}"


def test_a_killed_generator_node_stops_the_run_naming_it_and_the_run_resumes(model, tmp_path):
    shm = _shm()
    procs, logs, pids = _running(tmp_path, model)
    os.kill(pids["node1/node"], signal.SIGKILL)  # the whole node's process, without a word
    t = time.monotonic()
    finish(procs, logs, ok=False, bound_s=STALL_S + SLACK_S)
    assert time.monotonic() - t <= STALL_S + SLACK_S
    out = _trainer_out(logs)
    assert "NodeFailed" in out and "generator node 0 (rank 1" in out, out[-3000:]
    assert "a worker failed; checkpoint" in out
    _all_gone(pids, shm)
    done = len(steps(tmp_path))
    assert done < 14
    two_nodes(tmp_path, *_args(tmp_path, model, "--resume"))
    rows = steps(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 15)) and rows[-1]["version"] == 7


@pytest.mark.parametrize("victim, said", [
    ("node1/trainer1", r"RankFailed: trainer node \(rank 1.*worker 'trainer1' died"),  # the node reports its rank
    # the whole node: nobody reports (a minute on 2 cores: slow, to keep the suite's time)
    pytest.param("node1/node", r"RankFailed: trainer node \(rank 1.*silent for \d+ s", marks=pytest.mark.slow)])
def test_a_trainer_node_failing_stops_the_run_naming_it(model, tmp_path, victim, said):
    """Three nodes, the trainer's two ranks on two trainer nodes; SIGKILLed: the second node's rank
    (its node reports it) or the node's whole process (its rank dies with it: the trainer's
    collective breaks and the node is named as silent within the stall timeout). The trainer stops
    with RankFailed naming the node and writes no checkpoint (the rank's shards are gone); nothing
    is left running; --resume on three nodes continues from the last periodic checkpoint."""
    shm = _shm()
    procs, logs, pids = _running(tmp_path, model, nnodes=3, trainer_nodes=2)
    os.kill(pids[victim], signal.SIGKILL)
    t = time.monotonic()
    # the generator node, told to stop by the trainer, stops cleanly
    finish(procs, logs, ok=[False, False, True], bound_s=STALL_S + SLACK_S)
    assert time.monotonic() - t <= STALL_S + SLACK_S
    out = _trainer_out(logs, 3)
    assert re.search(said, out), out[-3000:]
    assert "a trainer rank failed; no checkpoint" in out
    _all_gone(pids, shm)
    if victim == "node1/trainer1":  # the resume is the same either way: run it once
        assert len(steps(tmp_path)) < 14
        two_nodes(tmp_path, *_args(tmp_path, model, "--resume"), nnodes=3, trainer_nodes=2)
        rows = steps(tmp_path)
        assert [r["step"] for r in rows] == list(range(1, 15)) and rows[-1]["version"] == 7


@pytest.mark.slow  # the suite's time: a hung worker (test_watchdog.py) and a silent trainer node are in it
def test_a_hung_generator_node_stops_the_run_within_the_stall_timeout(model, tmp_path):
    """SIGSTOP: the node's process neither beats nor answers (its generators still run). The trainer
    names it after stall_timeout, checkpoints and leaves; once the node runs again it finds the
    trainer gone and leaves too, with its generators."""
    shm = _shm()
    procs, logs, pids = _running(tmp_path, model)
    os.kill(pids["node1/node"], signal.SIGSTOP)
    t = time.monotonic()
    trainer = next(p for p, o in zip(procs, output(logs)) if "[asyncrl] 2 nodes" in o)
    try:
        trainer.wait(STALL_S + SLACK_S)
    finally:
        os.kill(pids["node1/node"], signal.SIGCONT)
    assert time.monotonic() - t <= STALL_S + SLACK_S
    out = _trainer_out(logs)
    assert re.search(r"generator node 0 \(rank 1.*silent for \d+ s", out) and "dead or hung" in out, out[-3000:]
    assert "a worker failed; checkpoint" in out
    finish(procs, logs, ok=False, bound_s=60)
    gen_out = next(o for o in output(logs) if "[asyncrl] 2 nodes" not in o)
    # what it meets first: the trainer's store gone, or its outbox overrun while it stood still
    assert re.search(r"generator node 0 \(rank 1.* failed:", gen_out), gen_out[-3000:]
    _all_gone(pids, shm)


@pytest.mark.slow  # the suite's time: a failing trainer node (above) stops the generator node too
def test_a_killed_trainer_node_stops_the_generator_node_naming_it(model, tmp_path):
    shm = _shm()
    procs, logs, pids = _running(tmp_path, model)
    os.kill(pids["trainer"], signal.SIGKILL)
    finish(procs, logs, ok=False, bound_s=STALL_S + SLACK_S)
    gen_out = next(o for o in output(logs) if "[asyncrl] 2 nodes" not in o)
    assert "NodeFailed" in gen_out and "lost trainer node (rank 0" in gen_out, gen_out[-3000:]
    _all_gone(pids, shm)
    two_nodes(tmp_path, *_args(tmp_path, model, "--resume", "--train.steps=8"))  # continues from the last checkpoint
    assert [r["step"] for r in steps(tmp_path)] == list(range(1, 9))


@pytest.mark.slow  # the suite's time: the restart across nodes (below, c10d) covers torchrun's restart and the resume
def test_torchrun_restarts_continue_the_run_from_its_checkpoint(model, tmp_path):
    """torchrun --max-restarts=1 (one node, one process): a generator dies during step 3 of the
    first attempt, the trainer checkpoints and exits non-zero, torchrun starts it again, and the
    trainer resumes from that checkpoint by itself (no --resume on the command line)."""
    logs = logs_dir(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1",
           str(SCRIPT), f"--run_root={tmp_path}", f"--model={model}", "--train.mode=sync", "--train.steps=4"]
    out = finish(start([cmd], logs, NODES_TOY_DIE_AFTER="40"), logs)[0]
    assert "generator0" in out and "a worker failed; checkpoint" in out, out[-3000:]
    assert "torchrun restart 1: continuing from the last checkpoint" in out
    assert re.search(r"resumed from \S+step_000002 at step 2", out)
    rows = steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["version"] == 4
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)  # lock-step across the restart


@pytest.mark.parametrize("rendezvous, nnodes, trainer_nodes", [
    ("c10d", 2, 1),  # the restart across nodes; the trainer's ranks on two nodes: test_nodes.py (35 s: slow)
    pytest.param("static", 3, 2, marks=pytest.mark.slow),
    pytest.param("static", 2, 1, marks=pytest.mark.slow)])  # the static rendezvous is in 3-2 already
def test_torchrun_restarts_across_nodes_continue_the_run(model, tmp_path, rendezvous, nnodes, trainer_nodes):
    """torchrun --max-restarts=1, two nodes (or three, the trainer's ranks on two of them): the
    generator node's generator dies during step 3, the trainer checkpoints and stops naming it (on
    two trainer nodes both nodes' ranks write their shards); every agent starts its node again
    (with c10d the trainer's may do so without counting a restart of its own), the new world forms
    under its own store prefix, and the trainer resumes from the checkpoint by itself (every
    trainer node's ranks load it): every step once, in lock-step."""
    args = [f"--run_root={tmp_path}", f"--model={model}", "--train.mode=sync", "--train.steps=4"]
    logs, port = logs_dir(tmp_path), free_port()
    cmds = [agent(port, *args, torchrun=("--max-restarts=1",), node_rank=None if rendezvous == "c10d" else k,
                  nnodes=nnodes, trainer_nodes=trainer_nodes) for k in range(nnodes)]
    out = finish(start(cmds, logs, NODES_TOY_DIE_AFTER="40"), logs)
    trainer = next(o for o in out if f"[asyncrl] {nnodes} nodes" in o)
    assert f"generator node 0 (rank {trainer_nodes}" in trainer and "a worker failed; checkpoint" in trainer, \
        trainer[-3000:]
    assert "torchrun restart 1: continuing from the last checkpoint" in trainer
    assert re.search(r"resumed from \S+step_000002 at step 2", trainer)
    assert trainer.count(f"[asyncrl] {nnodes} nodes:") == 2  # the world formed twice
    rows = steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["version"] == 4
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)


def test_sigterm_checkpoints_the_last_step_and_the_run_resumes(model, tmp_path):
    """SIGTERM to the trainer (what torchrun's agent sends when it ends a job, or Slurm when it
    preempts one) is its Ctrl-C: a checkpoint of the last completed step, its generators stopped."""
    logs, shm = logs_dir(tmp_path), _shm()
    args = [str(SCRIPT), *_args(tmp_path, model, "--train.checkpoint_every=0")]
    procs = start([[sys.executable, *args]], logs, NODES_TOY_STEP_S="0.5")
    wait_for(lambda: len(steps(tmp_path)) >= 3, 300)
    pids = run_pids(tmp_path / "toy")
    os.kill(pids["trainer"], signal.SIGTERM)
    out = finish(procs, logs, ok=False, bound_s=SLACK_S)[0]
    got = re.search(r"interrupted \(Ctrl-C or SIGTERM\) at step (\d+): checkpoint \S+step_0*(\d+)", out)
    assert got and got[1] == got[2], out[-3000:]
    assert [r["step"] for r in steps(tmp_path)] == list(range(1, int(got[1]) + 1))  # the checkpoint's step is logged
    _all_gone(pids, shm)
    logs = logs_dir(tmp_path)
    finish(start([[sys.executable, *args, "--resume", "--train.steps=8"]], logs), logs)
    assert [r["step"] for r in steps(tmp_path)] == list(range(1, 9))
