"""What crosses the network is refused unless the run wrote it (common/runtime/wire.py): every store
key a peer can write, forged over 127.0.0.1, is refused before it is parsed (a planted pickle never
runs); the per-run secret is required on several nodes; listeners bind the address given, read back
from the kernel's socket table, never by connecting from another address."""
from __future__ import annotations

import ast
import os
import pickle
import secrets
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.nodes.keys import RunKeys
from common.runtime.nodes.trajectories import RemoteControl, check_header
from common.runtime.ranks.commands import StoreCommands
from common.runtime.ranks.fsdp import init_group
from common.runtime.train_config import DistConfig
from common.runtime.wire import (ForgedValue, ReplayedValue, SECRET_ENV, SecretError, bound_store, fingerprint, run_secret,
                                 seal, unseal)
from tests.nodes_run import agent, finish, free_port, logs_dir, output, run_pids, start, steps, wait_for
from tests.test_node_faults import _all_gone, _shm
from tests.tiny import save_hf

ROOT = Path(__file__).resolve().parents[1]
SECRET = "wire-test-secret-" + "0f1e2d3c4b5a6978" * 2


class Planted:
    """A pickle that, if ever loaded, leaves a file behind (what an intruder's payload would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    k = RunKeys(DistConfig(timeout=5), 0, 2, "127.0.0.1", None)
    k.serve(0)
    yield k
    k.close()


def peer(keys) -> dist.TCPStore:
    """A process outside the run that reached the store's port (no secret)."""
    return dist.TCPStore("127.0.0.1", keys.port, is_master=False, timeout=timedelta(seconds=5))


def _readers(keys, tmp_path):
    """Each key the run reads back from the store, with the read its reader makes."""
    buf = ReplayBuffer(8, 16, 0)
    return {
        "setup": lambda: keys.get("setup"),                                     # generator nodes
        "trainer/setup": lambda: keys.get("trainer/setup"),                     # other trainer nodes
        "trainer/cmd/0": lambda: StoreCommands("127.0.0.1", keys.port, 5, keys.seals).get(2.0),  # their ranks
        "traj/1/1": lambda: check_header(keys.get_json("traj/1/1"), buf, 7),    # the trainer's ingest
        "failed/1": lambda: keys.failure(),                                     # every node's watch
        "stop": lambda: keys.beat(),                                            # every node's loop
        "done/1": lambda: keys.has("done/1"),                                   # the trainer's stop
        "trainer/end": lambda: keys.get_text("trainer/end"),                    # other trainer nodes
        "weights/version": lambda: keys.get_text("weights/version"),            # generator nodes' receiver
        "weights/ack/1/3": lambda: keys.has("weights/ack/1/3"),                 # the trainer's publish
        "quota": lambda: RemoteControl("127.0.0.1", keys.port, 1, timedelta(seconds=5), keys.seals).claim(),
        "started": lambda: RemoteControl("127.0.0.1", keys.port, 1, timedelta(seconds=5), keys.seals).claim(),
    }


KEYS = ["setup", "trainer/setup", "trainer/cmd/0", "traj/1/1", "failed/1", "stop", "done/1", "trainer/end",
        "weights/version", "weights/ack/1/3", "quota", "started"]


@pytest.mark.parametrize("key", KEYS)
def test_a_forged_value_under_every_key_is_refused_unread(keys, tmp_path, key):
    marker = tmp_path / "payload_ran"
    reads = _readers(keys, tmp_path)
    if key in ("quota", "started"):  # the claim reads both: the other one is the run's own
        keys.put_text("started" if key == "quota" else "quota", "0" if key == "quota" else "5")
    p = peer(keys)
    p.set(key, pickle.dumps(Planted(marker)))  # an unsealed pickle
    with pytest.raises(ForgedValue, match=f"under key '{key}'.*not sealed with this run's secret"):
        reads[key]()
    assert not marker.exists()
    # sealed, but with another secret (a node of another run), or the run's seal of another key
    for forged in (seal(b"another-secret-" + b"x" * 20, key, pickle.dumps(Planted(marker)), keys.run_id),
                   seal(keys.secret, "some/other/key", pickle.dumps(Planted(marker)), keys.run_id),
                   seal(keys.secret, key, pickle.dumps(Planted(marker)), "an-earlier-run", 10**6)):
        p.set(key, forged)
        with pytest.raises(ForgedValue):
            reads[key]()
    assert not marker.exists()


def test_sealed_values_round_trip_and_headers_are_checked(keys):
    keys.put("setup", {"a": 1})
    assert keys.get("setup") == {"a": 1}
    keys.put_text("stop", "1")
    assert keys.beat() and keys.has("stop") and not keys.has("done/1")
    buf = ReplayBuffer(8, 16, 0)
    good = {"names": ["reward"], "n": 2, "T": 16, "nbytes": 2 * buf.cols["reward"].dtype.itemsize, "stats": [[0.0] * 7]}
    keys.put_json("traj/1/1", good)
    assert check_header(keys.get_json("traj/1/1"), buf, 7) == good
    for bad in ({**good, "names": ["__class__"]}, {**good, "nbytes": 10**12}, {**good, "T": 17}, {**good, "n": -1},
                {**good, "stats": "x"}, {**good, "extra": 1}, ["not", "a", "dict"]):
        with pytest.raises(ForgedValue, match="does not fit this run's buffer"):
            check_header(bad, buf, 7)


