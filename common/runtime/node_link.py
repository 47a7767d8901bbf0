"""The trainer's side of the generator nodes, as one object the trainer loop calls at fixed
points; with no other node (`node` None: the single-node path) every call does nothing.

Runs in the trainer (rank 0, the launching process on the trainer node). What it does, in
the order `train` (common/runtime/trainer.py) calls it:
  TrainerLink(node, store, setup)  puts what generator nodes need to build their own store and
                                   buffer under the key "setup" (layout, precision, lengths)
  publish(v)      after the local publish: the weights to every generator node (node_weights.py)
  control(...)    the admission gate: the trainer's `Control`, mirrored to the store, and the
                  ingest thread that fills the trainer's buffer (node_traj.py)
  check()         raise `NodeFailed` if a node reported a failure, went silent (its beat counter
                  still for train.stall_timeout s: dead or hung) or a transfer broke; read here,
                  in the trainer's main thread, never behind a transfer another thread waits in
  stop()          the run is over: the key "stop", then (bounded) every generator node's "done"
                  while the ingest thread still drains their last batches, then the thread stops
  __exit__        stop (also on errors), then leave the world; the trainer hosts the store, so
                  it leaves last
"""
from __future__ import annotations

import time

from common.runtime.generator import Control
from common.runtime.node_traj import Ingest, StoreControl
from common.runtime.node_weights import send_weights
from common.runtime.nodes import Node, NodeFailed
from common.runtime.weights import WeightStore

_STOP_ON_ERROR_S = 30.0  # after a failure, how long the trainer waits for the other nodes to stop
_LOOK_S = 0.5  # how often the trainer reads the other nodes' failure reports and beats (store round trips)


class NodeWatch:
    """The trainer's view of the generator nodes (main thread): `check` raises `NodeFailed` for a
    failure a node reported, or a node whose beat counter (beat/<rank>, moved by its main loop
    every 50 ms) stood still for `stall_timeout` s (0 = off): died without a word, or hangs."""

    def __init__(self, node: Node, stall_timeout: float):
        self.node, self.stall_timeout, self._looked = node, stall_timeout, 0.0
        self._beats = {r: (-1, time.monotonic()) for r in node.gen_ranks}  # rank -> (count, when it last moved)

    def check(self) -> None:
        now = time.monotonic()
        if now - self._looked < _LOOK_S:
            return
        self._looked = now
        failed = self.node.failure()
        if failed is not None:
            raise failed
        for r, (n, since) in self._beats.items():
            got = self.node.store.add(f"beat/{r}", 0)  # add 0: read a counter that may not exist yet
            if got != n:
                self._beats[r] = (got, now)
            elif self.stall_timeout > 0 and now - since > self.stall_timeout:
                raise NodeFailed(f"{self.node.name(r)} has been silent for {now - since:.0f} s "
                                 "(train.stall_timeout): dead or hung", self.node.name(r), r)


class TrainerLink:
    """Module docstring. `setup`: what a generator node cannot work out itself (picklable)."""

    def __init__(self, node: Node | None, store: WeightStore, setup: dict, stall_timeout: float = 0.0):
        self.node, self.store, self.ingest, self._stopped = node, store, None, False
        self.stall_timeout = stall_timeout  # a generator node silent this long fails the run (0 = off)
        if node is not None:
            node.put("setup", {**setup, "shapes": store.shapes()})
            self.watch = NodeWatch(node, stall_timeout)

    def local_generators(self, n: int) -> int:
        """Generators this node runs: all of them on one node, none on a trainer node."""
        return n if self.node is None else 0

    def publish(self, version: int) -> None:
        if self.node is not None:
            send_weights(self.node, self.store, version, self.check)

    def control(self, ctx, buffer, prompts_per_version: int, max_staleness, n_generators: int) -> Control:
        """`n_generators`: per node (train.n_generators)."""
        if self.node is None:
            return Control(ctx, prompts_per_version, max_staleness, n_generators)
        c = StoreControl(self.node, ctx, prompts_per_version, max_staleness, n_generators * len(self.node.gen_ranks))
        self.ingest = Ingest(self.node, buffer, c, n_generators, self.stall_timeout)
        self.ingest.start()
        return c

    def check(self) -> None:
        if self.node is None:
            return
        if self.ingest is not None:
            if isinstance(self.ingest.error, NodeFailed):  # a broken receive, blamed on its node: as it is
                raise self.ingest.error
            self.ingest.check()
        self.watch.check()

    def stop(self, timeout: float | None = None, failed: int | None = None) -> list[str]:
        """Stop every generator node (module docstring); returns the nodes that did not say done.
        `failed`: a node known dead or hung, not waited for."""
        if self.node is None or self._stopped:
            return []
        self._stopped, node = True, self.node
        node.store.set("stop", "1")
        deadline = time.monotonic() + (node.timeout.total_seconds() if timeout is None else timeout)
        left = [r for r in node.gen_ranks if r != failed]
        while left and time.monotonic() < deadline and (self.ingest is None or self.ingest.error is None):
            left = [r for r in left if not node.store.check([f"done/{r}"])]
            time.sleep(0.05)
        if self.ingest is not None:
            self.ingest.stop()
        return [node.name(r) for r in left]

    def __enter__(self) -> "TrainerLink":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.node is not None:
            try:
                late = self.stop(_STOP_ON_ERROR_S if exc_type is not None else None,
                                 exc.rank if isinstance(exc, NodeFailed) else None)
                if late:
                    print(f"[asyncrl] no word from {', '.join(late)} after the stop", flush=True)
            finally:
                self.node.close()
        return False
