"""The trainer's ranks' process group and FSDP2 sharding: joining the group, wrapping the model,
FSDP's transfers on gloo, and the whole model back from the shards (an evaluation's model, a
checkpoint's export and its sharded state).

Runs in every trainer rank: rank 0 is the trainer in the launching process (the coordinator:
it draws batches, logs, evaluates, checkpoints, publishes), ranks 1..N-1 are spawned workers
driven by it (`common/runtime/ranks/group.py`). One rank (the core, common/runtime/step.py) has
no process group and never comes here.

Sharding (FSDP2, `torch.distributed.fsdp.fully_shard`): each transformer block and then the
root are wrapped; every parameter is split along dim 0, rank r holding rows [r c, (r + 1) c)
with c = ceil(rows / N). When gathered weights are freed is `train.reshard`:
  "pass"    (FSDP's default, ZeRO-3) a block's weights are all-gathered just before its forward,
            freed after it, gathered again for its backward; gradients are reduce-scattered
            after every micro-batch's backward. Least memory: ~16 bytes / parameter / N plus
            one block gathered.
  "update"  the weights are gathered at the first pass of an optimizer update and kept, and
            full-size gradients accumulate without communication, until one zero-loss
            "flush" pass reduce-scatters them and frees the weights before the optimizer
            steps (`Share.end_backward`, common/runtime/ranks/share.py): one all-gather and one
            reduce-scatter per update instead of three transfers of the model per micro-batch;
            the whole fp32 model and its gradients sit on every rank meanwhile (+8 bytes /
            parameter; the AdamW state stays sharded). For slow links: "auto" picks it on CPU
            (gloo: BENCHMARKS.md), "pass" on GPUs.
On gloo the all-gathers and reduce-scatters are point-to-point transfers (`_PointToPoint`).
Mixed precision stays the model's own: fp32 master weights and optimizer state, forward under
autocast (`Transformer.autocast`), so one rank and N ranks compute the same numbers. Gradients
are reduce-scattered as SUMS (not FSDP's default mean), because each rank's micro-batch losses
are already weighted by their share of the whole batch: the summed gradient is the one-rank
gradient (tests/test_ranks.py, 1e-5).
"""
from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from common.engine.model.transformer import Transformer
from common.runtime.files.state import read_state, write_state

_NO_TIMEOUT = timedelta(days=7)  # stall_timeout 0 (off): collectives wait as good as forever


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on GPUs (one device per rank), the CPU otherwise."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else "cpu"


def init_group(rank: int, world: int, store: dist.Store, device: str, timeout_s: float,
               loopback: bool = False) -> DeviceMesh:
    """Join the trainer's process group (gloo on CPU, NCCL on CUDA) through `store` (rank 0's
    TCPStore). Collectives raise after `timeout_s` (the stall timeout): a hung rank stops the
    others instead of holding them forever. `loopback`: every rank is on this machine, so gloo
    listens on the loopback interface only (by default it listens on GLOO_SOCKET_IFNAME's, else on
    the address the host name resolves to: on a cluster node, one the network reaches)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    with _gloo_on_loopback() if loopback and dev.type != "cuda" else contextlib.nullcontext():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s) if timeout_s > 0 else _NO_TIMEOUT)
        return init_device_mesh(dev.type, (world,))


@contextlib.contextmanager
def _gloo_on_loopback():
    """GLOO_SOCKET_IFNAME set to the loopback interface while groups are made (gloo reads it when it
    makes a group's device; pg_options are not passed to gloo), restored after."""
    lo = next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def group_of(model) -> dist.ProcessGroup:
    """The process group of a sharded model's ranks (its FSDP mesh's). Every collective of the
    trainer names it: the trainer's ranks are never assumed to be the default group's."""
    return next(model.parameters()).device_mesh.get_group()


def resolve_reshard(reshard: str, device: str) -> str:
    """train.reshard "auto": "update" on CPU, where gloo's transfers are slow and host memory
    is plentiful (BENCHMARKS.md), "pass" (least memory) on GPUs with NCCL."""
    if reshard not in ("auto", "pass", "update"):
        raise ValueError(f"train.reshard={reshard!r}: expected 'auto', 'pass' or 'update'")
    if reshard != "auto":
        return reshard
    return "pass" if torch.device(device).type == "cuda" else "update"


def shard(model: Transformer, mesh: DeviceMesh, reshard: str = "pass") -> Transformer:
    """Wrap every block, then the root (embeddings, final norm, head: tied weights stay one
    parameter), with FSDP2; gradients reduced as sums (module docstring)."""
    if reshard not in ("pass", "update"):
        raise ValueError(f"train.reshard={reshard!r}: expected 'pass' or 'update'")
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard == "pass")
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard == "pass")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)         # sum, not mean, over ranks ...
            m.set_force_sum_reduction_for_comms(True)  # ... as a plain SUM (gloo has no PREMUL_SUM)
            if dist.get_backend() == "gloo":
                m.set_custom_all_gather(_AllGather())
                m.set_custom_reduce_scatter(_ReduceScatter())
    return model


class _PointToPoint:
    """gloo (CPU): FSDP's all-gather and reduce-scatter as point-to-point transfers, which gloo
    moves several times faster than its own all-gather / reduce-scatter on one node
    (BENCHMARKS.md). Each rank sends every peer what that peer needs, all transfers posted at
    once. FSDP calls these with the same arguments as its defaults, on every rank in the same
    order; they finish before returning (FSDP waits on nothing)."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @staticmethod
    def _exchange(group, sends: list, recvs: list) -> None:
        ops = []
        for p in range(group.size()):
            if p != group.rank():
                peer = dist.get_global_rank(group, p)
                ops += [dist.P2POp(dist.isend, sends[p], peer, group), dist.P2POp(dist.irecv, recvs[p], peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _AllGather(_PointToPoint):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        out = output_tensor.chunk(group.size())  # equal chunks: FSDP pads every shard to one size
        out[group.rank()].copy_(input_tensor)
        self._exchange(group, [input_tensor] * group.size(), list(out))


class _ReduceScatter(_PointToPoint):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"point-to-point reduce-scatter sums only, got {op}")
        me, chunks = group.rank(), list(input_tensor.chunk(group.size()))
        got = [torch.empty_like(chunks[me]) if p != me else None for p in range(group.size())]
        self._exchange(group, chunks, got)
        output_tensor.copy_(chunks[me])
        for g in got:
            if g is not None:
                output_tensor.add_(g)


def full_model(model) -> Transformer | None:
    """The whole model as a plain module: the model itself when unsharded; sharded, a
    collective (every rank calls it) that gives rank 0 a CPU copy and the others None."""
    if not isinstance(model, FSDPModule):
        return model
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank(group_of(model)) != 0:
        return None
    with torch.device("meta"):
        full = Transformer(model.cfg, model.hf_config)
    full.load_state_dict(state, assign=True)
    full.tie_weights()
    full.compute_dtype, full.kv_dtype = model.compute_dtype, model.kv_dtype
    return full.train(model.training)


def write_shards(d: Path, model, optimizer) -> Transformer | None:
    """Every rank at the same point: its shards of the model and optimizer state into `d`
    (common/runtime/files/state.py), then the whole model gathered for the export (rank 0 gets it,
    the others None)."""
    write_state(d, model, optimizer, group_of(model))
    return full_model(model)


def read_shards(d: Path, model, optimizer, stepped: bool) -> None:
    """Every rank at the same point: its shards of `write_shards`' state, whatever N wrote them."""
    read_state(d, model, optimizer, stepped, group_of(model))
