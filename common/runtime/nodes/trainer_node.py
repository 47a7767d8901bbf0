"""A trainer node after the first: its `train.trainer_devices` ranks of the trainer.

Runs in the one process torchrun starts on world rank j, 0 < j < `dist.trainer_nodes`
(common/runtime/nodes/world.py); the entry's `train` (common/train.py) hands over to `trainer_node` before anything else. This
process loads no model and draws nothing: it reads the run's store's address from torchrun's
store (the world forms only after the trainer has built its buffer, while these ranks must
join the trainer's group before that), waits for the setup the first node's trainer puts there
(`RankSetup`, the algorithm by value), spawns ranks j D .. (j + 1) D - 1 (`rank_main`, the very
loop the trainer node's own ranks run, reading commands from the store:
common/runtime/ranks/commands.py), then watches them and beats, while a helper thread joins the
torchrun world (every node must, though this one moves nothing over it). Checkpoints: each rank
writes its shards into the run's directory, so `run_root` must be one shared filesystem path on
every trainer node (as for any multi-node checkpoint with torch.distributed.checkpoint).

Ends: the trainer's "stop" command ends the ranks (after its final evaluation and checkpoint,
which need them); then this node says done/<j> and leaves, with an error when the trainer
stopped on one (the key trainer/end), so that torchrun's `--max-restarts` restarts every node. A rank that dies or hangs stops this
node: it shuts the others down (no process, no /dev/shm entry left), reports the failure under
failed/<j> (the trainer raises `RankFailed` naming this node: the shards are lost, the run
continues with --resume from the last checkpoint) and waits for the trainer's "stop". The
trainer lost (its store stops answering) is such a failure too.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from common.contracts.run_files import record
from common.runtime.launch import Workers
from common.runtime.nodes.world import join, member_keys
from common.runtime.ranks.commands import StoreCommands
from common.runtime.ranks.rank import rank_main
from common.runtime.watchdog import Heartbeats

_POLL_S = 0.05  # how often the node beats and looks at its ranks


def trainer_node(cfg) -> dict:
    """Run this node's trainer ranks until the trainer stops them; returns {} (the trainer logs)."""
    tc = cfg.train
    keys = member_keys(cfg, tc)
    joined: list = []  # the world's Node, or the exception that stopped the join
    here = Path(cfg.run_root) / cfg.name / f"node{keys.rank}"  # this node's own files
    try:
        with Workers() as workers:
            setup, algo_bytes = keys.get("trainer/setup")  # once the trainer has loaded (at most dist.timeout)
            ranks = range(keys.rank * setup.local, (keys.rank + 1) * setup.local)
            names = [f"trainer{r}" for r in ranks]
            hb = Heartbeats(names, here / "stacks")
            workers.watch(hb, tc.stall_timeout, tc.stall_action)
            for r, name in zip(ranks, names):
                workers.start(name, rank_main, r, setup, algo_bytes, None,
                              StoreCommands(keys.host, keys.port, keys.timeout.total_seconds(), keys.seals),
                              hb.beat_for(name))
            here.mkdir(parents=True, exist_ok=True)
            record(here / "workers.json")
            (here / "workers.json").write_text(json.dumps({"node": os.getpid(), **workers.pids()}) + "\n")
            print(f"[asyncrl] {keys.name(keys.rank)}: trainer ranks {names}", flush=True)

            def join_world():
                try:
                    joined.append(join(cfg, tc, port=keys.port))
                except BaseException as e:  # noqa: BLE001 - raised by the main thread
                    joined.append(e)
            joiner = threading.Thread(target=join_world, name="join-world", daemon=True)
            joiner.start()
            while workers.alive():  # until "stop" (the ranks then exit by themselves) or a failure
                keys.beat()
                workers.check()
                if joined and isinstance(joined[0], BaseException):
                    raise joined[0]
                keys.table = keys.table or (joined[0].table if joined else None)  # names hosts in reports
                time.sleep(_POLL_S)
            workers.check()  # a rank that failed after the last look
            if keys.has("trainer/end") and keys.get_text("trainer/end") == "failed":
                raise RuntimeError("the trainer stopped on a failure (its own log names it): this node stops "
                                   "non-zero too, so that torchrun --max-restarts starts the job again")
        keys.put_text(f"done/{keys.rank}", "1")
        print(f"[asyncrl] {keys.name(keys.rank)}: stopped", flush=True)
        return {}
    except BaseException as e:
        keys.leave_failed(e)
        raise
    finally:
        if joined and not isinstance(joined[0], BaseException):
            joined[0].close()
        keys.close()
