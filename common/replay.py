"""Replay a recorded run's trajectory stream through the trainer's own update, under an algorithm
and config of your choice, with no generators: the library call `replay(...)`, the command line,
the loop (`replay_stream`) and the side-by-side plot of a stream's replays. Runs in the launching
process (with `train.trainer_devices` = N > 1 the ranks as in training); the stream format and its
writer are the trainer's (common/runtime/files/stream.py).

    python run_gsm8k.py --train.record=true --name=x            # record (any task, any algorithm)
    python -m common.replay runs/x/stream --name=x_tb           # the same algorithm and config: same weights
    python -m common.replay runs/x/stream --name=x_noref --tba.beta_final=0.01 --train.lr=2e-5
    python -m common.replay runs/x/stream --algo=grpo --name=x_grpo   # another loss on the same data

The config starts as the recording's (train, gen, tba, grpo, areal, log, precision sections;
a task's own sections such as data are not needed) and takes `--section.field=value`
overrides like a task script; `train.steps` caps the steps replayed (default: all recorded).

    load the recorded run's initial weights (checked against the stream's fingerprint)
    -> for each recorded step s: lr = the recorded one (or the schedule's, if the config's
       train.lr / warmup_steps / decay_steps differ from the recording's)
       -> group.update(batch_s, s - 1, lr) -> scheduler step -> log / eval / checkpoint

Same update, same batches, same learning rates, same CPU threads: with the recording's algorithm,
config and precision the weights follow the recorded run's exactly (async runs become
reproducible). With another algorithm or loss it is an ablation on identical data, but off-policy
for every step after the first: the data were sampled by the recorded run's policy, not this one
(the batch's `behav_logp` and `versions` are the behaviour policy's, for losses that correct for it).

Each replay writes runs/<name>/ like a training run: config.json (with `replay_of`),
precision.json, metrics.jsonl (the trainer's per-step keys, staleness from the recorded versions,
`read_s` = reading the step from disk, `step_s` = read + update; waits and generator rates are
absent, there are none), checkpoints and curves; `<recorded run>/replays.png` lays the recorded
run and every replay of its stream under the same run_root side by side.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from common.contracts.algorithm import Algorithm
from common.contracts.config import format_help, load_config, parse_overrides, to_dict
from common.engine.machine.precision import Precision, resolve
from common.contracts.log import MetricsLogger
from common.contracts.plots import plot_metrics, plot_runs
from common.contracts.progress import Progress
from common.contracts.run_files import record
from common.runtime.process import trainer_process
from common.contracts.errors import UserError
from common.runtime.files.run_dir import RunNameError, check_name, run_dir_of
from common.runtime.run_log import evaluate_now, prepare_run_dir, staleness
from common.runtime.step import trainer_model
from common.runtime.files.stream import StreamError, fingerprint, read_meta, read_steps, recorded_threads, stream_steps
from common.runtime.train_config import check_config, lr_lambda
from common.task import RunConfig, make_algo, setup, user_error, validate
from common.train import trainer_ranks


def stream_dir(path) -> Path:
    """A stream directory, given it or the run directory that holds it."""
    p = Path(path)
    return p / "stream" if not (p / "stream.json").is_file() and (p / "stream" / "stream.json").is_file() else p


def replay_config(stream, argv=(), name: Optional[str] = None) -> RunConfig:
    """The recording's run config (its shared sections), then `argv` overrides; the name defaults
    to `<recorded name>_replay_<algo>`. Its precision is the recording's resolved one unless overridden."""
    stream = stream_dir(stream)
    meta = read_meta(stream)
    shared = {f for f in RunConfig.__dataclass_fields__}
    rec = {k: v for k, v in meta["config"].items() if k in shared}
    rec.update(resume=False)
    cfg = load_config(RunConfig, rec)
    args = list(argv)
    cfg = parse_overrides(cfg, args)
    if name is not None:
        cfg.name = name
    elif not any(a.startswith("--name") for a in args):
        cfg.name = f"{meta['run']}_replay_{cfg.algo}"
    check_name(cfg.name)
    validate(cfg)  # every setting in range before anything loads
    cfg.train.steps = min(cfg.train.steps, len(stream_steps(stream)))
    return cfg


