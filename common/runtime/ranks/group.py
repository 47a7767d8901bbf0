"""The trainer's ranks as one object for rank 0: `TrainerGroup`, the rank layer's `OneRank`
(common/runtime/step.py), which the trainer loop calls the same way (ranks 1..N-1 run
`rank_main`, common/runtime/ranks/rank.py).

Processes: `TrainerGroup` lives in the launching process, which is rank 0 and the coordinator
(it draws batches, runs the algorithm's batch logic, logs, evaluates, checkpoints). With
N = `train.trainer_devices` > 1 (the entry, common/train.py, picks it then) it spawns ranks
1..N-1 (`rank_main`) through a `Workers` of their own, joins them in a process group, shards its
model (common/runtime/ranks/fsdp.py) and drives them with commands, one queue per rank:

    ("step", step, lr, batch)   every rank: step.update on the whole batch, its share of micro-batches
    ("publish", version)        every rank copies its rows into the weight store (publish.py)
    ("gather",)                 every rank helps gather the full model onto rank 0 (evaluation)
    ("save", dir, lrs)          every rank writes its shards of a checkpoint (fsdp.write_shards)
    ("load", dir, stepped)      every rank loads its shards (fsdp.read_shards)
    ("stop",)

Rank 0 sends a command, then does its own part of the same collective work; the batch travels
as shared-memory tensors.

Several trainer nodes (`dist.trainer_nodes` = T > 1 under torchrun): N = T x trainer_devices
ranks, node j running ranks j D .. (j + 1) D - 1 (D = trainer_devices). Node j > 0's ranks are
spawned by that node's process (common/runtime/nodes/trainer_node.py) from the setup rank 0 puts on
the run's store (the peers' `keys`), join the same group through rank 0's TCPStore (on torchrun's
MASTER_ADDR), and read the same commands from the run's store (common/runtime/ranks/commands.py).
At a publish they send their rows to rank 0, which writes them into its store (publish.py).

Faults: a waiting rank polls its queue and beats its heartbeat, and beats while it trains,
so the watchdog (`common/runtime/watchdog.py`) can tell a hung rank from an idle one; the
process group times out after `train.stall_timeout`, so rank 0 never waits on a hung rank
forever; a rank that raises or dies breaks the collective at once. Either way rank 0 raises
`RankFailed` naming the rank. A Ctrl-C on rank 0 lands when the running command is done (a
collective left halfway would hold the other ranks in it), so the interrupt checkpoint works.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import torch.distributed as dist

from common.contracts.algorithm import Algorithm
from common.contracts.batch import Batch
from common.engine.machine.precision import Precision
from common.contracts.micro import set_ranks
from common.runtime.files.checkpoint import ResumeState, load_checkpoint, save_checkpoint
from common.runtime.launch import WorkerError, Workers
from common.runtime.peers import Peers
from common.runtime.pickling import check_sendable, dumps
from common.runtime.ranks.commands import CommandSender
from common.runtime.ranks.fsdp import full_model, init_group, rank_device, read_shards, resolve_reshard, shard, write_shards
from common.runtime.ranks.publish import publish_shards
from common.runtime.ranks.rank import RankSetup, rank_main
from common.runtime.ranks.share import Share
from common.runtime.step import OneRank, RankFailed, update
from common.runtime.watchdog import Heartbeats, WorkerStalled
from common.runtime.shared.weights import WeightStore
from common.runtime.wire import bound_store

_BLAME_WAIT_S = 5.0  # after a failed collective, how long rank 0 looks for the rank that caused it
_REMOTE_STOP_S = 30.0  # at the end, how long rank 0 waits for the other trainer nodes to see "stop"


class TrainerGroup(OneRank):
    """Rank 0's handle (module docstring). Use as a context manager; `model` is sharded in place."""

    @staticmethod
    def model_device(tc) -> str:
        """Rank 0's device: cuda:0 on GPUs."""
        return rank_device(tc.device, 0)

    def __init__(self, model, tc, prec: Precision, model_path: str, algo: Algorithm, store: WeightStore, run_dir,
                 peers: Peers | None = None):
        # peers.keys: the run's store (RunKeys) under torchrun, None on one node; peers.check raises
        # for a failed trainer node (TrainerLink.check)
        self.model, self.algo, self.store = model, algo, store
        self.keys = peers.keys if peers is not None else None
        self.check_nodes = peers.check if peers is not None else (lambda: None)
        self.local = tc.trainer_devices
        self.world = self.local * (self.keys.cfg.trainer_nodes if self.keys is not None else 1)
        self.device = model.device
        # a whole trainer node lost (its process and ranks) says nothing: its silence is named
        # after the stall timeout (common/runtime/nodes/link.py: NodeWatch), so wait that long for it
        stall = tc.stall_timeout if tc.stall_action == "stop" else 0.0
        self._blame_s = max(_BLAME_WAIT_S, stall + 1.0) if self.world > self.local else _BLAME_WAIT_S
        self.workers, self.share, self.queues, self._remote = None, None, [], None
        if self.world == 1:
            raise ValueError("TrainerGroup is N > 1 ranks: one rank is OneRank (common/runtime/step.py; "
                             "common/train.py: trainer_ranks picks)")
        try:
            self._start(tc, prec, model_path, Path(run_dir))
        except BaseException:  # no `with` block yet to clean up: stop what did start
            self.close()
            raise
        super().__init__(model, tc, prec, model_path, algo, store, run_dir, peers)  # the optimizer, over the shards

    def _start(self, tc, prec, model_path, run_dir):
        # by value (cloudpickle: a loss or an Algorithm subclass defined in a notebook is fine), and
        # not as shared memory: each rank gets its own copy of any tensor inside
        check_sendable(algorithm=self.algo)
        algo_bytes = dumps(self.algo)
        # the ranks' rendezvous store listens on loopback, or with other trainer nodes on the address
        # the run's store has (dist.bind / MASTER_ADDR): never on every interface
        host = self.keys.host if self.world > self.local else "127.0.0.1"
        self._tcp, _ = bound_store(host, 0, self.world)
        timeout = tc.stall_timeout if tc.stall_action == "stop" else 0.0
        reshard = resolve_reshard(tc.reshard, tc.device)
        setup = RankSetup(self.world, self._tcp.port, host, self.local, tc.device, timeout, model_path, prec,
                          tc.activation_checkpointing, tc.share_prompts, tc.pack_rows, reshard, tc.lr, tc.weight_decay,
                          tc.grad_clip, tc.adam_beta2, tc.adam_eps)
        if self.world > self.local:  # the other trainer nodes build their ranks from this
            self.keys.put("trainer/setup", (setup, algo_bytes))
            self._remote = CommandSender(self.keys)
        self.workers = Workers()
        names = [f"trainer{r}" for r in range(1, self.local)]
        hb = Heartbeats(names, run_dir / "stacks")
        self.workers.watch(hb, tc.stall_timeout, tc.stall_action)
        try:  # a rank that fails while starting or loading is reported here, not after a rendezvous timeout
            for r, name in enumerate(names, 1):
                self.queues.append(self.workers.queue())
                dev = rank_device(tc.device, r)
                self.workers.start(name, rank_main, r, setup, algo_bytes, self.store, self.queues[-1],
                                   hb.beat_for(name), cuda_device=dev if dev.startswith("cuda") else None)
            self.workers.wait_event(lambda: self.check_nodes() or self._tcp.check([f"ready{r}" for r in range(1, self.world)]),
                                    float("inf"))
        except (WorkerError, WorkerStalled) as e:
            raise _rank_failed(e) from e
        shard(self.model, init_group(0, self.world, self._tcp, str(self.device), timeout, loopback=self.world == self.local),
              reshard)
        self.share = Share(self.model, 0, self.world, reshard=reshard)  # installed in common.contracts.micro during each command

    # ---- commands (each: tell ranks 1..N-1, then do rank 0's part) -------------------------
    def update(self, batch: Batch, step: int, lr: float, grad_clip: float) -> tuple[dict, float]:
        """One trainer step on `batch` (CPU) by every rank; returns rank 0's (global) stats."""
        with self._collective():
            self._send("step", step, lr, batch)
            return update(self.algo, self.model, self.opt, batch.to(self.device), step, grad_clip, self.share)

    def publish(self, version: int) -> None:
        with self._collective():
            self._send("publish", version)
            publish_shards(self.model, self.store, version, 0, self.world, self.local)

    def full_model(self):
        """The whole model on rank 0's device: gathered, a copy."""
        with self._collective():
            self._send("gather")
            return full_model(self.model).to(self.device)

    def save(self, run_dir, step: int, sched, **kw) -> Path:
        """`save_checkpoint` with every rank writing its shards."""
        with self._collective():
            # with rank 0's learning rates: DCP saves one rank's param_groups, and ranks 1..N-1 hold
            # the rate of their last step while rank 0's scheduler has already moved on
            lrs = [g["lr"] for g in self.opt.param_groups]

            def write(d):
                self._send("save", d, lrs)  # the other ranks write their shards now, beside ours
                return write_shards(d, self.model, self.opt)
            return save_checkpoint(run_dir, step, self.model, self.opt, sched, write=write, **kw)

    def load(self, path, sched, buffer_size: tuple[int, int] | None = None) -> ResumeState:
        """`load_checkpoint` with every rank loading its shards (after rank 0 checked them)."""
        with self._collective():
            def read(d, stepped):
                self._send("load", d, stepped)
                read_shards(d, self.model, self.opt, stepped)
            return load_checkpoint(path, self.model, self.opt, sched, read=read, buffer_size=buffer_size)

    def _send(self, *cmd) -> None:
        for q in self.queues:
            q.put(cmd)
        if self._remote is not None:
            self._remote.put(cmd)

    # ---- faults ---------------------------------------------------------------------------
    def check(self) -> None:
        """Raise RankFailed if a rank died, raised or hung (call wherever rank 0 waits)."""
        if self.workers is not None:
            try:
                self.workers.check()
            except (WorkerError, WorkerStalled) as e:
                raise _rank_failed(e) from e
            self.check_nodes()

    def pids(self) -> dict[str, int]:
        return self.workers.pids() if self.workers is not None else {}

    @contextlib.contextmanager
    def _collective(self):
        """Rank 0's part of a command: an error another rank caused is reported as that rank's
        (RankFailed); a Ctrl-C waits for the end of the command (module docstring)."""
        prev = set_ranks(self.share)  # only while the command runs: another group may share this process
        try:
            with _deferred_interrupt():
                try:
                    yield
                except Exception as e:
                    failed = self._blame()
                    if failed is None:
                        raise  # rank 0's own error (the others are stopped by close())
                    raise failed from e
        finally:
            set_ranks(prev)

    def _blame(self) -> RankFailed | None:
        """The rank behind a failed collective: dead or raised (exit code, traceback) or hung
        (heartbeat older than the stall timeout, which is also the collective timeout)."""
        deadline = time.monotonic() + self._blame_s
        while True:
            try:
                self.check()
            except RankFailed as e:
                return e
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def close(self, failed: bool = False) -> None:
        """Stop ranks 1..N-1 and leave the process group (every exit path; idempotent). `failed`:
        the run stops on an error, which other trainer nodes pass on (their exit code: torchrun
        restarts a job only when a node failed)."""
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        with contextlib.suppress(Exception):
            if self._remote is not None:
                self.keys.put_text("trainer/end", "failed" if failed else "ok")
            self._send("stop")
        if dist.is_initialized():  # first: a rank still inside a collective gets an error, not a hang
            dist.destroy_process_group()
        workers.shutdown()
        if self._remote is not None:  # the run's store closes after this: let the other nodes read "stop"
            nodes = range(1, self.keys.cfg.trainer_nodes)
            # after a failure a trainer node may be gone for good: do not wait the whole bound for it
            deadline = time.monotonic() + (_BLAME_WAIT_S if failed else _REMOTE_STOP_S)
            with contextlib.suppress(Exception):  # a node that failed said so instead: it waits for the run's "stop"
                while time.monotonic() < deadline and not all(
                        self.keys.has(f"done/{j}") or self.keys.store.check([f"failed/{j}"]) for j in nodes):
                    time.sleep(0.05)
        self._tcp = None  # rank 0's rendezvous server goes with it


def _rank_failed(e: Exception) -> RankFailed:
    """A worker's failure as a rank's (same message, worker name and traceback)."""
    return RankFailed(str(e), getattr(e, "worker", ""), getattr(e, "traceback", ""))


@contextlib.contextmanager
def _deferred_interrupt():
    """Hold a Ctrl-C (SIGINT) until the block is done, then raise it (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list = []
    prev = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev if prev is not None else signal.SIG_DFL)
    if got:  # reached only when the block itself did not raise
        raise KeyboardInterrupt
