"""The trainer loop, shared by every algorithm and task; runs in the launching process.

    publish v0 -> start generators -> [wait for data] -> algo.next_batch
    -> for each of algo.minibatches(...): algo.backward -> clip + optimizer step
    -> LR schedule step -> [auto: eta from the step's measures] -> publish every k steps
    -> log / eval / checkpoint -> ...

Everything algorithm-specific sits behind `Algorithm` (common/algorithm.py; tba/algo.py, areal/algo.py): which rows
form a batch, how a step splits into optimizer updates (TBA: one; AReaL: PPO minibatches),
and the loss. The trainer owns the model, the optimizer, the `WeightStore` (it
is its only writer), the `Control` quota (only writer of version/quota) and the buffer's
reading side. Synchronous mode (`train.mode=sync`) is the same code with max_staleness = 0 and
k = 1 (`check_config`): generators may start exactly one batch of prompts per published version,
and the trainer consumes exactly that batch, so sync and async runs do equal work per step.

The loop talks to two objects the entry (common/train.py, `train`) picks and that do nothing
special on one device: `ranks`, the model and its optimizer (`OneRank`, common/runtime/step.py;
N sharded ranks: `TrainerGroup`, common/runtime/ranks/group.py, this process being rank 0 and the
coordinator that alone draws batches, logs, evaluates and checkpoints), and `peers`, the other
nodes (`Peers`, common/runtime/peers.py: none; under torchrun `TrainerLink`,
common/runtime/nodes/link.py).

A run config needs: name, run_root, model, ref_model, seed, and sections train (TrainConfig), gen
(GenConfig), log (LogConfig), precision (PrecisionConfig); TrainConfig and LogConfig live in
`train_config.py`.

Precision (`common/engine/precision.py`): resolved once here (measured per machine when `auto`),
printed, saved as runs/<name>/precision.json and handed to the generators. bf16 keeps the
model and AdamW state in fp32 and runs forward passes under autocast; the weight store holds
the generators' dtype, so `publish` casts while it copies.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable, Optional

import torch

from common.algorithm import Algorithm
from common.batch import PromptSet
from common.config import to_dict
from common.engine.precision import resolve
from common.log import MetricsLogger
from common.progress import Progress
from common.run_files import record
from common.runtime.buffer import ReplayBuffer
from common.runtime.checkpoint import latest_checkpoint
from common.runtime.checkpoint_dir import clean_checkpoints
from common.runtime.generator import Control, check_kv_pool, generator_main
from common.runtime.launch import WorkerError, Workers
from common.runtime.peers import Peers
from common.runtime.process import sigterm_as_interrupt
from common.runtime.reward_service import start_reward_workers
from common.runtime.run_log import evaluate_now, prepare_run_dir, staleness, step_line, step_row
from common.runtime.staleness_control import StalenessBound
from common.runtime.step import OneRank, RankFailed, trainer_model
from common.runtime.stream import StreamWriter
from common.runtime.train_config import lr_lambda
from common.runtime.watchdog import Heartbeats, WorkerStalled
from common.runtime.weights import WeightStore


def run_trainer(cfg, algo: Algorithm, prompts: PromptSet, reward_fn, stop_token_ids: tuple,
                evaluate: Optional[Callable], resume: bool, reward_factory: Optional[Callable],
                ranks: type[OneRank] = OneRank, peers: type[Peers] = Peers) -> dict:
    """Run a full training job in this process; returns the last logged metrics (module docstring).
    Called by the entry (common/train.py: `train`, which documents the arguments), with `cfg.train`
    checked, inside `process.trainer_process`."""
    tc = cfg.train
    if cfg.gen.cuda_graphs and not tc.device.startswith("cuda"):
        raise ValueError("gen.cuda_graphs needs CUDA (--train.device=cuda): CPU generators decode eagerly")
    run_dir = prepare_run_dir(cfg, resume)
    if tc.memory_fraction > 0 and torch.device(tc.device).type == "cuda":
        dev = torch.device(tc.device)  # the GPU preset says "cuda": the cap wants an index, the current GPU's
        torch.cuda.set_per_process_memory_fraction(tc.memory_fraction,
                                                   torch.cuda.current_device() if dev.index is None else dev.index)
    prec = resolve(cfg.precision, tc.device).apply()
    print(f"[asyncrl] precision: {prec.summary()}")
    record(run_dir / "precision.json")
    (run_dir / "precision.json").write_text(json.dumps(prec.to_dict(), indent=2) + "\n")
    model, tok = trainer_model(prec, cfg.model, tc, ranks.model_device(tc))
    max_seq_len = max(len(p) for p in prompts.tokens) + cfg.gen.max_new_tokens
    check_kv_pool(cfg.gen, tc.device, max_seq_len - cfg.gen.max_new_tokens)  # before any worker, whatever memory_check
    # a hard position limit (GPT-2's, Gemma 3's windows): refused here, before any generator starts
    model.check_positions(max_seq_len, f"{cfg.model}: the longest prompt ({max_seq_len - cfg.gen.max_new_tokens} tokens) "
                                       f"+ gen.max_new_tokens ({cfg.gen.max_new_tokens})")
    # in the generators' dtype; CUDA: shared with generators (and trainer ranks) via IPC
    store = WeightStore.from_module(model, device=model.device, dtype=prec.torch_dtype)
    clean_checkpoints(run_dir, tc.keep_checkpoints)  # a crash's leftovers (a write or a prune cut off), only ours
    ck = latest_checkpoint(run_dir) if resume else None
    if resume and ck is None:
        print(f"[asyncrl] --resume: no checkpoint in {run_dir / 'checkpoints'}, starting fresh")
    # generation_config.json of every saved model: the policy's stop tokens and sampling settings
    generation = {"stop_token_ids": tuple(stop_token_ids), "sampling": {
        "temperature": cfg.gen.temperature, "top_p": cfg.gen.top_p, "top_k": cfg.gen.top_k}}
    # before sharding: a fresh stream fingerprints the whole initial model
    stream = StreamWriter.open(run_dir / "stream", cfg, prec.to_dict(), model, ck, generation) if tc.record else None
    pad_id = (tok.pad_token_id or 0) if tok else 0
    # other nodes: what they need to build their store and buffer
    link = peers(cfg, tc, store, dict(precision=prec, max_seq_len=max_seq_len, pad_id=pad_id))
    # SIGTERM (torchrun, Slurm, kill) = Ctrl-C: checkpoint, then stop. N ranks: spawned here, and
    # `model` sharded in place (the optimizer holds shards); generators and reward workers are
    # `workers`, stopped before the final evaluation and checkpoint
    with (sigterm_as_interrupt(), link, ranks(model, tc, prec, cfg.model, algo, store, run_dir, link) as group,
          Workers() as workers):
        sched = torch.optim.lr_scheduler.LambdaLR(group.opt, lr_lambda(tc))
        step = version = 0
        buffer, counters = None, {}
        if ck is not None:
            st = group.load(ck, sched, buffer_size=(tc.buffer_capacity, max_seq_len))  # a saved ring of other sizes is refused
            step, version, buffer, counters = st.step, st.version, st.buffer, st.counters
            print(f"[asyncrl] resumed from {ck} at step {step}, version {version}")
        if buffer is None:
            buffer = ReplayBuffer(tc.buffer_capacity, max_seq_len, pad_id=pad_id)
        logger = MetricsLogger(run_dir, use_tensorboard=cfg.log.tensorboard, use_wandb=cfg.log.wandb,
                               wandb_project=cfg.log.wandb_project,
                               config={**to_dict(cfg), "precision_resolved": prec.to_dict()},
                               keep_to=step if resume else None)
        logger.log(step, precision=prec.to_dict())  # the choice, with what decided it, in the metrics too
        last: dict = {}

        def checkpoint():  # the current step, everything needed to resume
            if stream is not None:
                stream.sync()  # a checkpoint never claims steps its stream lacks
            return group.save(run_dir, step, sched, counters={"version": version, **bound.counters()}, config=cfg,
                              buffer=buffer, tokenizer=tok, keep_last=tc.keep_checkpoints, generation=generation)

        def run_eval(tag):
            return evaluate_now(evaluate, group, prec, tok, logger, cfg, step, tag)

        def check():  # every process of the run, wherever this one waits
            workers.check()
            group.check()
            link.check()

        group.publish(version)
        per_version = tc.prompts_per_step * tc.sync_every
        # eta: fixed, or set each step from the run's measures (auto; its state from the checkpoint)
        bound = StalenessBound(tc, counters)
        control = link.control(workers.ctx, buffer, per_version, bound.eta, tc.n_generators)
        link.publish(version)  # before the quota opens
        # AReaL on resume: accepted = v x B, plus the groups the restored buffer holds untrained
        # (they were admitted too; counting them keeps the bound; TBA never consumes, is unbounded)
        pending = buffer.stats()["n_unconsumed"] // cfg.gen.n if tc.max_staleness is not None else 0
        control.set_version(version, started=version * per_version + pending)
        if step == 0:
            run_eval("before")
        # the reward workers' client: held while the workers live (they share its queues and locks)
        reward_fn = _start_generators(cfg, workers, link, group, run_dir, store, buffer, control, prompts, reward_fn,
                                      reward_factory, max_seq_len, stop_token_ids, prec)
        bar = Progress(tc.steps, initial=step, desc=f"{cfg.name} ({tc.mode})")
        try:
            if tc.mode == "async":
                workers.wait_event(lambda: group.check() or link.check() or bar.waiting(
                    lambda: f"first batch: buffer {len(buffer)}/{tc.min_buffer}") or len(buffer) >= tc.min_buffer,
                    timeout=math.inf)
            gen_prev = (control.stats[:, Control.TOKENS].sum().item(), time.perf_counter())
            while step < tc.steps:
                t0 = time.perf_counter()
                batch = _next_batch(algo, buffer, step, version, tc.mode == "sync", bar, check)
                t1 = time.perf_counter()
                # versions behind the weights that train on it (0 = on-policy)
                stale, multi_version = staleness(batch, version)
                rec = stream.capture(batch) if stream is not None else None  # before the update: as drawn
                lr = group.opt.param_groups[0]["lr"]  # the schedule's, x auto's ESS factor with train.lr_by_ess
                stats, gnorm = group.update(batch, step, lr, tc.grad_clip)
                if stream is not None:  # record_bytes, record_s into the metrics
                    stats.update(stream.write(step + 1, version, lr, rec,
                                              {**stats, "grad_norm": gnorm}))
                sched.step()  # once per trainer step, however many minibatch updates it made
                step += 1
                t2 = time.perf_counter()
                stats.update(bound.after_step(stats, t1 - t0, t2 - t1, control, group.opt))  # auto: eta, lr scale
                publish_s = 0.0
                try:  # the step is done: its row is logged even when a publish or a check below raises
                    if step % tc.sync_every == 0:
                        version += 1
                        group.publish(version)
                        link.publish(version)  # other nodes have it before the quota moves
                        control.set_version(version, dropped=buffer.n_dropped_stale // cfg.gen.n)  # their places back
                        publish_s = time.perf_counter() - t2
                    check()
                finally:
                    last, gen_prev = step_row(batch, stats, gnorm, group.opt.param_groups[0]["lr"], (t0, t1, t2),
                                              publish_s, version, stale, multi_version, control, buffer, gen_prev)
                    logger.log(step, **last)
                bar.update(1, **step_line(last, bound.moved))
                if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
                    last.update(run_eval("periodic"))
                if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
                    checkpoint()
        except RankFailed:  # a trainer rank: its shards went with it, nothing whole is left to save
            bar.close()
            _reward_errors_note(control, cfg.gen.error_reward)
            print(f"\n[asyncrl] stopped at step {step}: a trainer rank failed; no checkpoint (its shards are "
                  f"lost); fix the cause, then continue with --resume from the last one", file=sys.stderr)
            raise
        except (WorkerStalled, WorkerError) as e:  # a hung (reported with its stack) or dead worker:
            bar.close()  # the trainer's own state is whole (checks run between updates): keep it, stop non-zero
            what = "is hung" if isinstance(e, WorkerStalled) else "failed"
            _reward_errors_note(control, cfg.gen.error_reward)
            print(f"\n[asyncrl] stopped at step {step}: a worker {what}; checkpoint {checkpoint()}; "
                  f"fix the cause, then continue with --resume", file=sys.stderr)
            raise
        except KeyboardInterrupt as e:  # nothing lost: save the last completed step, then stop
            # (a Ctrl-C inside opt.step(), ~1% of a CPU step, saves a half-applied update: still
            # a valid model, one partial step off)
            bar.close()
            _reward_errors_note(control, cfg.gen.error_reward)
            ck = checkpoint()
            print(f"\n[asyncrl] interrupted (Ctrl-C or SIGTERM) at step {step}: checkpoint {ck}; continue with --resume")
            e.reported = True  # that line ends the run: task scripts print no traceback after it
            raise
        bar.close()
        workers.shutdown()  # generators stop; the trainer ranks stay for the last evaluation and checkpoint
        link.stop()  # and those of other nodes
        print(f"[asyncrl] tokens per generator: {control.stats[:, Control.TOKENS].long().tolist()}")
        if store.device.type == "cuda":
            torch.cuda.ipc_collect()  # the generators have released the store: free what they held
        last.update(run_eval("after"))
        ck = checkpoint()
        print(f"[asyncrl] final checkpoint (Hugging Face format in {ck / 'model'}), metrics in {run_dir / 'metrics.jsonl'}")
        if stream is not None and stream.steps:
            print(f"[asyncrl] stream: {stream.steps} steps in {stream.dir}, {stream.bytes_per_step() / 1e6:.3g} MB per step")
        _reward_errors_note(control, cfg.gen.error_reward)
        logger.close()
    return last


def _gen_device(train_device: str, rank: int, trainer_devices: int) -> str:
    """Generator r's device: the GPUs after the trainer's N, shared round-robin when too few."""
    if not train_device.startswith("cuda"):
        return "cpu"
    n = torch.cuda.device_count()
    return f"cuda:{(trainer_devices + rank) % n}"


def _start_generators(cfg, workers: Workers, link: Peers, group: OneRank, run_dir, store, buffer, control,
                      prompts, reward_fn, reward_factory, max_seq_len: int, stop_token_ids: tuple, prec):
    """This node's generators (and reward workers), watched for stalls; every process's pid in
    workers.json, for a debugger or py-spy (`py-spy dump --pid N`). Returns the reward the
    generators call: `reward_fn`, or the reward workers' client."""
    tc = cfg.train
    gens = link.local_generators(tc.n_generators)  # several nodes: dist.trainer_node_generators here
    n_rewards = tc.reward_workers if gens else 0  # several nodes: each node's generators, its own
    names = [f"reward{r}" for r in range(n_rewards)] + [f"generator{r}" for r in gens]
    hb = Heartbeats(names, run_dir / "stacks")  # liveness: common/runtime/watchdog.py
    workers.watch(hb, tc.stall_timeout, tc.stall_action)
    if n_rewards > 0:
        reward_fn = start_reward_workers(workers, hb, n_rewards, reward_factory, len(gens), cfg.gen.error_reward,
                                         first=gens[0])
    gen_control = link.generator_control(control)
    for r in gens:
        dev = _gen_device(tc.device, r - gens[0], tc.trainer_devices)
        workers.start(f"generator{r}", generator_main, r, cfg.gen, cfg.model, cfg.ref_model or cfg.model, store, buffer,
                      gen_control, prompts, reward_fn, cfg.seed, max_seq_len, tuple(stop_token_ids), dev, prec,
                      beat=hb.beat_for(f"generator{r}"), cuda_device=dev if dev.startswith("cuda") else None)
    record(run_dir / "workers.json")
    (run_dir / "workers.json").write_text(json.dumps({"trainer": os.getpid(), **group.pids(), **link.pids(),
                                                      **workers.pids()}) + "\n")
    return reward_fn