def replay(stream, algo: Union[None, str, Algorithm, Callable[[RunConfig], Algorithm]] = None,
           argv=(), cfg: Optional[RunConfig] = None, evaluate: Optional[Callable] = None,
           name: Optional[str] = None, loss: Optional[Callable] = None, overwrite: bool = False) -> dict:
    """Train from the recorded run's initial weights on exactly its recorded batches, no
    generators; returns the last logged metrics. `stream`: a stream or run directory. `algo`:
    None (the config's), a name ("tba", "areal", "grpo"), an `Algorithm`, or a function of the
    config that builds one (e.g. `lambda cfg: TBA(cfg.tba, ..., loss_fn=my_loss)`). `loss`: a loss
    function for the config's (or `algo`'s named) algorithm, as `task.run(..., loss=)` takes it.
    `cfg` defaults to `replay_config(stream, argv, name)`; `overwrite` replaces an earlier replay
    of that name. evaluate(model, tokenizer) -> {metric: value} is called before, every
    train.eval_every steps and after, as in training."""
    stream = stream_dir(stream)
    meta = read_meta(stream)
    if cfg is None:
        if isinstance(algo, str):
            argv = [f"--algo={algo}", *argv]
        cfg = replay_config(stream, argv, name)
    cfg.overwrite = cfg.overwrite or overwrite
    if algo is None or isinstance(algo, str):
        algo = make_algo(cfg, loss)
    elif loss is not None:
        raise ValueError("replay: pass a loss with algo=None or an algorithm's name, not with an Algorithm")
    elif not isinstance(algo, Algorithm):
        algo = algo(cfg)
    rec_prec = load_config(RunConfig, {"precision": meta["config"]["precision"]}).precision
    precision = Precision.from_dict(meta["precision"]) if cfg.precision == rec_prec else None
    if precision is None:  # asked for another precision: resolve it here
        precision = resolve(cfg.precision, cfg.train.device)
    last = replay_stream(cfg, algo, stream, precision=precision, evaluate=evaluate, steps=cfg.train.steps)
    run_dir = run_dir_of(cfg)
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png", title=f"{cfg.name}: replay of {meta['run']}")
    recorded = stream.parent  # the recording's run folder: replays.png goes there, next to its curves
    if (recorded / "metrics.jsonl").is_file() and plot_replays(replays_of(stream, cfg.run_root), recorded / "replays.png",
                                                               title=f"replays of {meta['run']}'s stream") is not None:
        print(f"[asyncrl] replays side by side: {stream.parent / 'replays.png'}")
    return last


def replays_of(stream, run_root) -> list[tuple[Path, str]]:
    """(run dir, label) of the recorded run and every replay of `stream` under run_root."""
    stream = Path(stream).resolve()
    runs = [(stream.parent, f"{stream.parent.name} (recorded)")]
    for f in sorted(Path(run_root).glob("*/replay_of.json")):
        try:
            if Path(json.loads(f.read_text())["stream"]) == stream and (f.parent / "metrics.jsonl").is_file():
                runs.append((f.parent, f.parent.name))
        except (OSError, ValueError, KeyError):
            continue
    return [(d, label) for d, label in runs if (d / "metrics.jsonl").is_file()]


_LR_KEYS = ("lr", "warmup_steps", "decay_steps")


