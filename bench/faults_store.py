"""The faults table's attacks on the run's store across nodes (bench/faults.py runs them after its
faults; the shared parts: bench/_faults_util.py): a value forged into a live two-node run's store, a
value of the run written back later (a replay), a value recorded from an earlier run under the same
secret, the store's address a wildcard through torchrun's MASTER_ADDR, a weak secret. Each runs
two torchrun agents on 127.0.0.1 as child processes in sessions of their own, and reports what the
user sees (matched against the message the project promises), how long it took, what is left, and
what the attack must not achieve (a payload that ran).

    python bench/faults.py --only forged_store_value replayed_store_value earlier_run_value \\
        wildcard_master_addr weak_secret
"""
from __future__ import annotations

import pickle
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from bench._faults_util import SECRET, Payload, agent, finish, spawn, steps
from bench.leaks import shm_entries, wait_until

# name -> (the attack, regex the user's output must hold)
ATTACKS = {
    "forged_store_value": ("a pickle written under failed/1 of a live two-node run's store (its port read from "
                           "torchrun's store), over 127.0.0.1", r"refused the value under key 'failed/1'"),
    "replayed_store_value": ("the claim counter 'started' of a live two-node AReaL run, recorded early and written "
                             "back steps later (a replay of the run's own sealed value)",
                             r"refused the value under key 'started'.*older than one already read"),
    "earlier_run_value": ("a value sealed by an earlier run under the same secret ('quota' of a finished run), "
                          "written into a live run's store", r"refused the value under key 'quota'.*earlier run"),
    "wildcard_master_addr": ("torchrun --master-addr=0.0.0.0 and no --dist.bind (the store would listen on every "
                             "interface)", r"MASTER_ADDR=0\.0\.0\.0 .*is every interface"),
    "weak_secret": ("ASYNCRL_RUN_SECRET set to 32 times 'a'", r"not a random token \(it repeats a shorter string\)"),
}
_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "ASYNCRL_RUN_SECRET": SECRET, "NODES_TOY_STEP_S": "0.5"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(d: Path, model: str, *extra, steps_before: int = 2, master: str = "127.0.0.1", **env):
    """A live two-node toy run in `d` (its logs in d/node<k>.log) once it has trained `steps_before`
    steps: (processes, logs, the run store's port), or (processes, logs, an error)."""
    port = _port()
    args = [f"--run_root={d}", f"--model={model}", "--train.steps=40", "--train.checkpoint_every=2", *extra]
    logs = [d / "node0.log", d / "node1.log"]
    procs = [spawn(agent(port, k, *args, master=master), logs[k], **{**_ENV, **env}) for k in range(2)]
    if steps_before == 0:
        return procs, logs, None
    if not wait_until(lambda: steps(d / "toy") >= steps_before or any(p.poll() is not None for p in procs), 300) \
            or any(p.poll() is not None for p in procs):
        return procs, logs, f"the two-node run ended or stalled before the attack (see {logs})"
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return procs, logs, int(agent_store.get("asyncrl/world0/run_store_port"))  # what any peer on the network reads


def _peer(port: int) -> dist.TCPStore:
    """A process outside the run that reached the store's port (it holds no secret)."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _stopped(procs) -> None:
    for p in procs:
        p.kill()
        p.wait()


def forged_store_value(d: Path, model: str) -> dict:
    marker, shm = d / "payload_ran", shm_entries()
    procs, logs, port = _two_nodes(d, model)
    if isinstance(port, str):
        _stopped(procs)
        return {"error": port}
    t0 = time.monotonic()
    _peer(port).set("failed/1", pickle.dumps(Payload(marker)))
    res = finish({}, procs, logs, ATTACKS["forged_store_value"][1], t0, shm)
    return {**res, "payload_ran": marker.exists(), "checkpoint_after": "a worker failed; checkpoint" in logs[0].read_text()}


def replayed_store_value(d: Path, model: str) -> dict:
    shm = shm_entries()
    procs, logs, port = _two_nodes(d, model, "--algo=areal", steps_before=1)
    if isinstance(port, str):
        _stopped(procs)
        return {"error": port}
    peer = _peer(port)
    early = peer.get("started")  # the run's own sealed value, recorded ...
    if not wait_until(lambda: steps(d / "toy") >= 3 or any(p.poll() is not None for p in procs), 300):
        _stopped(procs)
        return {"error": "the run did not go on after the recording"}
    t0 = time.monotonic()
    peer.set("started", early)  # ... and written back, steps later
    res = finish({}, procs, logs, ATTACKS["replayed_store_value"][1], t0, shm)
    out = "\n".join(lg.read_text() for lg in logs)
    return {**res, "keyerror": "KeyError" in out, "checkpoint_after": "checkpoint" in logs[0].read_text()}


def earlier_run_value(d: Path, model: str) -> dict:
    shm = shm_entries()
    (d / "earlier").mkdir()
    procs, logs, port = _two_nodes(d / "earlier", model, steps_before=1)
    if isinstance(port, str):
        _stopped(procs)
        return {"error": port}
    recorded = _peer(port).get("quota")  # sealed with the same secret, by a run that then ends
    _stopped(procs)
    wait_until(lambda: all(p.poll() is not None for p in procs), 60)
    procs, logs, port = _two_nodes(d, model)
    if isinstance(port, str):
        _stopped(procs)
        return {"error": port}
    t0 = time.monotonic()
    _peer(port).set("quota", recorded)
    return finish({}, procs, logs, ATTACKS["earlier_run_value"][1], t0, shm)


def wildcard_master_addr(d: Path, model: str) -> dict:
    shm, t0 = shm_entries(), time.monotonic()
    procs, logs, _ = _two_nodes(d, model, steps_before=0, master="0.0.0.0")
    res = finish({}, procs, logs, ATTACKS["wildcard_master_addr"][1], t0, shm)
    return {**res, "run_dir_made": (d / "toy").exists()}


def weak_secret(d: Path, model: str) -> dict:
    shm, t0 = shm_entries(), time.monotonic()
    procs, logs, _ = _two_nodes(d, model, steps_before=0, ASYNCRL_RUN_SECRET="a" * 32)
    res = finish({}, procs, logs, ATTACKS["weak_secret"][1], t0, shm)
    return {**res, "run_dir_made": (d / "toy").exists()}
