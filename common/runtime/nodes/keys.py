"""The run's key-value store as each node sees it, each node's role, and how a node is named in
errors (common/runtime/nodes/world.py has the world and its groups; the `dist` config section is
common/runtime/train_config.py's).

The store is a `TCPStore` the trainer process hosts (on torchrun's MASTER_ADDR) for the run's
small keys: the run id, the published version and the acknowledgements, the staleness quota,
trajectory headers, the commands for trainer ranks on other nodes, beats, failures, "stop" and
"done". Every thread holds its own connection (a client sends one request at a time). Every value
is sealed with the run's secret, its run id and its write's sequence (common/runtime/wire.py) and
checked before it is parsed; the counters moved with `add` (beats) are the only unsealed keys. The
run id: the hosting trainer draws it when it starts the store and writes it under "run"; every
other process reads it there before its first value (the node-link process gets it from the
trainer, and the world's table checks that every node holds the trainer's). The store listens on the address the user gave
(`dist.bind`, else MASTER_ADDR's), nowhere else. Runs in every node's main process and in the
threads and processes that talk to other nodes.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from common.runtime.launch import WorkerError
from common.runtime.train_config import DistConfig
from common.runtime.wire import RUN_KEY, ForgedValue, Seals, bound_store, run_secret, seal, unseal

_BLAME_WAIT_S = 3.0  # after a broken transfer, how long to wait for the peer's own failure report


class NodeFailed(WorkerError):
    """Another node failed or stopped answering; the message names it (rank, host, role). A
    `WorkerError`: the trainer's own state is whole, so it checkpoints before it stops. `rank`:
    the node's world rank when known (the trainer does not wait for its goodbye)."""

    def __init__(self, message: str, worker: str = "", rank: int | None = None):
        super().__init__(message, worker)
        self.rank = rank


def role_of(rank: int, dc: DistConfig) -> str:
    """The role of world rank `rank`: the first `trainer_nodes` ranks train, the others generate."""
    return "trainer" if rank < dc.trainer_nodes else "generator"