def replay_stream(cfg, algo: Algorithm, stream, precision: Optional[Precision] = None,
                  evaluate: Optional[Callable] = None, steps: Optional[int] = None) -> dict:
    """Train `algo` on the recorded batches of `stream` (a stream directory) into
    runs/<cfg.name>/; returns the last logged metrics. `cfg` is a run config (as for `train`);
    `precision` defaults to the recording's resolved one; `steps` to the whole stream.
    evaluate(model, tokenizer) -> {metric: value} runs before, every train.eval_every steps and after."""
    stream = Path(stream)
    meta = read_meta(stream)
    n = len(stream_steps(stream)) if steps is None else min(steps, len(stream_steps(stream)))
    if n == 0:
        raise StreamError(f"{stream}: no recorded steps yet")
    validate(cfg)  # a config built in Python too
    if cfg.train.pack_rows is None:  # the recording's layout, for its sums and bits (absent: recorded padded)
        cfg.train.pack_rows = bool(meta["config"]["train"].get("pack_rows", False))
    tc = check_config(cfg.train)
    run_dir = run_dir_of(cfg)  # the name checked: one folder under run_root
    if run_dir.resolve() == stream.resolve().parent:  # checked first: overwrite must never delete the recording
        raise RunNameError(f"replay into {run_dir} would mix with the recorded run: choose another name")
    run_dir = prepare_run_dir(cfg, resume=False)
    record(run_dir / "replay_of.json", run_dir / "precision.json")
    (run_dir / "replay_of.json").write_text(json.dumps({"stream": str(stream.resolve()), "steps": n}) + "\n")
    prec = precision or Precision.from_dict(meta["precision"])  # applied in `trainer_process`, restored after
    (run_dir / "precision.json").write_text(json.dumps(prec.to_dict(), indent=2) + "\n")
    ranks = trainer_ranks(tc)
    model, tok = trainer_model(prec, cfg.model, tc, ranks.model_device(tc))
    if fingerprint(model) != meta["init_fingerprint"]:
        raise StreamError(f"{cfg.model} is not the model the stream was recorded from ({meta['model']}): "
                          f"its weights differ (fingerprint), so the replay would not start where the run did")
    rec_train = meta["config"]["train"]
    recorded_lr = all(rec_train.get(k) == getattr(tc, k) for k in _LR_KEYS)
    generation = meta.get("generation")
    # the recording's CPU threads, also for ranks spawned by the group (same GEMM sums, same bits)
    with trainer_process(tc.device, recorded_threads(meta), prec), \
            ranks(model, tc, prec, cfg.model, algo, None, run_dir) as group:
        sched = torch.optim.lr_scheduler.LambdaLR(group.opt, lr_lambda(tc))
        logger = MetricsLogger(run_dir, use_tensorboard=cfg.log.tensorboard, use_wandb=cfg.log.wandb,
                               wandb_project=cfg.log.wandb_project,
                               config={**to_dict(cfg), "precision_resolved": prec.to_dict(), "replay_of": str(stream)})
        logger.log(0, precision=prec.to_dict())
        step, version, last = 0, 0, {}

        def checkpoint():
            return group.save(run_dir, step, sched, counters={"version": version}, config=cfg, buffer=None,
                              tokenizer=tok, keep_last=tc.keep_checkpoints, generation=generation)

        def run_eval(tag):
            return evaluate_now(evaluate, group, prec, tok, logger, cfg, step, tag)

        run_eval("before")
        bar = Progress(n, desc=f"{cfg.name} (replay)")
        t_read = time.perf_counter()
        for rs in read_steps(stream, n):
            t0 = time.perf_counter()  # the step's file is read and decoded
            version = rs.version
            lr = rs.lr if recorded_lr else sched.get_last_lr()[0]
            for g in group.opt.param_groups:
                g["lr"] = lr
            stale, multi_version = staleness(rs.batch, version)
            stats, gnorm = group.update(rs.batch, step, lr, tc.grad_clip)
            sched.step()
            step += 1
            t1 = time.perf_counter()
            last = dict(version=version, **{**stats, "reward_mean": rs.batch.reward.mean().item()}, grad_norm=gnorm,
                        lr=lr, read_s=t0 - t_read, train_s=t1 - t0, step_s=t1 - t_read,
                        trainer_tok_s=int(rs.batch.loss_mask.sum()) / (t1 - t0),
                        staleness_hist={str(s): stale.count(s) for s in sorted(set(stale))},
                        staleness_mean=sum(stale) / len(stale), multi_version_frac=multi_version,
                        recorded_loss=rs.stats.get("loss", float("nan")))
            logger.log(step, **last)
            bar.update(1, loss=last.get("loss", float("nan")))
            if tc.eval_every and step % tc.eval_every == 0 and step < n:
                last.update(run_eval("periodic"))
            if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < n:
                checkpoint()
            t_read = time.perf_counter()
        bar.close()
        last.update(run_eval("after"))
        ck = checkpoint()
        print(f"[asyncrl] replayed {n} steps of {stream}: final checkpoint {ck}, metrics in {run_dir / 'metrics.jsonl'}")
        logger.close()
    return last


# the panels of a replay comparison: what differs between replays of one stream (the data, and
# so reward_mean and staleness, are the same in all of them)
REPLAY_PANELS = (("loss", "loss"), ("grad_norm", "grad norm"), ("eval_accuracy", "test accuracy"),
                 ("eval_reward", "eval reward"))


def plot_replays(runs, out_png, panels=REPLAY_PANELS, title: Optional[str] = None):
    """Several replays of one stream side by side against the step: runs = [run_dir or
    (run_dir, label), ...], one colour per run, written to out_png; returns the matplotlib Figure
    (a notebook displays it as an image: `common.contracts.plots.plot_runs`), None when there is nothing to plot."""
    return plot_runs(runs, out_png, x="step", panels=panels, title=title)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        stream = stream_dir(argv[0])
        if "-h" in argv or "--help" in argv:
            print(format_help(replay_config(stream), __doc__))
            return 0
        cfg = replay_config(stream, argv[1:])
        setup(cfg)
        replay(stream, cfg=cfg)
    except UserError as e:  # StreamError, ConfigError, a run name, a run folder, ...: one line
        return user_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
