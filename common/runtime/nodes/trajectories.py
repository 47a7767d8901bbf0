"""Trajectories across nodes: generators on other nodes claim prompts from the trainer's
staleness quota, their finished groups travel in batches to the trainer's replay buffer.

Who runs what:
* `StoreControl`: the trainer's `Control` when its generators are on other nodes: each
  `set_version` also writes the quota (and, on start or resume, the started counter) to the
  run's store, in that order, so a claim never sees a quota without its counter.
* `RemoteControl`: what a generator process on a generator node (or beside the trainer, on the
  trainer node: `dist.trainer_node_generators`) holds as its `Control`.
  `claim` is AReaL's admission rule, started < quota, made atomic on the store with
  compare-and-set (the value carries the claimer's own token, so a claimer knows the swap was
  its own, and is sealed with the count as its sequence, so a count written back lower than one a
  claimer has read is refused: common/runtime/wire.py); `stats` is the node's local shared table,
  as on one node.
* `TrajSender`: a thread in each generator node's main process. The node's generators add
  groups to a local `ReplayBuffer` (the outbox, exactly as they add to the trainer's on one
  node); every `dist.ship_every` s the sender takes the rows added since the last batch (whole
  groups, in order), writes a header (rows, width, the node's generator stats) under the key
  traj/<rank>/<seq>, then sends the columns packed into one byte tensor (gloo, `traj` group).
* `Ingest`: a thread in the trainer node's node-link process (world rank 0): polls each generator node's next header key,
  only then receives the batch it announces (never waits in a transfer blindly), appends the
  rows to the trainer's buffer (`ReplayBuffer.add_rows`: new insertion counters, nothing else
  changes, so staleness filters and AReaL's eta see the versions the generators recorded),
  copies the node's stats into the trainer's `Control` table and the store's started counter
  into `Control.t` (shared memory: the metrics read both as on one node). Watching the nodes (a
  failure one reported, a beat that stood still) is the trainer's main thread's job (`NodeWatch`,
  common/runtime/nodes/link.py), so a receive this thread is stuck in cannot hide a dead node.
Every value on the store is sealed with the run's secret (common/runtime/wire.py), the claim
counter too (a claimer checks the seal of what it read before it swaps in its own, sealed); a
header is JSON, checked before anything of its batch is received.
Concurrency: the ring buffer's lock serialises the ingest thread with the trainer's reads (two
processes, one shared-memory buffer, as with local generators);
each thread owns its process group (weights and trajectories never share sockets).
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.generator import Control
from common.runtime.nodes.world import Node, NodeThread
from common.runtime.nodes.keys import RunKeys
from common.runtime.wire import ForgedValue, Seals

_POLL_S = 0.005  # the ingest thread's idle poll of the header keys


class StoreControl(Control):
    """The trainer's Control, mirrored to the run's store (module docstring)."""

    def __init__(self, node: RunKeys, ctx, prompts_per_version: int, max_staleness, n_generators: int):
        self.node, self._mirror = node, False  # the constructor's set_version(0) stays local
        super().__init__(ctx, prompts_per_version, max_staleness, n_generators)
        self._mirror = True

    def set_version(self, v: int, started: int | None = None, dropped: int | None = None) -> None:
        super().set_version(v, started, dropped)
        if self._mirror:
            if started is not None:  # the count is the counter's sequence (RemoteControl.claim)
                self.node.put_text("started", f"{started} trainer", seq=started)
            self.node.put_text("quota", str(int(self.t[self.QUOTA])))  # last: it admits claims


class RemoteControl:
    """A generator node's `Control` for its generator processes (module docstring); picklable,
    each process opens its own connection to the store. `stats`: the table its generators write
    their rows of (a new shared one by default; the trainer's own for generators on the trainer node).
    `seals`: the run's secret and id, which seal the counter (they reach the generators through the
    spawn, a local pipe; each process checks what it reads against what it has read)."""

    def __init__(self, host: str, port: int, n_generators: int, timeout, seals: Seals, stats: torch.Tensor | None = None):
        self.addr, self.timeout, self.seals = (host, port), timeout, seals
        self.stats = stats if stats is not None else \
            torch.zeros(n_generators, len(Control.STAT_FIELDS), dtype=torch.float64).share_memory_()
        self._store, self._n = None, 0

    def __getstate__(self):
        return {"addr": self.addr, "timeout": self.timeout, "seals": self.seals, "stats": self.stats}

    def __setstate__(self, state):
        self.__dict__.update(state, _store=None, _n=0)

    def claim(self) -> int | None:
        """The global index of the next prompt to start, or None if over the trainer's quota."""
        if self._store is None:
            self._store = dist.TCPStore(*self.addr, is_master=False, timeout=self.timeout)
            self._me = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"  # this claimer's own, whoever copies it
        st = self._store
        if not st.check(["quota"]):  # the trainer has not opened the first version yet
            return None
        for _ in range(100):  # contention only: another claimer moved the counter meanwhile
            raw, quota = st.multi_get(["started", "quota"])
            s = counter(self.seals.unseal("started", raw), "started")
            if s >= counter(self.seals.unseal("quota", quota), "quota"):
                return None
            self._n += 1
            want = self.seals.seal("started", f"{s + 1} {self._me}:{self._n}".encode(), seq=s + 1)
            if st.compare_set("started", raw, want) == want:
                return s
        return None


