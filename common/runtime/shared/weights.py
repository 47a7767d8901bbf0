"""Versioned weight store: the trainer publishes its parameters, generators copy them in place.

No tensor is pickled per update and nothing touches a file. All buffers are allocated once:

* CPU: one flat shared-memory byte buffer (`share_memory_()`), two slots (a double buffer);
  every parameter is a typed view into each slot.
* CUDA: the same layout as a plain CUDA tensor; torch.multiprocessing hands it to spawn
  children as a CUDA IPC handle. The trainer must outlive the children that use it.

Processes: the trainer (main process, the ONLY writer; with N trainer ranks each writes its
own rows, rank 0 the counters) calls `publish`; generator processes
(spawned with torch.multiprocessing, spawn context, the store passed as a spawn argument or
through a torch.multiprocessing Queue) call `version` every decode step and `apply_to` between
steps. Plain `pickle`/`copy.deepcopy` would copy the tensors instead of sharing them, so
unpickling a non-shared CPU store raises.

Concurrency protocol (counters live in a small shared CPU int64 tensor, also on CUDA):
  version   latest published version (-1: nothing yet). Published versions strictly increase.
  active    slot (0/1) that holds `version`; readers copy only from this slot.
  seq[i]    seqlock sequence of slot i: odd while the writer is writing slot i, even otherwise;
            it changes on every write, so equal even values before and after a read prove the
            read was not torn.
  bver[i]   version stored in slot i (read under the seqlock, so a reader knows exactly what
            it applied).
Writer (publish): i = 1 - active; seq[i] += 1 (odd); copy every tensor into slot i;
bver[i] = v; seq[i] += 1 (even); active = i; version = v. The writer never writes the slot
readers are pointed at, so a reader retries only when two publishes land during one copy.
A writer that dies mid-write leaves its slot odd but `active` still points at the good one.
Sharded trainer (N ranks, `common/runtime/ranks/publish.py`): the same protocol split in three, so
that every rank copies only its own rows and the version moves once: rank 0 `begin_write`
(seq odd), a barrier, every rank `write_rows` of its shards into slot i, device sync and a
barrier, rank 0 `end_write` (bver, seq even, active, version). Counters stay single-writer.
Reader (apply_to): a = active; s0 = seq[a] (odd -> retry); v = bver[a]; copy slot a into the
module; s1 = seq[a]; s0 != s1 -> retry (bounded, then RuntimeError). On CUDA both sides
synchronize before reading/writing the closing sequence number, because copies are async.
Ordering of plain stores to shared memory relies on x86-64's total store order.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

VERSION, ACTIVE, SEQ, BVER = 0, 1, 2, 4  # counter layout: [version, active, seq0, seq1, bver0, bver1]
_ALIGN = 64  # byte alignment of every view: typed views need aligned offsets, 64 = cache line


def adjacent_order(names: list[str]) -> list[str]:
    """Parameter names with, inside each module's children, the weights first and then the biases:
    a layer's q/k/v projection weights (and its gate/up ones, and their biases) then lie back to
    back in a slot, so a generator bound to the store (`bind`) decodes from views of them, merged
    without a copy (`common/engine/sampler/decode_model.py`)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.rsplit(".", 2)[0] if n.count(".") >= 2 else "", []).append(n)
    return [n for g in groups.values() for bias in (False, True) for n in g if n.endswith(".bias") == bias]


