"""What crosses the network between nodes and trainer ranks, made safe to read.

Three rules (docs/nodes.md has the threat model):
* **Store values are sealed to the run and to their write.** The run's key-value store (a
  `TCPStore`) has no authentication: a process that reaches its port reads and writes any key. So
  every value the project reads back from it is sealed with an HMAC-SHA256 under the run's secret
  of (run id, key, sequence, value) (`seal`), and refused (`ForgedValue`) before anything parses it
  when its tag does not match: a pickle (the algorithm by value, a step's batch) is only ever loaded
  after its tag checked. The key is inside the tag, so a value sealed for one key is refused under
  another; the run id (fresh per run, drawn by the trainer when it starts the store and published
  under the key "run") is inside it, so a value recorded from an earlier run is refused even where
  the secret was reused; the sequence (a count per key: the writer's own, or the counter's value
  for the claim counter) is inside it, so a value of this run written back later is refused by a
  reader that has already read a newer one (`ReplayedValue`). `Seals` is one process's view: the
  secret, the run id, what it wrote and the newest it read per key.
* **The secret reaches the nodes out of band** (`run_secret`): `ASYNCRL_RUN_SECRET` in the
  environment, or a file (`--dist.secret_file`) only its owner can read, the same on every node;
  a run of several nodes refuses to start without one, and refuses one too short or too regular
  to be a random token. It is never written to the store, the run directory or a log.
* **Listeners bind the address the user gave** (`listen`): a store's server socket is bound to
  that address only (torchrun's `MASTER_ADDR`, `--dist.bind`, or loopback on one machine), never
  to every interface as `TCPStore`'s own listener does; an address that resolves to a wildcard is
  refused, wherever it came from.
Gathers between ranks or nodes carry JSON (`all_gather_json`), never `all_gather_object`'s pickles.

Runs in every process that talks to another node or rank: the trainer, its node-link process,
generator nodes and their generators, trainer ranks on other nodes.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import os
import socket
import stat
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.contracts.errors import UserError
from common.runtime.launch import WorkerError

SECRET_ENV = "ASYNCRL_RUN_SECRET"
_MIN_SECRET = 16  # bytes: a secret shorter than this is refused (a 32-hex-digit token is 16 bytes of entropy)
_MIN_SECRET_BITS = 64  # a secret whose characters' empirical entropy (length x bits per character) is below this is refused
_MIN_DISTINCT = 8  # ... and one with fewer distinct characters (a 32-hex-digit token has about 14)
_MAGIC = b"asyncrl2"  # a sealed value starts with this, then the 32-byte tag, the 8-byte sequence, the value
_HOW = (f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') and give every node "
        "the same value, a new one for each run (or --dist.secret_file=PATH: a file only you can read, the same on "
        "every node)")
RUN_KEY = "run"  # the store's key for the run id, sealed under the empty run id (readers do not know it yet)


class ForgedValue(WorkerError):
    """A value read from the run's store (or a peer) that was not sealed with the run's secret: written
    by a process outside the run, or by a node started with another secret. A `WorkerError`: the
    trainer's own state is whole, so it checkpoints before it stops."""


class ReplayedValue(ForgedValue):
    """A value sealed by this run, but older than one the reader already read under the same key:
    written back by a process that recorded it (a replay)."""


class SecretError(UserError):
    """No usable per-run secret where the run needs one (several nodes)."""


def _weak(raw: str) -> str:
    """Why `raw` is too regular to be a random token ("" when it is not): a repetition of a shorter
    unit, too few distinct characters, or too little entropy per its own character counts."""
    if len(raw) > 1 and raw in (raw + raw)[1:-1]:
        return "it repeats a shorter string"
    counts = [raw.count(c) for c in set(raw)]
    if len(counts) < _MIN_DISTINCT:
        return f"it has {len(counts)} distinct characters"
    bits = -sum(n * math.log2(n / len(raw)) for n in counts)
    if bits < _MIN_SECRET_BITS:
        return f"its characters carry about {bits:.0f} bits"
    return ""