def test_seal_is_constant_form_and_refuses_truncation():
    s = b"k" * 32
    v = seal(s, "a", b"hello")
    assert unseal(s, "a", v) == b"hello"
    for bad in (v[:-1], v[:10], b"", v + b"!", b"hello"):
        with pytest.raises(ForgedValue):
            unseal(s, "a", bad)
    assert fingerprint(s) == fingerprint(s) != fingerprint(b"j" * 32) and len(fingerprint(s)) == 16


def test_the_secret_comes_out_of_band_and_is_refused_when_weak(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(SecretError, match="several nodes need a per-run secret.*ASYNCRL_RUN_SECRET"):
        run_secret()
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(SecretError, match="at least 16"):
        run_secret()
    for weak, why in (("a" * 16, "it repeats a shorter string"), ("ab" * 20, "it repeats a shorter string"),
                      ("1234123412341234", "it repeats a shorter string"), ("aaaaaaaaaaaaaaab", "it has 2 distinct"),
                      ("password12345678", "its characters carry about 62 bits")):
        monkeypatch.setenv(SECRET_ENV, weak)
        with pytest.raises(SecretError, match=rf"not a random token \({why}.*secrets.token_hex\(32\).*a new one for each"):
            run_secret()
    monkeypatch.setenv(SECRET_ENV, secrets.token_hex(32))
    assert run_secret() == os.environ[SECRET_ENV].encode()
    monkeypatch.delenv(SECRET_ENV)
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o644)
    with pytest.raises(SecretError, match="readable by others.*chmod 600"):
        run_secret(str(f))
    f.chmod(0o600)
    assert run_secret(str(f)) == SECRET.encode()
    with pytest.raises(SecretError, match="cannot read it"):
        run_secret(str(tmp_path / "missing"))


def _listening(port: int) -> set[str]:
    """The addresses the kernel lists a listener on `port` at (/proc/net/tcp*, state 0A = LISTEN)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                raw = bytes.fromhex(addr)
                out.add(".".join(str(b) for b in raw[::-1]) if len(raw) == 4 else raw.hex())
    return out


def test_stores_listen_only_on_the_address_given():
    store, address = bound_store("127.0.0.1")
    assert address == "127.0.0.1" and _listening(store.port) == {"127.0.0.1"}
    del store
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what torch does by itself
    assert _listening(plain.port) != {"127.0.0.1"}  # every interface: why the project never uses it as a server


def _calls(name: str):
    """(file, line, call source) of every call of `name` in common/, tba/, areal/."""
    for path in [p for pkg in ("common", "tba", "areal") for p in (ROOT / pkg).rglob("*.py")]:
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(name):
                yield path.relative_to(ROOT).as_posix(), node.lineno, ast.get_source_segment(src, node)


def test_no_listener_on_every_interface_and_no_pickle_off_the_wire():
    servers = [c for c in _calls("TCPStore") if "is_master=True" in c[2]]
    assert [f for f, _, _ in servers] == ["common/runtime/wire.py"], servers  # bound_store only
    assert not [c for n in ("all_gather_object", "gather_object", "broadcast_object_list", "recv_object_list")
                for c in _calls(n)]
    loads = {(f, c) for f, _, c in _calls("pickle.loads")}
    assert loads == {  # each from a sealed value, or a local spawn's pipe
        ("common/runtime/nodes/keys.py", "pickle.loads(self.get_bytes(key))"),
        ("common/runtime/ranks/commands.py", "pickle.loads(self.seals.unseal(key, self._store.get(key)))"),
        ("common/runtime/ranks/rank.py", "pickle.loads(algo_bytes)"),
        ("common/runtime/pickling.py", "pickle.loads(data)"),
    }, loads


def test_a_value_forged_into_a_live_run_stops_it_saying_so_and_runs_nothing(tmp_path):
    """The attack as it was made: a process on the network reads the run store's port from torchrun's
    store, writes a pickle under a key the trainer reads, and waits. The trainer refuses it within a
    second or so, names it, checkpoints and stops; the pickle never ran; nothing is left running."""
    shm, marker = _shm(), tmp_path / "payload_ran"
    d = tmp_path / "model"
    save_hf("llama_tied", d)
    logs, port = logs_dir(tmp_path), free_port()
    args = [f"--run_root={tmp_path}", f"--model={d}", "--train.steps=30", "--train.stall_timeout=60"]
    procs = start([agent(port, *args, node_rank=k) for k in range(2)], logs, NODES_TOY_STEP_S="0.5")
    try:
        wait_for(lambda: len(steps(tmp_path)) >= 2, 300)
        pids = wait_for(lambda: (p := run_pids(tmp_path / "toy")) and "node1/node" in p and p, 30)
    except BaseException:
        finish(procs, logs, ok=False, bound_s=1)
        raise
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    run_port = int(agent_store.get("asyncrl/world0/run_store_port"))
    intruder = dist.TCPStore("127.0.0.1", run_port, is_master=False, timeout=timedelta(seconds=10))
    intruder.set("failed/1", pickle.dumps(Planted(marker)))
    t = time.monotonic()
    finish(procs, logs, ok=[False, True], bound_s=60)  # the trainer's node fails; the generator node is told to stop
    assert time.monotonic() - t < 60
    out = next(o for o in output(logs) if "[asyncrl] 2 nodes" in o)
    assert "refused the value under key 'failed/1'" in out and "not sealed with this run's secret" in out, out[-3000:]
    assert "a worker failed; checkpoint" in out  # nothing lost: the trainer's state is whole
    assert not marker.exists()
    _all_gone(pids, shm)


def _gloo_rank(rank: int, port: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = q[1]  # what a cluster's environment sets: the interface the nodes share
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    init_group(rank, 2, store, "cpu", 30, loopback=True)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    q[0].put((rank, sorted(a for a, ino in _listeners() if ino in mine), os.environ["GLOO_SOCKET_IFNAME"]))
    dist.barrier()
    dist.destroy_process_group()


def _listeners() -> list[tuple[str, int]]:
    """(address, socket inode) of every listening TCP socket the kernel lists."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:] if os.path.exists(table) else []:
            f = line.split()
            if f[3] == "0A":
                raw = bytes.fromhex(f[1].split(":")[0])
                out.append((".".join(str(b) for b in raw[::-1]) if len(raw) == 4 else raw.hex(), int(f[9])))
    return out


