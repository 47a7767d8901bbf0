"""Weights to generator nodes: the trainer sends its published slot, each generator node's
receiver writes it into that node's own `WeightStore` through the seqlock.

Processes: `send_weights` runs in the trainer's main thread (rank 0), right after the local
`WeightStore` publish; `WeightReceiver` is a thread in each generator node's main process. Its
generators (spawned processes) read the node's store exactly as they read the trainer's on one
node: they see no difference.

Protocol for version v (gloo point-to-point on CPU, the `weights` group of common/runtime/nodes/world.py):
  trainer   store key weights/version = v  ->  send the active slot's bytes to every receiver
            ->  wait for every receiver's key weights/ack/<rank>/<v>  ->  raise the quota
  receiver  polls weights/version (never waits inside a transfer it was not told of)
            ->  begin_write(v) (slot odd)  ->  receive straight into the writing slot
            ->  end_write(slot, v)  ->  set its ack key
Waiting for the acks before the quota moves keeps the single-node rule: a generator that
claims a prompt admitted under version v already finds v (or newer) in its store, so the
version it samples with is the one the trainer published. Both stores have one layout (the
receiver's is built from the trainer's `shapes()`), so a slot is one flat byte tensor and
the transfer is one send per node, no packing.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch.distributed as dist

from common.runtime.nodes.world import Node, NodeThread
from common.runtime.nodes.keys import NodeFailed
from common.runtime.shared.weights import WeightStore

_POLL_S = 0.005  # how often a receiver reads the published version (a store round trip)
_SEND_POLL_S = 0.001  # how often the trainer looks at its sends and the acknowledgements while it publishes
_TAG = 1  # the weights group carries nothing else; a fixed tag


def send_weights(node: Node, store: WeightStore, version: int, check: Callable[[], None] = lambda: None) -> None:
    """Trainer: send `store`'s active slot (just published as `version`) to every generator node
    and wait until each has it in its own store (see the module docstring). The sends are waited
    for in a helper thread (a gloo send completes only inside `wait`) while this thread polls the
    acknowledgements and calls `check` (the trainer's view of the other nodes: a node silent for
    train.stall_timeout raises there), so a hung node stops the run within the stall timeout,
    not dist.timeout."""
    node.put_text("weights/version", str(version))
    buf = store.slot_bytes()
    sends = []
    for r in node.gen_ranks:
        try:
            sends.append((r, dist.isend(buf, dst=r, group=node.weights, tag=_TAG)))
        except Exception as e:  # a connection already closed fails here, not in wait
            raise node.blame(r, f"weights v{version} to", e) from e
    broke: list = []  # (rank, exception) of the first send that failed

    def wait_sends():
        for r, w in sends:
            try:
                w.wait()  # a dead node breaks its connection at once
            except Exception as e:  # noqa: BLE001 - raised below, in the trainer's thread
                broke.append((r, e))
                return
    waiter = threading.Thread(target=wait_sends, name="weights-send", daemon=True)
    waiter.start()
    keys = {r: f"weights/ack/{r}/{version}" for r in node.gen_ranks}
    deadline = time.monotonic() + node.timeout.total_seconds()
    while True:
        if broke:
            r, e = broke[0]
            raise node.blame(r, f"weights v{version} to", e) from e
        for r, k in list(keys.items()):
            if node.has(k):
                node.store.delete_key(k)
                del keys[r]
        if not keys and not waiter.is_alive():
            return
        check()
        if time.monotonic() > deadline:
            late = sorted(keys) or [r for r, _ in sends]
            raise NodeFailed(f"weights v{version}: not acknowledged by {', '.join(node.name(r) for r in late)} "
                             f"within {node.timeout.total_seconds():.0f} s (dist.timeout)", node.name(late[0]), late[0])
        time.sleep(_SEND_POLL_S)


class WeightReceiver(NodeThread):
    """A generator node's receiver (module docstring). `error`: what stopped it, if anything."""

    def __init__(self, node: Node, store: WeightStore):
        super().__init__(node, "weight-receiver", "weight receiver")
        self.store = store
        self.received = 0  # versions received (for the tests and the log)

    def run(self) -> None:
        node, store = self.node, self.store
        try:
            while not self.halt.is_set():
                if not node.store.check(["weights/version"]):
                    time.sleep(_POLL_S)
                    continue
                v = int(node.get_text("weights/version"))
                if v <= store.version:
                    time.sleep(_POLL_S)
                    continue
                slot = store.begin_write(v)  # odd: this node's generators keep reading the other slot
                dist.irecv(store.slot_bytes(slot), src=0, group=node.weights, tag=_TAG).wait()
                store.end_write(slot, v)
                node.put_text(f"weights/ack/{node.rank}/{v}", "1")
                self.received += 1
        except BaseException as e:  # noqa: BLE001 - reported by the node's main loop (check)
            self.error = e