def run_secret(secret_file: str = "") -> bytes:
    """The run's secret: `ASYNCRL_RUN_SECRET`, else the contents of `secret_file`; refused (SecretError)
    when neither is there, when it is shorter than 16 bytes or too regular to be a random token
    (`_weak`), or when the file is readable by others."""
    raw = os.environ.get(SECRET_ENV, "")
    if not raw and secret_file:
        p = Path(secret_file).expanduser()
        try:
            mode = p.stat().st_mode
            raw = p.read_text().strip()
        except OSError as e:
            raise SecretError(f"--dist.secret_file={secret_file}: cannot read it ({e.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"--dist.secret_file={secret_file} is readable by others (mode {stat.S_IMODE(mode):o}): "
                              f"chmod 600 {secret_file}")
    if not raw:
        raise SecretError(f"several nodes need a per-run secret (the run's store authenticates every value with it): "
                          f"{_HOW}")
    if len(raw.encode()) < _MIN_SECRET:
        raise SecretError(f"the run's secret ({SECRET_ENV} or --dist.secret_file) is {len(raw.encode())} bytes: use "
                          f"at least {_MIN_SECRET}, e.g. secrets.token_hex(32)")
    why = _weak(raw)
    if why:
        raise SecretError(f"the run's secret ({SECRET_ENV} or --dist.secret_file) is not a random token ({why}): "
                          f"anyone could guess it; {_HOW}")
    return raw.encode()


def _tag(secret: bytes, run: str, key: str, seq: bytes, value: bytes) -> bytes:
    return hmac.new(secret, run.encode() + b"\0" + key.encode() + b"\0" + seq + value, hashlib.sha256).digest()


def seal(secret: bytes, key: str, value: bytes, run: str = "", seq: int = 0) -> bytes:
    """`value` with its sequence `seq` and its tag under `secret` for store key `key` of run `run`."""
    s = seq.to_bytes(8, "big")
    return _MAGIC + _tag(secret, run, key, s, value) + s + value


def unseal_seq(secret: bytes, key: str, blob: bytes, run: str = "") -> tuple[int, bytes]:
    """(sequence, value) of what `seal` sealed under `key` for run `run`, or ForgedValue (the tag
    compared in constant time)."""
    n = len(_MAGIC) + 32
    if not (isinstance(blob, bytes) and blob.startswith(_MAGIC) and len(blob) >= n + 8
            and hmac.compare_digest(blob[len(_MAGIC):n], _tag(secret, run, key, blob[n:n + 8], blob[n + 8:]))):
        raise ForgedValue(f"refused the value under key {key!r} of the run's store: it is not sealed with this run's "
                          f"secret and run id (written by a process outside the run, reaching the store's port, by a "
                          f"node started with another {SECRET_ENV}, or recorded from an earlier run); nothing of it "
                          f"was read. Firewall the store's port to the run's nodes (docs/nodes.md)")
    return int.from_bytes(blob[n:n + 8], "big"), blob[n + 8:]


def unseal(secret: bytes, key: str, blob: bytes, run: str = "") -> bytes:
    """The value `seal` sealed under `key` for run `run`, or ForgedValue."""
    return unseal_seq(secret, key, blob, run)[1]


