"""The trainer's config sections (`train`, `log`, and `dist` for several nodes) and the rules read
from them: the checks (and sync mode's settings) applied once before a run starts, the learning rate
schedule, and whether this process is one node of several. Read by the entry (common/train.py), the
trainer loop (`trainer.py`), a replay (common/replay.py) and the node layer; no process of its own.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union

import torch

from common.contracts.config import ConfigError
from common.contracts.config_check import Rule, above, at_least, between, check, processes, relation
from common.engine.model.lora import LoRAConfig


@dataclass
class TrainConfig:
    steps: int = 100                  # trainer steps (one batch each; an optimizer update per minibatch)
    lr: float = 1e-5                  # peak learning rate (AdamW)
    warmup_steps: int = 5             # linear warm-up steps; 0 = none
    warmup_fraction: float = 0.0      # > 0: warm-up steps = int(fraction x steps) instead (AReaL's warmup_steps_proportion)
    lr_schedule: Literal["linear", "cosine", "constant"] = "linear"  # decay shape after the stable phase (warmup-stable-decay); constant = none
    decay_steps: int = 0              # steps the decay to 0 takes; 0 = no decay
    stable_steps: Optional[int] = None  # steps at the peak after warm-up, then the decay (may outlast the run: it ends mid-decay); None = decay over the last decay_steps
    weight_decay: float = 0.0         # AdamW weight decay
    adam_beta2: float = 0.95          # AdamW's second-moment decay (beta1 0.9); transformers' and torch's default 0.999
    adam_eps: float = 1e-8            # AdamW's epsilon (AReaL: 1e-5)
    grad_clip: float = 1.0            # max global grad norm; 0 = off
    micro_batch_tokens: int = 8192    # token budget of one micro-batch (dynamic batching): real tokens when rows are packed, else rows x longest row
    activation_checkpointing: bool = False  # recompute each block's activations in backward: memory for ~1/3 more compute
    compile_blocks: bool = False      # torch.compile the blocks (one rank): fused norms/RoPE/SiLU, ATen GEMMs; costs a compile at start
    share_prompts: Optional[bool] = None  # a prompt shared by rows of a micro-batch runs once (packed; same gradient); None = on CPU, off on CUDA
    pack_rows: Optional[bool] = None  # a micro-batch's rows run packed end to end, no padding (same gradient); None = on CPU without compile_blocks, off on CUDA (unmeasured there)
    memory_fraction: float = 0.0      # CUDA: cap on the trainer's share of its GPU (shared with generators); 0 = no cap
    prompts_per_step: int = 7         # prompts (groups of gen.n samples) per training batch
    sync_every: int = 2               # k: publish weights to generators every k steps
    mode: Literal["async", "sync"] = "async"  # sync: generate a batch, train on it, repeat
    max_staleness: Union[int, Literal["auto"], None] = None  # eta, in versions; auto = set each step by a controller (common/runtime/staleness_control.py); None = unbounded (TBA searchers)
    max_staleness_max: int = 8        # auto: the largest eta the controller sets (and the bound the trainer's filter keeps)
    lr_by_ess: bool = False           # auto: scale the learning rate by sqrt(ESS fraction) of the behaviour weights (VCPO)
    n_generators: int = 1             # generator processes; 0 = one per GPU the trainer leaves (at least 1)
    trainer_devices: int = 1          # N trainer ranks, FSDP2-sharded (rank r on cuda:r; CPU: N processes, gloo); 1 = no process group
    reshard: Literal["auto", "pass", "update"] = "auto"  # N > 1: free gathered weights after every pass (least memory) or once per update (least traffic); auto: update on CPU (gloo), pass on GPUs
    reward_workers: int = 0           # processes hosting an expensive reward (needs train(reward_factory=...))
    min_buffer: int = 64              # async: trajectories in the buffer before the first step (0: at once, the algorithm waits for its batch)
    buffer_capacity: int = 4096       # ring size in trajectories
    checkpoint_every: int = 0         # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 1         # newest checkpoints kept (0 = all); one is ~2.3 GB for a 135M model (docs/configuration.md)
    eval_every: int = 0               # steps between evaluations; 0 = before and after only
    device: str = "cpu"               # trainer device ("cuda": rank r on cuda:r); generator r uses cuda:(N + r) % n_gpus
    stall_timeout: float = 120.0      # s without progress before a worker counts as hung (first model load ~20-40 s here); 0 = off
    stall_action: Literal["stop", "warn"] = "stop"  # hung worker: checkpoint and stop (exit != 0), or warn every stall_timeout s
    record: bool = False              # write every consumed batch to runs/<name>/stream/ for replay (common/runtime/files/stream.py)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapters instead of every weight (common/engine/model/lora.py)

    CHECKS = {  # ranges (common/contracts/config_check.py)
        "steps": at_least(1), "lr": between(0, 1, open_lo=True), "warmup_steps": at_least(0), "decay_steps": at_least(0),
        "warmup_fraction": between(0, 1, open_hi=True), "stable_steps": at_least(0), "adam_beta2": between(0, 1, open_lo=True, open_hi=True),
        "adam_eps": between(0, 1, open_lo=True),
        "weight_decay": (at_least(0), relation(lambda v, s: v * s.lr < 1, "< 1 / {p}lr={s.lr:g} (AdamW scales the "
                                               "weights by 1 - lr x weight_decay per update)")),
        "grad_clip": at_least(0), "micro_batch_tokens": at_least(1), "memory_fraction": between(0, 1),
        "prompts_per_step": at_least(1), "sync_every": at_least(1),
        "max_staleness": Rule(lambda v, s: v == "auto" or v >= 0, ">= 0, or auto"), "max_staleness_max": between(1, 64),
        "lr_by_ess": relation(lambda v, s: not v or s.max_staleness == "auto",
                              "false unless {p}max_staleness=auto (the ESS window is its controller's)"),
        "n_generators": processes(0), "reward_workers": processes(0),
        "buffer_capacity": at_least(1),
        "min_buffer": (at_least(0), relation(lambda v, s: s.mode == "sync" or v <= s.buffer_capacity,
                                             "<= {p}buffer_capacity={s.buffer_capacity} (the ring holds no more: "
                                             "the first step would wait for good)")),
        "checkpoint_every": at_least(0), "keep_checkpoints": at_least(0), "eval_every": at_least(0),
        "stall_timeout": at_least(0),
        "pack_rows": relation(lambda v, s: not (v and s.compile_blocks), "false or none with {p}compile_blocks=true "
                              "(compiled blocks run padded rows only)"),
        "trainer_devices": (processes(1), relation(lambda v, s: v == 1 or not s.lora.on,
                                                   "1 with {p}lora (sharded ranks hold no adapters yet)")),
        "record": relation(lambda v, s: not (v and s.lora.on), "false with {p}lora (a replay rebuilds whole weights)")}


@dataclass
class DistConfig:
    trainer_nodes: int = 1          # under torchrun: nodes that run the trainer (world ranks 0..n-1); the others run generators
    timeout: float = 300.0          # s: group creation, the start barrier, one weight or trajectory transfer, the final stop
    ship_every: float = 0.05        # s: how often a generator node sends the groups its generators finished
    trainer_node_generators: int = 0  # generators the trainer node runs beside the trainer (claiming on the store like the others)
    store_port: int = 0             # port of the trainer's key-value store (TCPStore); 0 = a free one, told to the others
    bind: str = ""                  # address the trainer's stores listen on; "" = MASTER_ADDR's (torchrun's rendezvous host)
    secret_file: str = ""           # file holding the per-run secret that seals store values (mode 600); "" = $ASYNCRL_RUN_SECRET

    CHECKS = {"trainer_nodes": at_least(1), "timeout": between(0, 365 * 86400, open_lo=True),  # a year: timedelta's range
              "ship_every": (above(0), relation(lambda v, s: v < s.timeout, "< {p}timeout={s.timeout:g} (a shipment "
                                                "less often than the timeout would trip it)")),
              "trainer_node_generators": processes(0), "store_port": between(0, 65535)}  # ranges (common/contracts/config_check.py)


@dataclass
class LogConfig:
    tensorboard: bool = False         # also write TensorBoard events (if installed)
    wandb: bool = False               # also log to Weights & Biases (if installed)
    wandb_project: str = "asyncrl"    # W&B project name


def warmup_steps(cfg: TrainConfig) -> int:
    """The warm-up's length in trainer steps: `warmup_fraction` of the run where set, else `warmup_steps`."""
    return int(cfg.warmup_fraction * cfg.steps) if cfg.warmup_fraction > 0 else cfg.warmup_steps


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """The LR multiplier of trainer step `step` (0-based), warmup-stable-decay as transformers'
    `get_wsd_schedule` has it, its scheduler stepped before each update (TBA's loops, AReaL's): update
    u = step + 1 runs at lambda(u) = u / W during the warm-up of W steps, then 1 for the stable
    phase, then over `decay_steps` D from its start s = W + `stable_steps` (None: s = steps - D, the
    decay ends with the run) with progress p = (u - s) / D: 1 - p (`linear`) or (1 + cos(pi p)) / 2
    (`cosine`), and 0 once the decay is over; `constant` never decays. The last update of a run that
    decays to its end runs at 0."""
    W = warmup_steps(cfg)
    start = (cfg.steps - cfg.decay_steps) if cfg.stable_steps is None else W + cfg.stable_steps

    def f(step):
        u = step + 1
        if u < W:
            return u / W
        if cfg.lr_schedule == "constant" or not cfg.decay_steps or u < start:
            return 1.0
        p = min(1.0, (u - start) / cfg.decay_steps)
        return 1.0 - p if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return f


