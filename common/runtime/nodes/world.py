"""Several nodes in one torchrun world: the launch, each node's role, the process groups, the
run's key-value store.

Torchrun starts one process per node (`--nproc-per-node=1`); the entry (common/train.py) reads its
role here before anything else. On a generator node that process joins the world (`join`) and
runs the node's generators (common/runtime/nodes/generator_node.py); on a trainer node after the
first it runs that node's trainer ranks (common/runtime/nodes/trainer_node.py). On the first
trainer node it is the trainer, as on one node, which never joins the world itself: it hosts the
run's store (`host_keys`) and its own ranks keep their private group (`train.trainer_devices`,
common/runtime/ranks/group.py; a process holds one default group), while a node-link process it
spawns stands for it as world rank 0 and moves weights and trajectories
(common/runtime/nodes/link.py). Without torchrun (no `RANK` / `WORLD_SIZE` in the environment, or
a world of one: `under_torchrun`) the entry never comes here.

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        run_gsm8k.py --dist.trainer_nodes=1 ...

Roles come from the config after the rendezvous (c10d numbers nodes by arrival, not by
`--node-rank`): world ranks 0..trainer_nodes-1 stand for the trainer, the others run generators
(`common/runtime/nodes/generator_node.py`). Every node gathers every node's view (host, pid, role,
a hash of its config, a tag of its secret, the run id it read from the store) as JSON
(`all_gather_json`, never a pickle), so all agree on one table and a node started with another
command line or another secret, or handed an earlier run's id (a replayed "run" key), is refused,
naming it.

Groups, created on every rank in this one order (a different order deadlocks), each gloo
with `dist.timeout`: `control` (every node: the start barrier, the table), `weights` (the
trainer + one receiver per generator node: common/runtime/nodes/weights.py), `traj` (the same
ranks: trajectories to the trainer, common/runtime/nodes/trajectories.py). Weights and trajectories
move in different threads, so each has its own group (its own sockets and tags).
`monitored_barrier` on the world, before any group, names a node that never arrived.

The store: a `TCPStore` the trainer process (on torchrun's MASTER_ADDR) hosts for the run's
small keys (common/runtime/nodes/keys.py: the published version, the staleness quota, trajectory
headers, stop, failures). Nobody waits inside a transfer without having learnt from a key that
its peer is in it too. Trainer nodes after the first read the store's port from torchrun's own
store (`member_keys`): their ranks join the trainer's group before the world exists.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from common.contracts.config import to_dict
from common.runtime.nodes.keys import NodeFailed, RunKeys, role_of
from common.runtime.train_config import DistConfig, torchrun_restarts, under_torchrun
from common.runtime.wire import ForgedValue, all_gather_json, check_bind, fingerprint, listen_host, run_secret

_STORE_PORT_KEY = "asyncrl/world{}/run_store_port"  # on torchrun's store: where the trainer hosts the run's store


class NodeThread(threading.Thread):
    """A node's helper thread (weight receiver, trajectory sender, ingest): its loop runs until
    `halt`; what stopped it is kept in `error` and raised by `check` in the thread that watches it,
    as `NodeFailed` named after `what`. A daemon: never holds the process at exit."""

    def __init__(self, node: "Node", name: str, what: str):
        super().__init__(name=name, daemon=True)
        self.node, self.what = node, what
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise NodeFailed(f"{self.what}: {type(self.error).__name__}: {self.error}") from self.error

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=self.node.timeout.total_seconds())


_generation: list[int] = []  # this process's start of the world, once counted


def _agent_store(timeout: timedelta) -> dist.TCPStore:
    """torchrun's own store for this job's workers (MASTER_ADDR/MASTER_PORT)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


def generation() -> int:
    """Which start of this torchrun world this process is part of: 0 the first, one more per restart
    of the job (`--max-restarts`), agreed by every node. Each node's process counts itself in once on
    torchrun's store, one process per node, so the n-th start's processes read n. Not torchrun's
    TORCHELASTIC_RESTART_COUNT: an agent that restarts its worker because another node failed does
    not count that restart, so two nodes' counts differ. 0 off torchrun (a world of one)."""
    if not _generation:
        n = 0
        if under_torchrun():
            n = (_agent_store(timedelta(seconds=60)).add("asyncrl/arrivals", 1) - 1) // int(os.environ["WORLD_SIZE"])
        _generation.append(n)
    return _generation[0]


def restarted() -> int:
    """How many times torchrun restarted this job (`--max-restarts`, on this node or, across nodes,
    on any); 0 outside torchrun. A restarted trainer resumes from its last checkpoint by itself."""
    return max(torchrun_restarts(), generation())


def is_generator_node(cfg) -> bool:
    """Whether this process is a generator node of a torchrun world (it trains nothing, logs nothing)."""
    return under_torchrun() and role_of(int(os.environ["RANK"]), getattr(cfg, "dist", None) or DistConfig()) == "generator"


def is_trainer_member_node(cfg) -> bool:
    """Whether this process is a trainer node after the first (world ranks 1..trainer_nodes-1): it runs
    trainer ranks that the first node's trainer drives; it draws, logs and plots nothing itself."""
    return under_torchrun() and 0 < int(os.environ["RANK"]) and not is_generator_node(cfg)


