"""What crosses the network between nodes and trainer ranks, made safe to read.

Three rules (docs/nodes.md has the threat model):
* **Store values are sealed.** The run's key-value store (a `TCPStore`) has no authentication: a
  process that reaches its port reads and writes any key. So every value the project reads back
  from it is sealed with an HMAC-SHA256 of (key, value) under the run's secret (`seal`), and
  `unseal` refuses a value whose tag does not match (`ForgedValue`), before anything parses it:
  a pickle (the algorithm by value, a step's batch) is only ever loaded after its tag checked.
  The key is inside the tag, so a value sealed for one key is refused under another.
* **The secret reaches the nodes out of band** (`run_secret`): `ASYNCRL_RUN_SECRET` in the
  environment, or a file (`--dist.secret_file`) only its owner can read, the same on every node;
  a run of several nodes refuses to start without one. It is never written to the store, the run
  directory or a log.
* **Listeners bind the address the user gave** (`listen`): a store's server socket is bound to
  that address only (torchrun's `MASTER_ADDR`, `--dist.bind`, or loopback on one machine), never
  to every interface as `TCPStore`'s own listener does.
Gathers between ranks or nodes carry JSON (`all_gather_json`), never `all_gather_object`'s pickles.

Runs in every process that talks to another node or rank: the trainer, its node-link process,
generator nodes and their generators, trainer ranks on other nodes.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import socket
import stat
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import UserError
from common.runtime.launch import WorkerError

SECRET_ENV = "ASYNCRL_RUN_SECRET"
_MIN_SECRET = 16  # bytes: a secret shorter than this is refused (a 32-hex-digit token is 16 bytes of entropy)
_MAGIC = b"asyncrl1"  # a sealed value starts with this, then the 32-byte tag, then the value
_HOW = (f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') and give every node "
        "the same value (or --dist.secret_file=PATH: a file only you can read, the same on every node)")


class ForgedValue(WorkerError):
    """A value read from the run's store (or a peer) that was not sealed with the run's secret: written
    by a process outside the run, or by a node started with another secret. A `WorkerError`: the
    trainer's own state is whole, so it checkpoints before it stops."""


class SecretError(UserError):
    """No usable per-run secret where the run needs one (several nodes)."""


def run_secret(secret_file: str = "") -> bytes:
    """The run's secret: `ASYNCRL_RUN_SECRET`, else the contents of `secret_file`; refused (SecretError)
    when neither is there, when it is shorter than 16 bytes, or when the file is readable by others."""
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
    return raw.encode()


def _tag(secret: bytes, key: str, value: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\0" + value, hashlib.sha256).digest()


def seal(secret: bytes, key: str, value: bytes) -> bytes:
    """`value` with its tag under `secret` for store key `key`."""
    return _MAGIC + _tag(secret, key, value) + value


def unseal(secret: bytes, key: str, blob: bytes) -> bytes:
    """The value `seal` sealed under `key`, or ForgedValue (compared in constant time)."""
    n = len(_MAGIC) + 32
    if not (isinstance(blob, bytes) and blob.startswith(_MAGIC) and len(blob) >= n
            and hmac.compare_digest(blob[len(_MAGIC):n], _tag(secret, key, blob[n:]))):
        raise ForgedValue(f"refused the value under key {key!r} of the run's store: it is not sealed with this run's "
                          f"secret (written by a process outside the run, reaching the store's port, or by a node "
                          f"started with another {SECRET_ENV}); nothing of it was read. Firewall the store's port "
                          f"to the run's nodes (docs/nodes.md)")
    return blob[n:]


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


def check_bind(host: str) -> None:
    """Refuse a wildcard address (every interface) where a listener must bind one."""
    if host and ipaddress.ip_address(bind_address(host)).is_unspecified:
        raise UserError(f"--dist.bind={host} is every interface: name the one address the other nodes reach this "
                        f"machine at (the run's store has no authentication of its own: docs/nodes.md)")


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to `host`'s address only (port 0: a free one)."""
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
                timeout: timedelta = timedelta(seconds=300)) -> tuple[dist.TCPStore, str]:
    """A `TCPStore` server listening only on `host` (`listen`; port 0: a free one, then `.port`), and
    the address it is bound to."""
    sock = listen(host, port)
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
