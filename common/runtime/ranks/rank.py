"""Trainer ranks 1..N-1: what they are told at start (`RankSetup`) and the loop each runs
(`rank_main`): build the same sharded model as rank 0, then run rank 0's commands until "stop".

Runs in each spawned rank process: on the trainer's node spawned by `TrainerGroup`
(common/runtime/ranks/group.py, which documents the commands and the fault rules), on other
trainer nodes by that node's process (common/runtime/nodes/trainer_node.py), which hands it a
`StoreCommands` (common/runtime/ranks/commands.py) in place of the queue and no weight store.
"""
from __future__ import annotations

import pickle
import queue
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from common.contracts.algorithm import Algorithm
from common.engine.machine.precision import Precision
from common.contracts.micro import set_ranks
from common.runtime.process import set_process_defaults
from common.runtime.files.state import one_line
from common.runtime.ranks.fsdp import full_model, init_group, rank_device, read_shards, shard, write_shards
from common.runtime.ranks.publish import publish_shards
from common.runtime.ranks.share import Share
from common.runtime.step import make_optimizer, update
from common.runtime.shared.weights import WeightStore

_PHASE = {"step": "training", "publish": "publishing", "gather": "gathering", "save": "checkpointing",
          "load": "checkpointing"}


@dataclass
class RankSetup:
    """What ranks 1..N-1 need to build the same model, group and optimizer as rank 0 (picklable)."""
    world: int                # N
    port: int                 # rank 0's TCPStore (the process group's rendezvous)
    host: str                 # its address: 127.0.0.1, or torchrun's MASTER_ADDR with several trainer nodes
    local: int                # ranks 0..local-1 share rank 0's node and weight store (train.trainer_devices)
    device: str               # train.device: "cpu", or "cuda" (rank r on cuda:r)
    timeout_s: float          # collective timeout (the stall timeout; 0 = none)
    model: str                # the policy's checkpoint (a resume loads the state after)
    precision: Precision      # resolved by rank 0
    activation_checkpointing: bool  # train.activation_checkpointing
    share_prompts: bool | None  # train.share_prompts
    pack_rows: bool | None    # train.pack_rows (settled by check_config; None = off)
    reshard: str              # train.reshard resolved: "pass" or "update" (common/runtime/ranks/fsdp.py)
    lr: float                 # AdamW's initial rate (each step command carries rank 0's current one)
    weight_decay: float       # AdamW weight decay
    grad_clip: float          # max global grad norm; 0 = off
    adam_beta2: float = 0.95  # AdamW's betas (0.9, this)
    adam_eps: float = 1e-8    # AdamW's epsilon


def rank_main(rank: int, setup: RankSetup, algo_bytes: bytes, store: WeightStore, commands, beat, *, stop_event):
    """Trainer rank 1..N-1 (a spawned worker): build the same sharded model as rank 0, then
    run rank 0's commands until "stop" (module docstring). On another trainer node `store` is
    None (its rows go to rank 0) and `commands` a `StoreCommands`."""
    algo: Algorithm = pickle.loads(algo_bytes)  # a failure here reaches rank 0 with its traceback
    beat.start()
    beat("loading")
    device = rank_device(setup.device, rank)
    set_process_defaults(device)
    setup.precision.apply()
    model, _ = setup.precision.load(setup.model, device=device, role="trainer", tokenizer=False)
    model.train()
    model.checkpoint_layers, model.share_prompts = setup.activation_checkpointing, setup.share_prompts
    model.pack_rows = bool(setup.pack_rows)  # as rank 0's: every rank forms the same micro-batches
    tcp = dist.TCPStore(setup.host, setup.port, setup.world, is_master=False)
    tcp.set(f"ready{rank}", "1")
    mesh = init_group(rank, setup.world, tcp, device, setup.timeout_s, loopback=setup.world == setup.local)
    try:
        shard(model, mesh, setup.reshard)
        opt = make_optimizer(model, setup.lr, setup.weight_decay, setup.adam_beta2, setup.adam_eps)
        share = Share(model, rank, setup.world, beat=lambda: beat("training"), reshard=setup.reshard)
        set_ranks(share)
        while not stop_event.is_set():
            beat("waiting")
            try:
                kind, *args = commands.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "stop":
                return
            beat(_PHASE[kind])
            if kind == "step":
                step, lr, batch = args
                for g in opt.param_groups:
                    g["lr"] = lr  # rank 0's scheduler decides; ranks hold none
                update(algo, model, opt, batch.to(device), step, setup.grad_clip, share)
            elif kind == "publish":
                publish_shards(model, store, args[0], rank, setup.world, setup.local, setup.precision.torch_dtype)
            elif kind == "gather":
                full_model(model)
            elif kind == "save":
                for g, lr in zip(opt.param_groups, args[1]):
                    g["lr"] = lr
                try:
                    write_shards(args[0], model, opt)
                except (Exception, CheckpointException) as e:  # DCP raises a failed write on every rank
                    # (a CheckpointException is a BaseException): rank 0 reports it, this rank lives on
                    print(f"[trainer{rank}] checkpoint shards not written: {one_line(e)}", flush=True)
            elif kind == "load":
                read_shards(args[0], model, opt, args[1])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