class Seals:
    """One process's seals (module docstring): the run's secret and id, the sequence it last wrote
    per key and the newest it read per key. `seal` numbers a key's writes (or takes the caller's
    `seq`: the claim counter's value); `unseal` refuses a value older than one read before
    (`ReplayedValue`). Picklable as (secret, run): a process it reaches starts with nothing read.
    Thread-safe (a node's threads share one)."""

    def __init__(self, secret: bytes, run: str | None = None):
        self.secret, self.run = secret, run
        self._wrote: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"secret": self.secret, "run": self.run}

    def __setstate__(self, state):
        self.__init__(state["secret"], state["run"])

    def seal(self, key: str, value: bytes, seq: int | None = None) -> bytes:
        with self._lock:
            seq = self._wrote.get(key, 0) + 1 if seq is None else seq
            self._wrote[key] = seq
        return seal(self.secret, key, value, self.run, seq)

    def unseal(self, key: str, blob: bytes) -> bytes:
        seq, value = unseal_seq(self.secret, key, blob, self.run)
        with self._lock:
            last = self._seen.get(key, 0)
            if seq < last:
                raise ReplayedValue(f"refused the value under key {key!r} of the run's store: this run sealed it, but "
                                    f"it is older than one already read (write {seq} after {last}): written back by a "
                                    f"process that recorded it, reaching the store's port; nothing of it was used. "
                                    f"Firewall the store's port to the run's nodes (docs/nodes.md)")
            self._seen[key] = seq
        return value


def fingerprint(secret: bytes) -> str:
    """A short tag of `secret` that tells two secrets apart and reveals nothing of either."""
    return hmac.new(secret, b"asyncrl fingerprint", hashlib.sha256).hexdigest()[:16]


def bind_address(host: str) -> str:
    """The numeric address `host` resolves to (IPv4 first), the one a listener binds."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"cannot resolve {host!r} to bind the run's store ({e}): set MASTER_ADDR or "
                        f"--dist.bind to this machine's address") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return infos[0][4][0]


def listen_host(bind: str) -> tuple[str, str]:
    """(host, where it came from) for the run's store: `--dist.bind`, else torchrun's MASTER_ADDR,
    else loopback."""
    if bind:
        return bind, f"--dist.bind={bind}"
    addr = os.environ.get("MASTER_ADDR", "")
    return (addr, f"MASTER_ADDR={addr} (torchrun's --master-addr / rendezvous host)") if addr else ("127.0.0.1", "loopback")


def check_bind(host: str, source: str = "") -> None:
    """Refuse an address that resolves to a wildcard (every interface) where a listener must bind
    one, wherever it came from (`source`: the setting or variable that gave it)."""
    if host and ipaddress.ip_address(bind_address(host)).is_unspecified:
        raise UserError(f"{source or host} is every interface: the run's store would listen on all of them; name "
                        f"the one address the other nodes reach this machine at (--dist.bind=ADDR; the store has no "
                        f"authentication of its own: docs/nodes.md)")


def listen(host: str, port: int = 0, source: str = "") -> socket.socket:
    """A listening TCP socket bound to `host`'s address only (port 0: a free one); a wildcard is
    refused (`check_bind`), after resolution."""
    check_bind(host, source)
    addr = bind_address(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
    except OSError as e:
        s.close()
        raise UserError(f"cannot listen on {addr}:{port} ({e.strerror}): another process holds the port, or the "
                        f"address is not this machine's (MASTER_ADDR / --dist.bind)") from None
    s.listen(1024)
    return s


def bound_store(host: str, port: int = 0, world_size: int | None = None,
                timeout: timedelta = timedelta(seconds=300), source: str = "") -> tuple[dist.TCPStore, str]:
    """A `TCPStore` server listening only on `host` (`listen`; port 0: a free one, then `.port`), and
    the address it is bound to."""
    sock = listen(host, port, source)
    address, port = sock.getsockname()[:2]
    try:
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now and closes it when it goes
    return store, address


def all_gather_json(obj, group=None, device="cpu") -> list:
    """Every rank's `obj` (JSON-serialisable), in rank order: bytes over the group (on `device`: the
    group's backend's), parsed as JSON, never unpickled (`dist.all_gather_object` would load a pickle a
    peer sent)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    width = max(int(s) for s in sizes)
    bufs = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(n)]
    pad = torch.zeros(width - data.numel(), dtype=torch.uint8, device=device)
    dist.all_gather(bufs, torch.cat([data, pad]), group=group)
    return [json.loads(b[:int(s)].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]