def _next_batch(algo: Algorithm, buffer: ReplayBuffer, step: int, version: int, sync: bool, bar: Progress,
                check: Callable[[], None]):
    """The algorithm's batch for `step`, waiting (and checking every process) until the buffer has it."""
    t0 = time.perf_counter()
    while True:
        batch = algo.next_batch(buffer, step, version, sync)
        if batch is not None:
            return batch
        if time.perf_counter() - t0 > 2:  # say what we wait for (not on short waits)
            bar.waiting(lambda: f"data for step {step + 1}: buffer {len(buffer)}, "
                                f"{buffer.stats()['n_unconsumed']} unconsumed")
        check()
        time.sleep(0.01)


def _reward_errors_note(control: Control, error_reward: float) -> int:
    """Print a warning with the run's count of rewards that raised (or were not finite) and were
    scored `error_reward`, if there were any (each process logged its first one's traceback)."""
    n = int(control.stats[:, Control.REWARD_ERRORS].sum().item())
    if n:
        print(f"[asyncrl] warning: {n} reward{'s' if n > 1 else ''} raised or were not finite and scored "
              f"gen.error_reward = {error_reward:g} (metrics.jsonl: reward_errors, the count so far at each step; "
              f"the first traceback of each process is in the log above)", file=sys.stderr, flush=True)
    return n
