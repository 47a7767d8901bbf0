"""Replay a recorded trajectory stream through the trainer's own update, with no generators.
Runs in the launching process (rank 0; with `train.trainer_devices` = N > 1 the ranks as in
training, `common/runtime/ranks/group.py`).

    load the recorded run's initial weights (checked against the stream's fingerprint)
    -> for each recorded step s: lr = the recorded one (or the schedule's, if the config's
       train.lr / warmup_steps / decay_steps differ from the recording's)
       -> group.update(batch_s, s - 1, lr) -> scheduler step -> log / eval / checkpoint

Same update, same batches, same learning rates, same CPU threads: with the recording's algorithm,
config and precision the weights follow the recorded run's exactly (async runs become
reproducible). With another algorithm or loss it is an ablation on identical data, but off-policy for every step
after the first: the data were sampled by the recorded run's policy, not this one (the batch's
`behav_logp` and `versions` are the behaviour policy's, for losses that correct for it).

Writes runs/<name>/ like a training run: config.json (with `replay_of`), precision.json,
metrics.jsonl (the trainer's per-step keys, staleness from the recorded versions, `read_s` =
reading the step from disk, `step_s` = read + update; waits and generator rates are absent,
there are none), checkpoints and, through the caller, curves.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from common.algorithm import Algorithm
from common.config import to_dict
from common.engine.precision import Precision
from common.log import MetricsLogger, Progress, plot_runs
from common.runtime.process import trainer_process
from common.runtime.ranks.fsdp import rank_device
from common.runtime.run_log import evaluate_now, prepare_run_dir, staleness
from common.runtime.stream import StreamError, fingerprint, read_meta, read_steps, recorded_threads, stream_steps
from common.runtime.train_config import check_config, lr_lambda
from common.runtime.ranks.group import TrainerGroup

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
    tc = check_config(cfg.train)
    run_dir = Path(cfg.run_root) / cfg.name
    if run_dir.resolve() == stream.resolve().parent:  # checked first: overwrite must never delete the recording
        raise ValueError(f"replay into {run_dir} would mix with the recorded run: choose another name")
    run_dir = prepare_run_dir(cfg, resume=False)
    (run_dir / "replay_of.json").write_text(json.dumps({"stream": str(stream.resolve()), "steps": n}) + "\n")
    prec = precision or Precision.from_dict(meta["precision"])  # applied in `trainer_process`, restored after
    (run_dir / "precision.json").write_text(json.dumps(prec.to_dict(), indent=2) + "\n")
    device = rank_device(tc.device, 0) if tc.trainer_devices > 1 else tc.device
    model, tok = prec.load(cfg.model, device=device, role="trainer")
    model.train()
    model.checkpoint_layers, model.compile_blocks = tc.activation_checkpointing, tc.compile_blocks
    model.share_prompts = tc.share_prompts
    if fingerprint(model) != meta["init_fingerprint"]:
        raise StreamError(f"{cfg.model} is not the model the stream was recorded from ({meta['model']}): "
                          f"its weights differ (fingerprint), so the replay would not start where the run did")
    rec_train = meta["config"]["train"]
    recorded_lr = all(rec_train.get(k) == getattr(tc, k) for k in _LR_KEYS)
    generation = meta.get("generation")
    # the recording's CPU threads, also for ranks spawned by the group (same GEMM sums, same bits)
    with trainer_process(tc.device, recorded_threads(meta), prec), \
            TrainerGroup(model, tc, prec, cfg.model, algo, None, run_dir) as group:
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
    (a notebook displays it as an image: `common.log.plot_runs`), None when there is nothing to plot."""
    items = [(r, Path(r).name) if isinstance(r, (str, Path)) else tuple(r) for r in runs]
    return plot_runs([(Path(d) / "metrics.jsonl", label) for d, label in items], out_png, x="step",
                     panels=panels, title=title)