def check_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` checked (its ranges, `TrainConfig.CHECKS`, and what this machine allows; errors name
    the key) and completed: sync mode's eta = 0 and k = 1, the generator count when 0, pack_rows
    when None; returns it."""
    check(cfg, "train.")
    if cfg.mode == "sync" and cfg.max_staleness == "auto":
        raise ConfigError("--train.max_staleness=auto needs --train.mode=async (sync is eta = 0, nothing to set)")
    if cfg.mode == "sync":  # lock-step: one batch per version, consumed as generated
        cfg.max_staleness, cfg.sync_every = 0, 1
    gpus = torch.cuda.device_count() if cfg.device.startswith("cuda") else 0
    if gpus and cfg.trainer_devices > gpus:
        raise ConfigError(f"--train.trainer_devices={cfg.trainer_devices}: this machine has {gpus} GPUs")
    if cfg.n_generators == 0:  # the GPUs the trainer leaves; with none left, one that shares
        cfg.n_generators = max(1, gpus - cfg.trainer_devices)
    if cfg.pack_rows is None:  # measured faster on CPU (bench/_long_train.py); not yet on a GPU
        cfg.pack_rows = not cfg.device.startswith("cuda") and not cfg.compile_blocks
    if cfg.compile_blocks and cfg.trainer_devices > 1:
        raise ConfigError("--train.compile_blocks with trainer_devices > 1 is not supported (FSDP2's per-block "
                          "hooks are not traced here): use one of them")
    return cfg


def filter_staleness(cfg: TrainConfig) -> Optional[int]:
    """The staleness the trainer's filter allows (areal/algo.py): eta, or with `auto` the ceiling
    (lowering eta pauses admission; rows admitted under the higher bound are still trained)."""
    return cfg.max_staleness_max if cfg.max_staleness == "auto" else cfg.max_staleness


def under_torchrun() -> bool:
    """True in a process torchrun started in a world of more than one process: one node of several
    (common/runtime/nodes/), where `dist` applies."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def torchrun_restarts() -> int:
    """How many times torchrun (`--max-restarts`) restarted this process's job, as its agent counts
    them; 0 outside torchrun. Several nodes count across nodes: common/runtime/nodes/world.py, `restarted`."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