class WeightStore:
    """Double-buffered shared copy of a module's parameters, tagged with a version number."""

    def __init__(self, named_shapes: dict[str, tuple[torch.Size, torch.dtype]], device="cpu"):
        self.device = torch.device(device)
        self._specs = []  # (name, shape, dtype, byte offset inside a slot)
        off = 0
        for name, (shape, dtype) in named_shapes.items():
            shape = torch.Size(shape)
            self._specs.append((name, shape, dtype, off))
            nb = shape.numel() * dtype.itemsize
            off += -(-nb // _ALIGN) * _ALIGN
        self._slot_bytes = max(off, _ALIGN)
        # One allocation for both slots: one shm segment / one CUDA IPC handle to hand over.
        self._buf = torch.zeros(2, self._slot_bytes, dtype=torch.uint8, device=self.device)
        self._ctr = torch.tensor([-1, 0, 0, 0, -1, -1], dtype=torch.int64)
        if self.device.type == "cpu":
            self._buf.share_memory_()
        self._ctr.share_memory_()
        self._attach()

    @classmethod
    def from_module(cls, module: nn.Module, device="cpu", dtype: torch.dtype | None = None):
        """Store shaped like `module.named_parameters()` (tied weights once); `dtype` overrides.
        Laid out in `adjacent_order`."""
        params = dict(module.named_parameters())
        return cls({n: (params[n].shape, dtype or params[n].dtype) for n in adjacent_order(list(params))}, device)

    def _attach(self):
        """(Re)build process-local state: typed views, numpy counter view, last applied version."""
        self._views = [{n: self._buf[s, off:off + shape.numel() * dt.itemsize].view(dt).view(shape)
                        for n, shape, dt, off in self._specs} for s in (0, 1)]
        self._c = self._ctr.numpy()  # numpy indexing is ~20x cheaper than tensor.item()
        self._applied = -1  # per process: a fresh generator has applied nothing yet
        self._bound = None  # per process: (module, flat buffer, [(param, data_ptr)]) after `bind`
        self._into = None  # per process: (module, its parameters in the store's order), checked once

    def __getstate__(self):
        # Only the shared tensors travel (torch's multiprocessing reductions share them).
        return {"device": self.device, "_specs": self._specs, "_slot_bytes": self._slot_bytes,
                "_buf": self._buf, "_ctr": self._ctr}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if not self._ctr.is_shared() or (self.device.type == "cpu" and not self._buf.is_shared()):
            raise RuntimeError("WeightStore was unpickled as a private copy; pass it to processes "
                               "through torch.multiprocessing (spawn args or its Queue)")
        self._attach()

    @property
    def version(self) -> int:
        """Latest published version, -1 before the first publish. Cheap: call every step."""
        return int(self._c[VERSION])

    @property
    def nbytes(self) -> int:
        """Bytes of one published copy of the parameters (shared memory holds two)."""
        return sum(shape.numel() * dt.itemsize for _, shape, dt, _ in self._specs)

    @property
    def names(self) -> list[str]:
        return [s[0] for s in self._specs]

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """What the constructor took: another node builds a store of the same layout from it."""
        return {n: (shape, dt) for n, shape, dt, _ in self._specs}

    def slot_bytes(self, slot: int | None = None) -> torch.Tensor:
        """The flat bytes of `slot` (None: the active one, what readers copy). A node's weight
        receiver fills its writing slot with one receive (common/runtime/nodes/weights.py)."""
        return self._buf[int(self._c[ACTIVE]) if slot is None else slot]

    def check(self, tensors: dict[str, torch.Tensor], where: str, exact: bool):
        """Raise naming the first missing/unexpected/misshaped parameter."""
        names = self.names
        known = set(names)
        missing = [n for n in names if n not in tensors]
        extra = [n for n in tensors if n not in known] if exact else []
        if missing or extra:
            raise ValueError(f"WeightStore.{where}: parameter names differ from the store: "
                             f"missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape, _, _ in self._specs:
            if tensors[name].shape != shape:
                raise ValueError(f"WeightStore.{where}: parameter {name!r} has shape "
                                 f"{tuple(tensors[name].shape)}, store has {tuple(shape)}")

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # async copies must land before seq moves

    @torch.no_grad()
    def publish(self, module_or_state: nn.Module | dict[str, torch.Tensor], version: int) -> None:
        """Trainer only (single writer). A state dict may carry extra keys (buffers, tied aliases)."""
        if isinstance(module_or_state, nn.Module):
            src, exact = dict(module_or_state.named_parameters()), True
        else:
            src, exact = module_or_state, False
        self.check(src, "publish", exact)
        i = self.begin_write(version)
        for name in self._views[i]:
            self.write_rows(i, name, 0, src[name].detach())  # copy_ converts dtype and device
        self.end_write(i, version)

    def begin_write(self, version: int) -> int:
        """Counters' writer only: mark the inactive slot as being written (seq odd); returns it."""
        if version <= self.version:
            raise ValueError(f"WeightStore.publish: version {version} <= published {self.version}; "
                             "versions must increase (readers apply only newer ones)")
        i = self.writing_slot()
        self._c[SEQ + i] += 1  # odd: slot i is being written (no reader is pointed at it)
        return i

    def writing_slot(self) -> int:
        """The slot a publish writes: the inactive one (stable until `end_write` flips it)."""
        return 1 - int(self._c[ACTIVE])

    @torch.no_grad()
    def write_rows(self, slot: int, name: str, start: int, src: torch.Tensor) -> None:
        """Copy `src` into rows start.. (dim 0) of parameter `name` in `slot`: a whole tensor
        (start 0) or one rank's shard; casts dtype and moves device as it copies."""
        dst = self._views[slot][name]
        (dst[start:start + src.shape[0]] if src.dim() else dst).copy_(src)

    def rows(self, slot: int, name: str, start: int, n: int) -> torch.Tensor:
        """Rows start..start+n of parameter `name` in `slot`, as a view (contiguous: dim 0 is the
        outermost), for a transfer to land straight in the store (common/runtime/ranks/publish.py)."""
        return self._views[slot][name][start:start + n]

    def end_write(self, slot: int, version: int) -> None:
        """Counters' writer only, after every row of `slot` is in: publish it as `version`."""
        self._sync()
        c = self._c
        c[BVER + slot] = version
        c[SEQ + slot] += 1  # even: slot i is consistent again
        c[ACTIVE] = slot
        c[VERSION] = version

    def apply_to(self, module: nn.Module, min_version: int | None = None,
                 max_retries: int = 100) -> int | None:
        """Generator side. Copy the published weights into `module` in place if they are newer
        than what this process last applied (and >= `min_version` if given). Returns the version
        applied, or None if there was nothing (new enough) to apply."""
        v = self.version
        if v <= self._applied or v < 0 or (min_version is not None and v < min_version):
            return None
        return self.load_into(module, max_retries)

    @torch.no_grad()
    def bind(self, module: nn.Module) -> bool:
        """Reader side, once: make `module`'s parameters views of one flat buffer laid out like a
        slot (on the module's device), so that `load_into` copies a whole slot with one copy
        instead of one per parameter. Only when every parameter has the store's dtype (else
        False, and loads copy per parameter). Call before anything captures the parameters'
        addresses (CUDA graphs): they move here, once, and never again."""
        params = dict(module.named_parameters())
        self.check(params, "bind", exact=True)
        if any(params[n].dtype != dt for n, _, dt, _ in self._specs):
            return False
        flat = torch.zeros(self._slot_bytes, dtype=torch.uint8, device=params[self._specs[0][0]].device)
        for n, shape, dt, off in self._specs:
            view = flat[off:off + shape.numel() * dt.itemsize].view(dt).view(shape)
            view.copy_(params[n].data)
            params[n].data = view  # tied weights are one Parameter: both names see the view
        self._bound = (module, flat, [(p, p.data_ptr()) for p in params.values()])
        return True

    def _flat_of(self, module: nn.Module) -> torch.Tensor | None:
        """The flat buffer `bind` gave `module`, if its parameters still live in it."""
        b = self._bound
        if b is None or b[0] is not module or any(p.data_ptr() != ptr for p, ptr in b[2]):
            return None
        return b[1]

    def _targets(self, module: nn.Module, subset: bool) -> list[nn.Parameter]:
        """`module`'s parameters in the store's order, looked up and checked at its first load only
        (a generator loads into the same model every time; LoRA's adapters are a few hundred small
        tensors, for which a name lookup per load costs as much as the copies)."""
        if self._into is None or self._into[0] is not module:
            params = dict(module.named_parameters())
            self.check(params, "load_into", exact=not subset)
            self._into = (module, [params[n] for n in self._views[0]])
        return self._into[1]

    @torch.no_grad()
    def load_into(self, module: nn.Module, max_retries: int = 100, subset: bool = False) -> int:
        """Always copy the active slot into `module` (one copy if `bind` laid it out, else one per
        parameter); returns the version it held. `subset`: the store holds some of the module's
        parameters (LoRA's adapters), the others stay as they are."""
        targets = self._targets(module, subset)
        flat = self._flat_of(module)
        c = self._c
        if int(c[VERSION]) < 0:
            raise RuntimeError("WeightStore.load_into: nothing has been published yet")
        for attempt in range(max_retries + 1):
            a = int(c[ACTIVE])
            s0 = int(c[SEQ + a])
            if s0 % 2 == 0:
                v = int(c[BVER + a])
                if flat is not None:
                    flat.copy_(self._buf[a])
                else:
                    for p, src in zip(targets, self._views[a].values()):
                        p.data.copy_(src)
                self._sync()
                if int(c[SEQ + a]) == s0:
                    self._applied = v
                    return v
            time.sleep(1e-4 * min(attempt, 10))  # let the writer finish; it flips `active` when done
        raise RuntimeError(f"WeightStore.load_into: every one of {max_retries + 1} reads was torn "
                           "(the trainer publishes faster than this process copies); the module now "
                           "holds a mix of versions")

    def __repr__(self):
        return (f"WeightStore({len(self._specs)} params, {self.nbytes / 2**20:.1f} MiB x2, "
                f"device={self.device}, version={self.version})")