def test_one_node_trainer_ranks_listen_on_loopback_whatever_the_interface_setting():
    """Two trainer ranks on one machine: gloo's listeners are on 127.0.0.1 even with GLOO_SOCKET_IFNAME
    naming a network interface (read back from the kernel's table; nothing connects to that address)."""
    other = next((n for _, n in socket.if_nameindex() if not n.startswith("lo")), None)
    if other is None:
        pytest.skip("this machine has no network interface besides loopback to set GLOO_SOCKET_IFNAME to")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store, _ = bound_store("127.0.0.1", world_size=2)
    procs = [ctx.Process(target=_gloo_rank, args=(r, store.port, (q, other))) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    for rank, addrs, ifname in got:
        assert addrs and set(addrs) == {"127.0.0.1"}, (rank, addrs)
        assert ifname == other  # the user's setting is back once the group exists


def test_a_value_of_this_run_written_back_later_is_refused_naming_its_key(keys):
    """A replay: a process on the network recorded the run's own sealed value and writes it back
    once a newer one was read. Every reader refuses it (ReplayedValue), the claim counter included."""
    p = peer(keys)
    reader = RunKeys(DistConfig(timeout=5), 1, 2, "127.0.0.1", keys.port)  # another node, reading the run id
    keys.put_text("weights/version", "3")
    old = p.get("weights/version")
    keys.put_text("weights/version", "4")
    assert reader.get_text("weights/version") == "4"
    p.set("weights/version", old)
    with pytest.raises(ReplayedValue, match="under key 'weights/version'.*older than one already read"):
        reader.get_text("weights/version")
    # the claim counter: the trainer opens it, a claimer takes two; the count written back lower is refused
    keys.put_text("started", "0 trainer", seq=0)
    keys.put_text("quota", "5")
    rc = RemoteControl("127.0.0.1", keys.port, 1, timedelta(seconds=5), pickle.loads(pickle.dumps(keys.seals)))
    first = p.get("started")
    assert [rc.claim(), rc.claim()] == [0, 1]
    p.set("started", first)
    with pytest.raises(ReplayedValue, match="under key 'started'"):
        rc.claim()
    reader.close()


def test_a_value_of_an_earlier_run_is_refused_even_with_the_secret_reused(keys):
    """Run B, an earlier run under the same secret, sealed values that a recorder kept; written into
    this run's store, each is refused (the run id is inside the tag), and a "run" key written back
    with B's id makes a node refuse every value of this run rather than take B's."""
    earlier = RunKeys(DistConfig(timeout=5), 0, 2, "127.0.0.1", None)
    earlier.serve(0)
    assert earlier.run_id != keys.run_id and len(keys.run_id) == 32
    earlier.put_text("quota", "99")
    earlier.put("setup", {"recorded": True})
    p, old = peer(keys), peer(earlier)
    for key in ("quota", "setup"):
        p.set(key, old.get(key))
    with pytest.raises(ForgedValue, match="under key 'quota'.*recorded from an earlier run"):
        keys.get_text("quota")
    with pytest.raises(ForgedValue, match="under key 'setup'"):
        keys.get("setup")
    p.set("run", old.get("run"))  # a node that has not read the run id yet is handed B's
    keys.put_text("stop", "1")
    late = RunKeys(DistConfig(timeout=5), 1, 2, "127.0.0.1", keys.port)
    assert late.run_id == earlier.run_id  # taken, but ...
    with pytest.raises(ForgedValue, match="under key 'stop'"):  # ... nothing of this run passes with it
        late.has("stop")
    late.close()
    earlier.close()
