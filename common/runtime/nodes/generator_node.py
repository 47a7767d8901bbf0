"""A generator node: its generators, a weight receiver and a trajectory sender.

Runs in the one process torchrun starts on a node whose role is "generator"
(common/runtime/nodes/world.py); the entry's `train` (common/train.py) hands over to `generator_node` right after the world is
joined, with the same arguments every node got from the same command line. This process
loads no model: it builds the node's `WeightStore` (the trainer's layout, from the "setup" key)
and a local `ReplayBuffer` as the outbox, starts its `train.reward_workers` reward workers (an
expensive reward is scored on the node that generates) and `train.n_generators` generator processes
(`generator_main`, as on one node: a store, a buffer and a control), a
`WeightReceiver` and a `TrajSender` thread, then watches all of them and the key "stop".

Generator r of node j is generator number j * n_generators + r everywhere (its sampler seed,
its row of the statistics), so generator node 0 with one generator samples exactly what the
single-node run's generator 0 samples (same seed, same prompt order, same weights).

Faults: a generator that dies or hangs, a broken transfer or the lost store stops this node:
it shuts its generators down (no process, no /dev/shm entry left), reports the failure under
failed/<rank> (the trainer raises `NodeFailed` naming the node and checkpoints), waits for the
trainer's "stop" (torchrun's agents end every node's process once one exits with an error, so
leaving first would kill the trainer before its checkpoint), then leaves the world. The trainer
lost (its store, which lives in the trainer's process, stops answering) is such a failure too,
named as the trainer node's; the wait for "stop" then ends at once.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from common.contracts.run_files import record
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.generator import generator_main
from common.runtime.launch import Workers
from common.runtime.nodes.trajectories import RemoteControl, TrajSender
from common.runtime.nodes.weights import WeightReceiver
from common.runtime.reward_service import start_reward_workers
from common.runtime.nodes.world import Node
from common.runtime.watchdog import Heartbeats
from common.runtime.shared.weights import WeightStore

_POLL_S = 0.05  # how often the node looks at its workers, its threads and the key "stop"


def generator_node(node: Node, cfg, prompts, reward_fn, stop_token_ids: tuple, reward_factory=None) -> dict:
    """Run this generator node until the trainer says stop; returns {} (the trainer logs).
    With train.reward_workers > 0 the node runs that many reward workers of its own (`reward_factory`)."""
    tc, threads = cfg.train, []
    try:
        setup = node.get("setup")  # waits for the trainer's model load (at most dist.timeout)
        store = WeightStore(setup["shapes"], device="cpu")
        outbox = ReplayBuffer(tc.buffer_capacity, setup["max_seq_len"], setup["pad_id"])
        G = tc.n_generators
        control = RemoteControl(node.host, node.table[0]["port"], G * len(node.gen_ranks), node.timeout, node.seals)
        threads = [WeightReceiver(node, store), TrajSender(node, outbox, control.stats, node.cfg.ship_every)]
        for t in threads:
            t.start()
        ranks = [node.index * G + r for r in range(G)]
        names = [f"generator{g}" for g in ranks]
        here = Path(cfg.run_root) / cfg.name / f"node{node.rank}"  # this node's own files (on its own disk)
        with Workers() as workers:
            hb = Heartbeats([f"reward{r}" for r in range(tc.reward_workers)] + names, here / "stacks")
            workers.watch(hb, tc.stall_timeout, tc.stall_action)
            if tc.reward_workers > 0:
                reward_fn = start_reward_workers(workers, hb, tc.reward_workers, reward_factory, G,
                                                 cfg.gen.error_reward, first=ranks[0])
            for g, name in zip(ranks, names):
                workers.start(name, generator_main, g, cfg.gen, cfg.model, cfg.ref_model or cfg.model, store,
                              outbox, control, prompts, reward_fn, cfg.seed, setup["max_seq_len"],
                              tuple(stop_token_ids), "cpu", setup["precision"], beat=hb.beat_for(name),
                              lora=tc.lora if tc.lora.on else None)  # adapters move between nodes too
            # who is who on this node, as the trainer's workers.json on its own
            here.mkdir(parents=True, exist_ok=True)
            record(here / "workers.json")
            (here / "workers.json").write_text(json.dumps({"node": os.getpid(), **workers.pids()}) + "\n")
            print(f"[asyncrl] {node.name(node.rank)}: {G} generator(s) {names}, {tc.reward_workers} reward "
                  "worker(s)", flush=True)
            while not node.beat():
                workers.check()
                for t in threads:
                    t.check()
                time.sleep(_POLL_S)
            workers.shutdown()  # no more groups: the sender's last batch flushes what is in the outbox
        for t in reversed(threads):
            t.stop()
            t.check()
        node.put_text(f"done/{node.rank}", "1")
        print(f"[asyncrl] {node.name(node.rank)}: stopped; {threads[0].received} weight versions in, "
              f"{threads[1].rows} trajectories out", flush=True)
        return {}
    except BaseException as e:
        for t in threads:
            t.halt.set()
        node.leave_failed(e)
        raise
    finally:
        node.close()
