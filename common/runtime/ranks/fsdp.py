"""The trainer as N ranks: process group, FSDP2 sharding, how micro-batches are shared, the step
every rank runs, publishing shards into the weight store, gathering the full model.

Runs in every trainer rank: rank 0 is the trainer in the launching process (the coordinator:
it draws batches, logs, evaluates, checkpoints, publishes), ranks 1..N-1 are spawned workers
driven by it (`common/runtime/ranks/group.py`). With N = 1 nothing here makes a process
group: `update` and `full_model` run on the plain module, as before sharding existed.

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
            steps: one all-gather and one reduce-scatter per update instead of three
            transfers of the model per micro-batch; the whole fp32 model and its gradients
            sit on every rank meanwhile (+8 bytes / parameter; the AdamW state stays sharded).
            For slow links: "auto" picks it on CPU (gloo: BENCHMARKS.md), "pass" on GPUs.
On gloo the all-gathers and reduce-scatters are point-to-point transfers (`_PointToPoint`).
Mixed precision stays the model's own: fp32 master weights and optimizer state, forward under
autocast (`Transformer.autocast`), so one rank and N ranks compute the same numbers. Gradients are reduce-scattered as SUMS (not FSDP's default
mean), because each rank's micro-batch losses are already weighted by their share of the
whole batch: the summed gradient is the one-rank gradient (tests/test_ranks.py, 1e-5).

Collective discipline: every rank runs the same algorithm code on the same batch, so they meet
the same collectives in the same order. Micro-batch passes are the exception (each rank runs
its own share); `Share` keeps their number equal by owing the short ranks zero-loss passes,
paid before the next collective (`Share.pay`), and a grad pass's backward follows its forward.
"""
from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from common.algorithm import Algorithm
from common.batch import Batch
from common.engine.model import Transformer
from common.micro import Ranks
from common.ops import token_logp
from common.runtime.weights import WeightStore

_NO_TIMEOUT = timedelta(days=7)  # stall_timeout 0 (off): collectives wait as good as forever


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on GPUs (one device per rank), the CPU otherwise."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else "cpu"


def init_group(rank: int, world: int, store: dist.Store, device: str, timeout_s: float) -> DeviceMesh:
    """Join the trainer's process group (gloo on CPU, NCCL on CUDA) through `store` (rank 0's
    TCPStore). Collectives raise after `timeout_s` (the stall timeout): a hung rank stops the
    others instead of holding them forever."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s) if timeout_s > 0 else _NO_TIMEOUT)
    return init_device_mesh(dev.type, (world,))


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


def make_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters (its shards when sharded)."""
    # fused: one pass over each parameter's weights, gradient and moments, on CUDA and on CPU
    # (where torch's default loops over parameters with several passes each: BENCHMARKS, AdamW)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=True)


class Share(Ranks):
    """Rank r's share of the micro-batches: r, r + N, r + 2N, ... of every list, plus the
    zero-loss passes that bring it to the longest share (installed with `common.micro.set_ranks`)."""

    def __init__(self, model, rank: int, world: int, beat=None, reshard: str = "pass"):
        self.model, self.rank, self.world = model, rank, world
        self.beat = beat or (lambda: None)  # ranks 1..N-1: heartbeat on every list and payment
        self.hold = reshard == "update"  # keep weights gathered and gradients local until end_backward
        self._holding = False
        self.owed: list[bool] = []  # passes this rank owes the others: True = forward + backward
        self._dummy = torch.zeros(1, 2, dtype=torch.long, device=model.device)  # one target token
        self.group = group_of(model)

    def share(self, parts):
        self.beat()
        self.pay()  # passes owed from an earlier list come first, in order
        mine = parts[self.rank::self.world]
        # the kind of pass follows the caller's grad mode: a no-grad proximal pass owes forwards only
        self.owed += [torch.is_grad_enabled()] * (-(-len(parts) // self.world) - len(mine))
        if self.hold and torch.is_grad_enabled() and not self._holding:
            self._hold(True)
        return mine

    def _hold(self, on: bool) -> None:
        """reshard="update": accumulate full gradients locally, keep the weights gathered."""
        self._holding = on
        self.model.set_requires_gradient_sync(not on)
        self.model.set_reshard_after_backward(not on)

    def end_backward(self) -> None:
        """After an algorithm's backward: the owed passes, then (reshard="update") one zero-loss
        pass with gradient sync on, whose backward reduce-scatters the accumulated gradients
        and frees the gathered weights, so the optimizer steps on shards."""
        self.pay()
        if self._holding:
            self._hold(False)
            self.owed = [True]
            self.pay()

    def pay(self) -> None:
        """Run the owed passes through the model's __call__ (so FSDP gathers, and reduces in backward)."""
        owed, self.owed = self.owed, []
        if owed:
            self.beat()
        for grad in owed:
            with torch.set_grad_enabled(grad):
                lp = token_logp(self.model, self._dummy, 1.0)
                if grad:
                    (lp.sum() * 0).backward()  # zero gradients, the same reduce-scatters as a real pass

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        self.pay()
        dist.all_reduce(x, group=self.group)
        return x

    def sum_stats(self, stats: dict) -> dict:
        self.pay()
        every: list = [None] * self.world
        dist.all_gather_object(every, {k: float(v) for k, v in stats.items()}, group=self.group)
        keys = list(dict.fromkeys(k for d in every for k in d))  # a rank with no micro-batch has no keys
        return {k: sum(d.get(k, 0.0) for d in every) for k in keys}


def update(algo: Algorithm, model, opt, batch: Batch, step: int, grad_clip: float,
           share: Share | None = None) -> tuple[dict, float]:
    """One trainer step's optimizer updates, one per minibatch (every rank runs this on the
    same batch); stats (and the grad norm) averaged over minibatches."""
    mbs = algo.minibatches(model, batch, step)
    totals: dict[str, float] = {}
    for mb in mbs:
        opt.zero_grad(set_to_none=True)
        st = algo.backward(model, mb, step)
        if share is not None:
            share.end_backward()  # the short ranks' padding passes (and the flush), before the norm's all-reduce
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)  # global over shards
        opt.step()
        for k, v in {**st, "grad_norm": float(gnorm)}.items():
            totals[k] = totals.get(k, 0.0) + float(v) / len(mbs)
    totals["opt_steps"] = len(mbs)
    return totals, totals.pop("grad_norm")


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