def counter(value: bytes, key: str) -> int:
    """The count at the head of a (sealed, checked) counter value: "<count>[ <claimer>]"."""
    head = value.split(b" ", 1)[0]
    if not head.isdigit():
        raise ForgedValue(f"the store's {key!r} holds {value[:40]!r}, not a count")
    return int(head)


def pack(cols: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Columns of `ReplayBuffer.take_rows` -> one byte tensor and the header that unpacks it."""
    parts = [cols[k].contiguous().reshape(-1).view(torch.uint8) for k in cols]
    header = {"names": list(cols), "n": len(cols["reward"]), "T": cols["tokens"].shape[1],
              "nbytes": sum(p.numel() for p in parts)}
    return torch.cat(parts), header


def check_header(h, like: ReplayBuffer, n_stats: int) -> dict:
    """A trajectory header as `pack` and `TrajSender` write it, against the trainer's buffer layout;
    anything else is refused before a byte of its batch is received."""
    try:
        ok = (set(h) == {"names", "n", "T", "nbytes", "stats"} and set(h["names"]) <= set(like.cols)
              and all(type(h[k]) is int and h[k] > 0 for k in ("n", "T", "nbytes")) and h["T"] <= like.cols["tokens"].shape[1]
              and h["nbytes"] == sum(h["n"] * (h["T"] if like.cols[k].dim() == 2 else 1) * like.cols[k].dtype.itemsize
                                     for k in h["names"])
              and all(isinstance(row, list) and len(row) == n_stats for row in h["stats"]))
    except (TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise ForgedValue(f"a trajectory header that does not fit this run's buffer: {str(h)[:200]}")
    return h


def unpack(buf: torch.Tensor, header: dict, like: ReplayBuffer) -> dict[str, torch.Tensor]:
    """The inverse of `pack`, with the dtypes of `like`'s columns (both ends hold one layout)."""
    out, off, n, T = {}, 0, header["n"], header["T"]
    for k in header["names"]:
        col = like.cols[k]
        shape = (n, T) if col.dim() == 2 else (n,)
        nb = n * (T if col.dim() == 2 else 1) * col.dtype.itemsize
        out[k] = buf[off:off + nb].clone().view(col.dtype).reshape(shape)  # clone: aligned for the dtype
        off += nb
    return out


class TrajSender(NodeThread):
    """A generator node's sender (module docstring). `error`: what stopped it, if anything."""

    def __init__(self, node: Node, outbox: ReplayBuffer, stats: torch.Tensor, every: float):
        super().__init__(node, "traj-sender", "trajectory sender")
        self.outbox, self.stats, self.every = outbox, stats, every
        self.rows = 0

    def run(self) -> None:
        node, shipped, seq = self.node, 0, 0
        try:
            while True:
                last = self.halt.is_set()  # set after the generators stopped: one more batch flushes
                cols, end = self.outbox.take_rows(shipped)
                if end > shipped:
                    seq += 1
                    buf, header = pack(cols)
                    header["stats"] = self.stats.tolist()
                    node.put_json(f"traj/{node.rank}/{seq}", header)  # first the header (JSON) ...
                    dist.isend(buf, dst=0, group=node.traj, tag=seq).wait()  # ... then the rows
                    self.rows += end - shipped
                    shipped = end
                elif last:
                    return
                else:
                    time.sleep(self.every)
        except BaseException as e:  # noqa: BLE001 - reported by the node's main loop (check)
            self.error = e


class Ingest(NodeThread):
    """The trainer's ingest thread (module docstring). `error`: a failure it met. `recv_timeout`:
    the longest wait for a batch whose header arrived (a node stopped between the two is caught by
    the trainer's `NodeWatch` meanwhile; this only bounds how long the thread stays stuck)."""

    def __init__(self, node: Node, buffer: ReplayBuffer, t: torch.Tensor, stats: torch.Tensor, gens_per_node: int,
                 recv_timeout: float = 0.0):
        super().__init__(node, "traj-ingest", "trajectory ingest")
        self.buffer, self.t, self.stats, self.G = buffer, t, stats, gens_per_node  # the trainer's Control's shared tables
        self.recv_timeout = timedelta(seconds=recv_timeout) if recv_timeout > 0 else node.timeout
        self.rows = 0

    def run(self) -> None:
        node, seq = self.node, {r: 1 for r in self.node.gen_ranks}
        try:
            while not self.halt.is_set():
                got = False
                for r in node.gen_ranks:
                    key = f"traj/{r}/{seq[r]}"
                    if not node.store.check([key]):
                        continue
                    header = check_header(node.get_json(key), self.buffer, self.stats.shape[1])  # sealed, then checked
                    buf = torch.empty(header["nbytes"], dtype=torch.uint8)
                    try:
                        dist.irecv(buf, src=r, group=node.traj, tag=seq[r]).wait(self.recv_timeout)
                    except Exception as e:
                        raise node.blame(r, "trajectories from", e) from e
                    self.buffer.add_rows(unpack(buf, header, self.buffer))
                    node.store.delete_key(key)
                    i = (r - node.gen_ranks[0]) * self.G
                    self.stats[i:i + self.G] = torch.tensor(header["stats"], dtype=self.stats.dtype)[i:i + self.G]
                    seq[r] += 1
                    self.rows += header["n"]
                    got = True
                if node.store.check(["started"]):
                    self.t[Control.STARTED] = counter(node.get_bytes("started"), "started")
                if not got:
                    time.sleep(_POLL_S)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer by the node-link process (link_main)
            self.error = e
