"""The trainer's side of the generator nodes: `TrainerLink`, the node layer's `Peers`
(common/runtime/peers.py), which the trainer loop calls at fixed points; the entry (common/train.py)
hands it to the loop on the first trainer node of a torchrun world.

Two processes on the trainer node. The trainer never joins the torchrun world (a process holds
one default group, and its own `train.trainer_devices` ranks keep theirs); it hosts the run's
store and does everything that goes through keys. Its node-link process (`link_main`, spawned
once the buffer exists) is world rank 0: it holds the groups, sends each publish (the weight
store is shared memory, so it reads the slot the trainer's ranks just wrote) and runs the
ingest thread that fills the trainer's buffer (shared memory too). In the order the loop
(common/runtime/trainer.py) calls it:
  TrainerLink(cfg, tc, store, setup)  hosts the store, puts what generator nodes need to build
                   their own store and buffer under the key "setup" (layout, precision, lengths)
  control(...)    the admission gate: the trainer's `Control`, mirrored to the store; starts
                  the node-link process and waits until the world is joined
  publish(v)      after the local publish: the weights to every generator node (nodes/weights.py),
                  by the node-link process, while this process keeps checking the nodes
  check()         raise `NodeFailed` if a node reported a failure, went silent (its beat counter
                  still for train.stall_timeout s: dead or hung) or a transfer broke (the
                  node-link process reports it), `WorkerError` if the node-link process died
  stop()          the run is over: the key "stop", then (bounded) every generator node's "done"
                  while the ingest thread still drains their last batches, then the node-link
                  process leaves the world
  __exit__        stop (also on errors), then close the store: the others are done with it
"""
from __future__ import annotations

import queue
import time

from common.runtime.generator import Control
from common.runtime.launch import Workers
from common.runtime.nodes.keys import NodeFailed, RunKeys
from common.runtime.nodes.trajectories import Ingest, RemoteControl, StoreControl
from common.runtime.nodes.weights import send_weights
from common.runtime.nodes.world import generation, host_keys, join
from common.runtime.peers import Peers
from common.runtime.step import RankFailed
from common.runtime.shared.weights import WeightStore

_STOP_ON_ERROR_S = 30.0  # after a failure, how long the trainer waits for the other nodes to stop
_LOOK_S = 0.5  # how often the trainer reads the other nodes' failure reports and beats (store round trips)
_POLL_S = 0.001  # how often the trainer looks at the node-link process's replies while it waits for one


class NodeWatch:
    """The trainer's view of the other nodes (main thread): `check` raises `NodeFailed` for a
    failure a node reported, or a node whose beat counter (beat/<rank>, moved by its main loop
    every 50 ms) stood still for `stall_timeout` s (0 = off): died without a word, or hangs. For
    another trainer node it raises `RankFailed`: its ranks' shards are lost, nothing whole to save."""

    def __init__(self, keys: RunKeys, stall_timeout: float):
        self.keys, self.stall_timeout, self._looked = keys, stall_timeout, 0.0
        self._beats = {r: (-1, time.monotonic()) for r in range(1, keys.world)}  # rank -> (count, when it last moved)

    def _raise(self, e: NodeFailed) -> None:
        if e.rank is not None and e.rank < self.keys.cfg.trainer_nodes:
            raise RankFailed(str(e), e.worker) from e
        raise e

    def check(self) -> None:
        now = time.monotonic()
        if now - self._looked < _LOOK_S:
            return
        self._looked = now
        failed = self.keys.failure()
        if failed is not None:
            self._raise(failed)
        for r, (n, since) in self._beats.items():
            got = self.keys.store.add(f"beat/{r}", 0)  # add 0: read a counter that may not exist yet
            if got != n:
                self._beats[r] = (got, now)
            elif self.stall_timeout > 0 and now - since > self.stall_timeout:
                self._raise(NodeFailed(f"{self.keys.name(r)} has been silent for {now - since:.0f} s "
                                       "(train.stall_timeout): dead or hung", self.keys.name(r), r))


def link_main(cfg, port: int, start: int, run: str, weights: WeightStore, buffer, t, stats, gens_per_node: int,
              recv_timeout: float, commands, replies, *, stop_event) -> None:
    """The node-link process (module docstring): joins the world as rank 0 (its `start`: the trainer's
    `generation`) with the trainer's store at `port` and its run id `run`, replies ("joined", table), then serves ("publish", v) with ("published", v) until
    the trainer stops it. A broken transfer is replied as ("failed", message, node, rank), after
    which it only waits to be stopped (the trainer checkpoints, then stops every node)."""
    node = join(cfg, cfg.train, port, start, run)
    ingest = None
    try:
        replies.put(("joined", node.table))
        ingest = Ingest(node, buffer, t, stats, gens_per_node, recv_timeout)
        ingest.start()

        def check():  # inside a publish: stop when told to, and a broken receive is as fatal
            if stop_event.is_set():
                raise NodeFailed("the trainer stopped during a publish")
            if ingest.error is not None:
                raise ingest.error if isinstance(ingest.error, NodeFailed) else NodeFailed(str(ingest.error))
        try:
            while not stop_event.is_set():
                check()
                try:
                    what, v = commands.get(timeout=0.01)
                except queue.Empty:
                    continue
                if what == "publish":
                    send_weights(node, weights, v, check)
                    replies.put(("published", v))
        except NodeFailed as e:
            if not stop_event.is_set():
                replies.put(("failed", str(e), e.worker, e.rank))
                stop_event.wait()
    finally:
        if ingest is not None:
            ingest.stop()
        node.close()


