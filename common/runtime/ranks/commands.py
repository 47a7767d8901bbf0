"""The trainer's commands to its ranks on other trainer nodes, through the run's key-value store.

Ranks on the trainer's own node read rank 0's commands from a queue each
(common/runtime/ranks/group.py); a rank on another trainer node (common/runtime/nodes/trainer_node.py)
reads the same commands, in the same order, from the run's store (common/runtime/nodes/keys.py): the
n-th one under `trainer/cmd/<n>`, pickled (a step's batch by value) and sealed with the run's secret
and the run id (common/runtime/wire.py): a remote rank loads a command only once its seal checked, so
a value a process outside the run (or an earlier run) wrote is refused (`ForgedValue`), never
unpickled. `StoreCommands` looks like
a queue to `rank_main`, so a remote rank runs exactly the loop a local one does.

Rank 0 deletes command n - 2 when it puts command n: every command before "stop" is a collective
every rank takes part in, so once rank 0 is done with command n - 1 every rank has read it, and
none needs n - 2 any more. The store keeps at most two commands.
"""
from __future__ import annotations

import pickle
import queue
import time
from datetime import timedelta

import torch.distributed as dist

from common.runtime.wire import Seals

_KEY = "trainer/cmd/{}"
_POLL_S = 0.002  # how often a waiting remote rank looks for its next command (a store round trip)


class CommandSender:
    """Rank 0's side: `put` the next command for every remote rank (`keys`: the run's `RunKeys`)."""

    def __init__(self, keys):
        self.keys, self.n = keys, 0

    def put(self, cmd: tuple) -> None:
        self.keys.put(_KEY.format(self.n), cmd)
        if self.n >= 2:
            self.keys.store.delete_key(_KEY.format(self.n - 2))
        self.n += 1


class StoreCommands:
    """A remote rank's command queue: `get(timeout)` returns the next command or raises queue.Empty,
    as `multiprocessing.Queue.get` does. Picklable (it connects in the rank's own process; it goes
    there through the spawn, a local pipe, with the run's `seals`: its secret and id)."""

    def __init__(self, host: str, port: int, timeout_s: float, seals: Seals):
        self.host, self.port, self.timeout_s, self.seals = host, port, timeout_s, seals
        self.n, self._store = 0, None

    def __getstate__(self):
        return {**self.__dict__, "_store": None}

    def get(self, timeout: float):
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        key, deadline = _KEY.format(self.n), time.monotonic() + timeout
        while not self._store.check([key]):
            if time.monotonic() > deadline:
                raise queue.Empty
            time.sleep(_POLL_S)
        cmd = pickle.loads(self.seals.unseal(key, self._store.get(key)))  # the seal first: ForgedValue if not ours
        self.n += 1
        return cmd
