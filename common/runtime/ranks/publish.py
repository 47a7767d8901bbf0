"""Publishing a sharded model into the weight store: every rank copies its own rows of every
parameter into the store's writing slot, so no rank ever holds a full copy; ranks on other
trainer nodes send theirs to rank 0, which receives them straight into the slot.

Runs in every trainer rank at a publish (rank 0 from common/runtime/ranks/group.py, ranks
1..N-1 on its command, common/runtime/ranks/rank.py). The store's seqlock is the core's
(common/runtime/shared/weights.py); one rank publishes with `WeightStore.publish` instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from common.runtime.ranks.fsdp import group_of
from common.runtime.shared.weights import WeightStore


def shard_rows(full_rows: int, rank: int, world: int) -> int:
    """First row of rank's dim-0 shard (FSDP2 splits like torch.chunk: ceil(rows / N) each)."""
    return min(full_rows, rank * -(-full_rows // world))


@torch.no_grad()
def publish_shards(model, store: WeightStore | None, version: int, rank: int, world: int, local: int | None = None,
                   dtype: torch.dtype | None = None) -> None:
    """Every rank copies its own rows into the store's writing slot; rank 0 moves the seqlock
    (odd before any rank writes, version after every rank is done). No rank holds a full copy.
    Ranks `local`.. (default: none) run on other trainer nodes, without the store: each sends its
    rows, cast to the store's `dtype`, to rank 0, which receives them straight into the slot."""
    params, group = dict(model.named_parameters()), group_of(model)
    local = world if local is None else local
    if rank == 0:
        store.check(params, "publish", exact=True)  # global shapes: a DTensor reports the full one
        store.begin_write(version)
    dist.barrier(group)  # nobody writes before the slot is marked odd
    rows = {name: _own_rows(name, p, rank, world) for name, p in params.items()}
    if rank < local:
        slot = store.writing_slot()
        for name, (start, t) in rows.items():
            store.write_rows(slot, name, start, t)
    else:
        send_rows([t for _, t in rows.values()], dtype, group)
    if rank == 0:
        shapes = {name: p.shape for name, p in params.items()}
        for r in range(local, world):
            receive_rows(store, slot, shapes, r, world, group)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)  # this rank's copies landed before rank 0 flips
    dist.barrier(group)
    if rank == 0:
        store.end_write(slot, version)


def _own_rows(name: str, p, rank: int, world: int) -> tuple[int, torch.Tensor]:
    """(first row, this rank's rows) of a sharded parameter, checked against FSDP's layout."""
    local, start = p.to_local(), shard_rows(p.shape[0], rank, world)
    if local.shape[0] != min(p.shape[0], start + -(-p.shape[0] // world)) - start:
        raise RuntimeError(f"publish: {name}'s shard on rank {rank} has {local.shape[0]} rows, expected "
                           f"FSDP's torch.chunk layout (rows {start}.. of {p.shape[0]})")
    return start, local


def send_rows(rows: list[torch.Tensor], dtype: torch.dtype, group) -> None:
    """A rank on another trainer node: its rows of every parameter (in the model's order), cast to
    the store's dtype here (bf16 halves the bytes), to rank 0: one message per parameter, all in
    flight at once, no packing copy."""
    sends = [dist.P2POp(dist.isend, t.to(dtype).contiguous(), 0, group) for t in rows if t.numel()]
    for w in dist.batch_isend_irecv(sends) if sends else []:
        w.wait()


def receive_rows(store: WeightStore, slot: int, shapes: dict, r: int, world: int, group) -> None:
    """Rank 0: rank r's rows of every parameter (`shapes`: name -> full shape, in the model's
    order), as `send_rows` sends them, received straight into the store's writing slot."""
    recvs = []
    for name, shape in shapes.items():
        start = shard_rows(shape[0], r, world)
        n = shard_rows(shape[0], r + 1, world) - start
        if n:
            recvs.append(dist.P2POp(dist.irecv, store.rows(slot, name, start, n), r, group))
    for w in dist.batch_isend_irecv(recvs) if recvs else []:
        w.wait()
