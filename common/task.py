"""What every task script shares: `run`, `setup`, `script`, and the run config (common/run_config.py,
its names re-exported here).

Runs in the launching (trainer) process. A task script (`run_gsm8k.py`, `run_tldr.py`, ...)
holds only what is its own: a config subclass of `RunConfig` with its `data` section and
defaults, its data, prompt, reward, evaluation and presets. It then calls

    cfg = make_config(MyTaskConfig(), argv, presets={"gpu": gpu_preset}, description=__doc__)
    setup(cfg)                                       # threads, seed
    ...                                              # task: data, prompts, reward, evaluate
    run(cfg, prompts, reward_fn, stops, evaluate=..., title="My task", loss=loss)

`loss` (of `run` and `make_algo`) is None (the algorithm's own), a loss function for the
algorithm `cfg.algo` names (common/contracts/algorithm.py: the loss contract), or a whole `Algorithm`
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

import functools
import importlib
import inspect
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from areal.algo import AReaL
from common.contracts.algorithm import Algorithm
from common.contracts.batch import PromptSet
from common.engine.checkpoints.hf_io import check_model, load_tokenizer, resolve_checkpoint
from common.contracts.errors import UserError, debug
from common.contracts.plots import plot_metrics
from common.plan.preflight import check_devices, check_memory, use_random_weights
from common.run_config import ALGOS, DEFAULT_POLICY, RunConfig, areal_defaults, gpu_defaults, make_config, validate
from common.runtime.process import set_process_defaults
from common.runtime.train_config import check_config, filter_staleness
from common.train import logs_here, train
from tba.algo import GRPO, TBA

__all__ = ["RunConfig", "DEFAULT_POLICY", "areal_defaults", "gpu_defaults", "make_config", "validate",  # run_config's,
           "script", "user_error", "setup", "tokenizer_of", "make_algo", "split_reward", "run"]  # for the task scripts


def script(main: Callable[[], object]) -> None:
    """A task script's `if __name__ == "__main__":` body: `main()`, with a user's mistake (a
    `UserError`: a bad setting, a model or data path that does not exist or lacks files, a run
    name, an existing run) printed as one line, `error: <what, where, the fix>`, exit status 2;
    and Ctrl-C ending with the runtime's own line (the checkpoint it saved), exit status 130. The
    traceback is printed too only with `ASYNCRL_DEBUG=1` (common/contracts/errors.py).

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
    seed; `--random_weights`' local models and the memory check (common/plan/preflight.py)."""
    check_devices(cfg)  # first: a GPU preset on a CPU machine stops here, before a model is built
    set_process_defaults(cfg.train.device)
    torch.manual_seed(cfg.seed)
    if cfg.memory_check:  # before anything loads or is built: a plan that does not fit stops here, naming what to change
        check_memory(cfg)
    if cfg.random_weights:  # hub ids -> local random models, before any worker starts (common/plan/preflight.py)
        use_random_weights(cfg)


def tokenizer_of(cfg: RunConfig):
    """The policy's tokenizer (the offline default model is converted on first use). Local model
    paths are checked first (`--model`, `--ref_model`): a missing folder or file is named then,
    not in a worker once the run has started."""
    check_model(cfg.model, "--model", tokenizer=True)
    check_model(cfg.ref_model, "--ref_model")
    return load_tokenizer(resolve_checkpoint(cfg.model))


def make_algo(cfg: RunConfig, loss: Union[Callable, Algorithm, None] = None) -> Algorithm:
    """The `Algorithm` (common/contracts/algorithm.py) that `cfg.algo` names, built from its section once
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