def check(dc: DistConfig, tc, world: int) -> None:
    """Configs several nodes refuse (clear errors before any group exists)."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise ValueError("several nodes: one process per node (torchrun --nproc-per-node=1); a node's "
                         "generators and trainer ranks are its own processes")
    if dc.trainer_nodes < 1 or dc.trainer_nodes >= world:
        raise ValueError(f"dist.trainer_nodes={dc.trainer_nodes} with {world} nodes: need 1 <= trainer_nodes < "
                         f"nodes (at least one generator node)")
    if dc.trainer_nodes > 1 and tc.compile_blocks:
        raise ValueError("train.compile_blocks with dist.trainer_nodes > 1 is not supported (the trainer's ranks are "
                         "FSDP2-sharded; as with train.trainer_devices > 1)")
    if tc.device != "cpu":
        raise ValueError(f"train.device={tc.device!r} with several nodes: only the CPU (gloo) path is built yet")
    if dc.trainer_node_generators < 0:
        raise ValueError(f"dist.trainer_node_generators must be >= 0, got {dc.trainer_node_generators}")
    if dc.timeout <= 0 or dc.ship_every <= 0:
        raise ValueError(f"dist.timeout and dist.ship_every must be > 0, got {dc}")
    check_bind(*listen_host(dc.bind))  # --dist.bind, else MASTER_ADDR: a wildcard from either is refused
    run_secret(dc.secret_file)  # several nodes: refused here, before any connection, without a secret


def config_hash(cfg) -> str:
    """What every node must agree on: the whole run config."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


class Node(RunKeys):
    """This process's place in the world: rank, role, the agreed table, the groups and the store.
    `port`: the run's store, hosted by the trainer's process (given to the trainer node's member,
    rank 0); None on rank 0 hosts it here (the transport benchmark, which has no trainer). `run`: the
    run id where the caller knows it (the node-link process, from the trainer); else read from the store."""

    def __init__(self, cfg, dc: DistConfig, port: int | None = None, start: int | None = None, run: str | None = None):
        timeout = timedelta(seconds=dc.timeout)
        start = generation() if start is None else start
        # torchrun's store, under a prefix of this start of the world: keys a dead start left there
        # (rank 0's address) would send a restarted node to a port nobody listens on any more
        store = dist.PrefixStore(f"asyncrl/world{start}", _agent_store(timeout))
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
        super().__init__(dc, dist.get_rank(), dist.get_world_size(), os.environ.get("MASTER_ADDR", "127.0.0.1"), port, run)
        try:
            if self.rank == 0 and port is None:
                self.serve(dc.store_port)
            dist.monitored_barrier(timeout=self.timeout, wait_all_ranks=True)  # names every node that is not there
            # one fixed order on every rank, each group with the timeout
            ranks = [0] + self.gen_ranks
            self.control = dist.new_group(list(range(self.world)), timeout=self.timeout, backend="gloo")
            self.weights = dist.new_group(ranks, timeout=self.timeout, backend="gloo")
            self.traj = dist.new_group(ranks, timeout=self.timeout, backend="gloo")
            me = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "role": self.role,
                  "config": config_hash(cfg), "port": self.port, "secret": fingerprint(self.secret)}
            me["run"] = self.run_id if self.rank == 0 else None  # rank 0's: the trainer's own (or hosted here)
            table = all_gather_json(me, self.control)
            self.table = table
            for t in table:
                if t["config"] != table[0]["config"]:
                    raise ValueError(f"{self.name(t['rank'])} runs another config than {self.name(0)}: start every "
                                     "node with the same command line")
                if t["secret"] != table[0]["secret"]:
                    raise ValueError(f"{self.name(t['rank'])} was started with another run secret than {self.name(0)}: "
                                     "give every node the same ASYNCRL_RUN_SECRET (or --dist.secret_file)")
            self.port = table[0]["port"]
            if self.run_id != table[0]["run"]:  # read sealed from the store, against the trainer's own
                raise ForgedValue(f"{self.name(self.rank)} read another run id from the run's store than {self.name(0)} "
                                  f"holds: the store's key 'run' holds an earlier run's value (written back by a "
                                  f"process reaching the store's port)")
            if self.rank == 0:  # which machine got which role (c10d numbers nodes as they arrive)
                print(f"[asyncrl] {self.world} nodes: " + ", ".join(self.name(r) for r in range(self.world)), flush=True)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Leave the world (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        super().close()


def checked(cfg, tc) -> DistConfig:
    """The run's `dist` section, after the checks every node makes before it touches the network."""
    dc = getattr(cfg, "dist", None) or DistConfig()
    check(dc, tc, int(os.environ["WORLD_SIZE"]))
    return dc


def host_keys(cfg, tc) -> RunKeys:
    """The trainer process under torchrun: the run's store, hosted here, as `RunKeys` (the world
    itself is joined by its node-link process: common/runtime/nodes/link.py)."""
    dc = checked(cfg, tc)
    keys = RunKeys(dc, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   None)
    keys.serve(dc.store_port)
    # for the other trainer nodes, which need the store before the world exists (their ranks join the
    # trainer's group while the trainer loads; the world forms only once its buffer exists)
    _agent_store(keys.timeout).set(_STORE_PORT_KEY.format(generation()), str(keys.port))
    return keys


def member_keys(cfg, tc) -> RunKeys:
    """A trainer node after the first: the run's store as `RunKeys`, its port read from torchrun's store."""
    dc = checked(cfg, tc)
    agent = _agent_store(timedelta(seconds=dc.timeout))
    key = _STORE_PORT_KEY.format(generation())
    agent.wait([key], timedelta(seconds=dc.timeout))
    return RunKeys(dc, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   int(agent.get(key)))


def join(cfg, tc, port: int | None = None, start: int | None = None, run: str | None = None) -> Node | None:
    """This node's `Node` under torchrun, None otherwise (the single-node path). `port`, `start`,
    `run`: the run's store, the world's `generation` and the run id, when this process's trainer
    hosts the one, counted the other and drew the last (the trainer node's node-link process)."""
    if not under_torchrun():
        return None
    return Node(cfg, checked(cfg, tc), port, start, run)