class RunKeys:
    """The run's key-value store as one node sees it: a connection per thread, the small messages,
    the failure reports and how errors name a node. The trainer process holds one (`host_keys`)
    without being in the world; `Node` adds the world's groups."""

    def __init__(self, dc: DistConfig, rank: int, world: int, host: str, port: int | None, run: str | None = None):
        self.cfg, self.timeout = dc, timedelta(seconds=dc.timeout)
        self.secret = run_secret(dc.secret_file)  # refused here, before any connection, when there is none
        self.seals = Seals(self.secret, run)  # run: the run id where the caller knows it (else read from the store)
        self.rank, self.world, self.role = rank, world, role_of(rank, dc)
        self.gen_ranks = list(range(dc.trainer_nodes, world))
        self.index = rank - dc.trainer_nodes  # this generator node's index (generators: 0, 1, ...)
        self.host, self.port, self.table = dc.bind or host, port, None  # where the store listens and is reached
        self.source = f"--dist.bind={dc.bind}" if dc.bind else f"MASTER_ADDR={host} (torchrun's --master-addr)"
        self._server, self._local = None, threading.local()

    @property
    def store(self) -> dist.TCPStore:
        """This thread's connection to the run's store. One per thread: a client sends one request at a
        time, so a thread blocked in `wait` would hold up every other thread's requests on a shared one."""
        s = getattr(self._local, "store", None)
        if s is None:
            s = self._local.store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
        return s

    def serve(self, port: int) -> None:
        """Host the run's store here (the trainer's process: it outlives every transfer), listening on
        `host` only (`dist.bind`, else MASTER_ADDR); `port` 0 = a free one."""
        self._server, _ = bound_store(self.host, port, timeout=self.timeout, source=self.source)
        self._local.store, self.port = self._server, self._server.port
        self.seals.run = os.urandom(16).hex()  # this run's id: fresh, so no earlier run's value passes
        self._server.set(RUN_KEY, seal(self.secret, RUN_KEY, self.seals.run.encode()))

    @property
    def run_id(self) -> str:
        """The run id (wire.py): the trainer's, read once from the store (sealed) where not given."""
        if self.seals.run is None:
            self.store.wait([RUN_KEY], self.timeout)
            self.seals.run = unseal(self.secret, RUN_KEY, self.store.get(RUN_KEY)).decode()
        return self.seals.run

    def name(self, rank: int) -> str:
        """'generator node 0 (rank 1, host h, pid p)': how errors name a node."""
        t = self.table[rank] if self.table else {"host": "?", "pid": "?"}
        role = "trainer node" if rank < self.cfg.trainer_nodes else f"generator node {rank - self.cfg.trainer_nodes}"
        return f"{role} (rank {rank}, host {t['host']}, pid {t['pid']})"

    # ---- small messages through the store, each sealed with the run's secret ---------------
    def put_bytes(self, key: str, value: bytes, seq: int | None = None) -> None:
        """`value` under `key`, sealed (`seq`: the write's sequence; None: this process's next for the key)."""
        self.run_id  # noqa: B018 - known before the first seal
        self.store.set(key, self.seals.seal(key, value, seq))

    def get_bytes(self, key: str) -> bytes:
        """The value under `key` (present), its seal checked: ForgedValue if it was not this run's,
        ReplayedValue if older than one read before."""
        self.run_id  # noqa: B018
        return self.seals.unseal(key, self.store.get(key))

    def put(self, key: str, obj) -> None:
        """`obj` by value (a pickle: the algorithm, a step's batch), sealed; loaded only once its seal checked."""
        self.put_bytes(key, pickle.dumps(obj))

    def get(self, key: str):
        """The object under `key`, waiting for it at most `dist.timeout`."""
        self.store.wait([key], self.timeout)
        return pickle.loads(self.get_bytes(key))  # after unseal: only what a node holding the secret wrote

    def put_text(self, key: str, text: str, seq: int | None = None) -> None:
        self.put_bytes(key, text.encode(), seq)

    def get_text(self, key: str) -> str:
        return self.get_bytes(key).decode()

    def put_json(self, key: str, obj) -> None:
        self.put_bytes(key, json.dumps(obj).encode())

    def get_json(self, key: str):
        return json.loads(self.get_bytes(key))

    def has(self, key: str) -> bool:
        """Whether `key` holds a value this run wrote (a flag: "stop", done/<rank>, ...); ForgedValue if forged."""
        if not self.store.check([key]):
            return False
        self.get_bytes(key)
        return True

    def fail(self, message: str) -> None:
        """Tell every node this one failed (the trainer raises NodeFailed naming it); best effort."""
        try:
            self.put_text(f"failed/{self.rank}", f"{self.name(self.rank)}: {message}")
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    def blame(self, rank: int, what: str, e: BaseException) -> "NodeFailed":
        """The error for a transfer with `rank` that broke: that node's own report when it sends one
        within a few seconds (a node that fails reports, then leaves, which breaks the transfer),
        else what broke."""
        deadline = time.monotonic() + _BLAME_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self.store.check([f"failed/{rank}"]):
                    return NodeFailed(self.get_text(f"failed/{rank}"), self.name(rank), rank)
            except ForgedValue as forged:
                return forged
            except Exception:  # noqa: BLE001 - the store is the trainer's; from another node it may be gone
                break
            time.sleep(0.1)
        return NodeFailed(f"{what} {self.name(rank)}: {type(e).__name__}: {e}", self.name(rank), rank)

    def beat(self) -> bool:
        """Move this node's beat counter (the trainer names a node that goes quiet) and read the key
        "stop". The store lives in the trainer's process: losing it means the trainer node is gone,
        said as such."""
        try:
            self.store.add(f"beat/{self.rank}", 1)
            return self.has("stop")
        except ForgedValue:
            raise
        except Exception as e:  # noqa: BLE001 - any store error: the trainer's process is what holds it
            raise NodeFailed(f"lost {self.name(0)}: its store does not answer ({type(e).__name__}: {e})",
                             self.name(0), 0) from e

    def wait_for_stop(self) -> None:
        """A failed node stays (its workers already stopped) until the trainer has read its report
        (and checkpointed, where it can), i.e. until "stop" (bounded by dist.timeout): once this process
        exits, torchrun's agents take the whole job down, the trainer with it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        try:
            while time.monotonic() < deadline and not self.has("stop"):
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the trainer (and its store) is gone: nothing to wait for
            pass

    def leave_failed(self, e: BaseException) -> None:
        """This node failed with `e` (inside its `except`): report it to every node, print it with its
        traceback, then wait for the trainer's "stop" before the caller re-raises."""
        self.fail(f"{type(e).__name__}: {e}")
        print(f"[asyncrl] {self.name(self.rank)} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        self.wait_for_stop()

    def failure(self) -> NodeFailed | None:
        """The first failure another node reported, or None."""
        for r in range(self.world):
            if r != self.rank and self.store.check([f"failed/{r}"]):
                return NodeFailed(self.get_text(f"failed/{r}"), self.name(r), r)  # ForgedValue if not ours
        return None

    def close(self) -> None:
        """Drop the connections (and the store, where hosted here); idempotent."""
        self._server, self._local = None, threading.local()