class TrainerLink(Peers):
    """Module docstring. `setup`: what a generator node cannot work out itself (picklable)."""

    def __init__(self, cfg, tc, store: WeightStore, setup: dict):
        self.cfg, self.store, self._stopped = cfg, store, False
        self.stall_timeout = tc.stall_timeout if tc.stall_action == "stop" else 0.0  # a silent node fails the run
        self.keys = host_keys(cfg, tc)
        self.workers = self._replies = None
        self._published, self._link_failed = -1, False
        self.keys.put("setup", {**setup, "shapes": store.shapes()})
        self.watch = NodeWatch(self.keys, self.stall_timeout)

    def local_generators(self, n: int) -> range:
        """The trainer node's `dist.trainer_node_generators` generators, numbered after every
        generator node's `n`."""
        first = n * len(self.keys.gen_ranks)
        return range(first, first + self.keys.cfg.trainer_node_generators)

    def generator_control(self, control: Control):
        """Beside the generator nodes, a `RemoteControl` that claims on the store (one counter for
        all) and writes its statistics straight into the trainer's table."""
        return RemoteControl(self.keys.host, self.keys.port, 0, self.keys.timeout, self.keys.seals, stats=control.stats)

    def control(self, ctx, buffer, prompts_per_version: int, max_staleness, n_generators: int) -> Control:
        """`n_generators`: per node (train.n_generators)."""
        keys = self.keys
        rows = n_generators * len(keys.gen_ranks) + keys.cfg.trainer_node_generators  # generator nodes', then ours
        c = StoreControl(keys, ctx, prompts_per_version, max_staleness, rows)
        self.workers = Workers()
        self._commands, self._replies = self.workers.queue(), self.workers.queue()
        self.workers.start("node-link", link_main, self.cfg, keys.port, generation(), keys.run_id, self.store, buffer, c.t, c.stats,
                           n_generators, self.stall_timeout, self._commands, self._replies)
        deadline = time.monotonic() + keys.timeout.total_seconds()
        while keys.table is None:  # the world joined (every node there, one config), or why not
            self.check()
            if time.monotonic() > deadline:
                raise NodeFailed(f"the trainer node's link to the other nodes did not join the world within "
                                 f"{keys.timeout.total_seconds():.0f} s (dist.timeout)")
            time.sleep(0.01)
        return c

    def publish(self, version: int) -> None:
        self._commands.put(("publish", version))
        while self._published < version:
            self.check()
            time.sleep(_POLL_S)

    def pids(self) -> dict[str, int]:
        """{"node-link": pid} once started (workers.json)."""
        return self.workers.pids() if self.workers is not None else {}

    def _read_replies(self) -> None:
        while True:
            try:
                r = self._replies.get_nowait()
            except queue.Empty:
                return
            if r[0] == "joined":
                self.keys.table = r[1]
            elif r[0] == "published":
                self._published = r[1]
            elif r[0] == "failed":  # its ingest or a send broke: it drains nothing any more
                self._link_failed = True
                raise NodeFailed(*r[1:])

    def check(self) -> None:
        if self.workers is not None:
            self._read_replies()
            self.workers.check()  # the node-link process died: WorkerError
        self.watch.check()

    def stop(self, timeout: float | None = None, failed: int | None = None) -> list[str]:
        """Stop every generator node (module docstring); returns the nodes that did not say done.
        `failed`: a node known dead or hung, not waited for."""
        if self._stopped:
            return []
        self._stopped, keys = True, self.keys
        keys.put_text("stop", "1")
        deadline = time.monotonic() + (keys.timeout.total_seconds() if timeout is None else timeout)
        left = [r for r in keys.gen_ranks if r != failed]
        while left and self._draining() and time.monotonic() < deadline:  # their last batches need the ingest
            left = [r for r in left if not keys.has(f"done/{r}")]
            time.sleep(0.05)
        if self.workers is not None:
            self.workers.shutdown()  # the node-link process leaves the world
        return [keys.name(r) for r in left]

    def _draining(self) -> bool:
        """Whether the node-link process still receives (a node's last batch waits for it)."""
        if self.workers is None or not self.workers.alive():
            return False
        try:
            self._read_replies()
        except NodeFailed:
            pass
        return not self._link_failed

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            late = self.stop(_STOP_ON_ERROR_S if exc_type is not None else None,
                             exc.rank if isinstance(exc, NodeFailed) else None)
            if late:
                print(f"[asyncrl] no word from {', '.join(late)} after the stop", flush=True)
        finally:
            self.keys.close()
        return False
