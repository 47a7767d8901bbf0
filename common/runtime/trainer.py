"""The trainer loop, shared by every algorithm and task; runs in the launching process.

    publish v0 -> start generators -> [wait for data] -> algo.next_batch
    -> for each of algo.minibatches(...): algo.backward -> clip + optimizer step
    -> LR schedule step -> [auto: eta from the step's measures] -> publish every k steps
    -> log / eval / checkpoint -> ...

Everything algorithm-specific sits behind `Algorithm` (common/contracts/algorithm.py; tba/algo.py, areal/algo.py): which rows
form a batch, how a step splits into optimizer updates (TBA: one; AReaL: PPO minibatches),
and the loss. The trainer owns the model, the optimizer, the `WeightStore` (it
is its only writer), the `Control` quota (only writer of version/quota) and the buffer's
reading side. Synchronous mode (`train.mode=sync`) is the same code with max_staleness = 0 and
k = 1 (`check_config`): generators may start exactly one batch of prompts per published version,
and the trainer consumes exactly that batch, so sync and async runs do equal work per step.

`run_trainer` reads as the run: `prepare` (common/runtime/trainer_start.py: the folder, the
precision, the model and weight store, what to resume from, the peers), then `Loop.start` (resume,
the log, the first publish, the generators), `Loop.train` (the loop itself), `Loop.stopping` (how a
failure ends it, after a checkpoint where the state is whole) and `Loop.finish` (the last
evaluation and checkpoint).

The loop talks to two objects the entry (common/train.py, `train`) picks and that do nothing
special on one device: `ranks`, the model and its optimizer (`OneRank`, common/runtime/step.py;
N sharded ranks: `TrainerGroup`, common/runtime/ranks/group.py, this process being rank 0 and the
coordinator that alone draws batches, logs, evaluates and checkpoints), and `peers`, the other
nodes (`Peers`, common/runtime/peers.py: none; under torchrun `TrainerLink`,
common/runtime/nodes/link.py).

A run config needs: name, run_root, model, ref_model, seed, and sections train (TrainConfig), gen
(GenConfig), log (LogConfig), precision (PrecisionConfig); TrainConfig and LogConfig live in
`train_config.py`.

Precision (`common/engine/machine/precision.py`): resolved once (measured per machine when `auto`),
printed, saved as runs/<name>/precision.json and handed to the generators. bf16 keeps the
model and AdamW state in fp32 and runs forward passes under autocast; the weight store holds
the generators' dtype, so `publish` casts while it copies.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from common.contracts.algorithm import Algorithm
from common.contracts.batch import PromptSet
from common.contracts.config import to_dict
from common.contracts.log import MetricsLogger
from common.contracts.mismatch import same_weights
from common.contracts.progress import Progress
from common.runtime.generator import Control
from common.runtime.launch import WorkerError, Workers
from common.runtime.peers import Peers
from common.runtime.process import sigterm_as_interrupt
from common.runtime.run_log import evaluate_now, staleness, step_line, step_row
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.staleness_control import StalenessBound
from common.runtime.step import OneRank, RankFailed
from common.runtime.train_config import lr_lambda
from common.runtime.trainer_start import Prepared, prepare, start_generators
from common.runtime.watchdog import WorkerStalled


def run_trainer(cfg, algo: Algorithm, prompts: PromptSet, reward_fn, stop_token_ids: tuple,
                evaluate: Optional[Callable], resume: bool, reward_factory: Optional[Callable],
                ranks: type[OneRank] = OneRank, peers: type[Peers] = Peers) -> dict:
    """Run a full training job in this process; returns the last logged metrics (module docstring).
    Called by the entry (common/train.py: `train`, which documents the arguments), with `cfg.train`
    checked, inside `process.trainer_process`."""
    p = prepare(cfg, prompts, stop_token_ids, resume, ranks, peers)
    # SIGTERM (torchrun, Slurm, kill) = Ctrl-C: checkpoint, then stop. N ranks: spawned here, and
    # `model` sharded in place (the optimizer holds shards); generators and reward workers are
    # `workers`, stopped before the final evaluation and checkpoint
    with (sigterm_as_interrupt(), p.link, ranks(p.model, cfg.train, p.prec, cfg.model, algo, p.store, p.run_dir,
                                                p.link) as group, Workers() as workers):
        loop = Loop(cfg, algo, p, group, workers, evaluate, resume)
        loop.start(prompts, reward_fn, reward_factory, stop_token_ids)
        with loop.stopping():
            loop.train()
        return loop.finish()


class Loop:
    """One run's trainer loop (module docstring): `start` resumes, opens the log, publishes the
    first weights and starts the generators; `train` is the loop; `stopping` says how a failure
    ended it, after a checkpoint where the state is whole; `finish` is the last evaluation and
    checkpoint."""

    def __init__(self, cfg, algo: Algorithm, p: Prepared, group: OneRank, workers: Workers,
                 evaluate: Optional[Callable], resume: bool):
        self.cfg, self.tc, self.algo, self.p, self.group, self.workers = cfg, cfg.train, algo, p, group, workers
        self.evaluate, self.resume, self.link, self.stream = evaluate, resume, p.link, p.stream
        self.sched = torch.optim.lr_scheduler.LambdaLR(group.opt, lr_lambda(self.tc))
        self.step = self.version = 0
        self.last: dict = {}

    def start(self, prompts, reward_fn, reward_factory, stop_token_ids) -> None:
        cfg, tc, p, group = self.cfg, self.tc, self.p, self.group
        buffer, counters = None, {}
        if p.ck is not None:
            st = group.load(p.ck, self.sched, buffer_size=(tc.buffer_capacity, p.max_seq_len))  # other sizes refused
            self.step, self.version, buffer, counters = st.step, st.version, st.buffer, st.counters
            print(f"[asyncrl] resumed from {p.ck} at step {self.step}, version {self.version}")
        self.buffer = buffer if buffer is not None else ReplayBuffer(tc.buffer_capacity, p.max_seq_len, pad_id=p.pad_id)
        self.logger = MetricsLogger(p.run_dir, use_tensorboard=cfg.log.tensorboard, use_wandb=cfg.log.wandb,
                                    wandb_project=cfg.log.wandb_project,
                                    config={**to_dict(cfg), "precision_resolved": p.prec.to_dict()},
                                    keep_to=self.step if self.resume else None)
        self.logger.log(self.step, precision=p.prec.to_dict())  # the choice, with what decided it, in the metrics too
        group.publish(self.version)
        self.per_version = tc.prompts_per_step * tc.sync_every
        # eta: fixed, or set each step from the run's measures (auto; its state from the checkpoint)
        self.bound = StalenessBound(tc, counters)
        self.control = self.link.control(self.workers.ctx, self.buffer, self.per_version, self.bound.eta,
                                         tc.n_generators)
        self.link.publish(self.version)  # before the quota opens
        # AReaL on resume: accepted = v x B, plus the groups the restored buffer holds untrained
        # (they were admitted too; counting them keeps the bound; TBA never consumes, is unbounded)
        pending = self.buffer.stats()["n_unconsumed"] // cfg.gen.n if tc.max_staleness is not None else 0
        self.control.set_version(self.version, started=self.version * self.per_version + pending)
        if self.step == 0:
            self.run_eval("before")
        # the reward workers' client: held while the workers live (they share its queues and locks)
        self.reward_fn = start_generators(cfg, self.workers, self.link, group, p.run_dir, p.store, self.buffer,
                                           self.control, prompts, reward_fn, reward_factory, p.max_seq_len,
                                           stop_token_ids, p.prec)
        self.bar = Progress(tc.steps, initial=self.step, desc=f"{cfg.name} ({tc.mode})")

    def places_back(self, force: bool = False) -> None:
        """The quota at the current version, the groups dropped so far (too stale, or by AReaL's
        success-rate filter) giving their places back: at each publish, and while the loop waits for
        a batch (a filter may drop every group the quota admitted: without their places no batch
        could ever fill)."""
        dropped = (self.buffer.n_dropped_stale + self.buffer.n_filtered) // self.cfg.gen.n
        if force or dropped != getattr(self, "_dropped", 0):
            self._dropped = dropped
            self.control.set_version(self.version, dropped=dropped)

    def train(self) -> None:
        """The loop: take a batch, update, publish every k steps, log, evaluate and checkpoint."""
        tc, group, buffer, control = self.tc, self.group, self.buffer, self.control
        if tc.mode == "async":
            self.workers.wait_event(lambda: group.check() or self.link.check() or self.bar.waiting(
                lambda: f"first batch: buffer {len(buffer)}/{tc.min_buffer}") or len(buffer) >= tc.min_buffer,
                timeout=math.inf)
        gen_prev = (control.stats[:, Control.TOKENS].sum().item(), time.perf_counter())
        while self.step < tc.steps:
            t0 = time.perf_counter()
            batch = _next_batch(self.algo, buffer, self.step, self.version, tc.mode == "sync", self.bar,
                                lambda: self.places_back() or self.check())
            t1 = time.perf_counter()
            stale, multi_version = staleness(batch, self.version)  # versions behind the weights that train on it
            rec = self.stream.capture(batch) if self.stream is not None else None  # before the update: as drawn
            # the tokens the weights held here sampled: the algorithm measures the sampler-trainer mismatch on them
            batch.extra["same_weights"] = same_weights(batch.versions, batch.loss_mask,
                                                       self.version if self.step % tc.sync_every == 0 else None)
            lr = group.opt.param_groups[0]["lr"]  # the schedule's, x auto's ESS factor with train.lr_by_ess
            stats, gnorm = group.update(batch, self.step, lr, tc.grad_clip)
            if self.stream is not None:  # record_bytes, record_s into the metrics
                stats.update(self.stream.write(self.step + 1, self.version, lr, rec, {**stats, "grad_norm": gnorm}))
            self.sched.step()  # once per trainer step, however many minibatch updates it made
            self.step += 1
            t2 = time.perf_counter()
            stats.update(self.bound.after_step(stats, t1 - t0, t2 - t1, control, group.opt))  # auto: eta, lr scale
            publish_s = 0.0
            try:  # the step is done: its row is logged even when a publish or a check below raises
                if self.step % tc.sync_every == 0:
                    self.version += 1
                    group.publish(self.version)
                    self.link.publish(self.version)  # other nodes have it before the quota moves
                    self.places_back(force=True)  # the new version's quota
                    publish_s = time.perf_counter() - t2
                self.check()
            finally:
                self.last, gen_prev = step_row(batch, stats, gnorm, group.opt.param_groups[0]["lr"], (t0, t1, t2),
                                               publish_s, self.version, stale, multi_version, control, buffer, gen_prev)
                self.logger.log(self.step, **self.last)
            self.bar.update(1, **step_line(self.last, self.bound.moved))
            if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps:
                self.last.update(self.run_eval("periodic"))
            if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < tc.steps:
                self.checkpoint()

    def checkpoint(self) -> Path:
        """The current step, everything needed to resume."""
        p = self.p
        if self.stream is not None:
            self.stream.sync()  # a checkpoint never claims steps its stream lacks
        return self.group.save(p.run_dir, self.step, self.sched, counters={"version": self.version,
                                                                           **self.bound.counters()},
                               config=self.cfg, buffer=self.buffer, tokenizer=p.tok,
                               keep_last=self.tc.keep_checkpoints, generation=p.generation)

    def run_eval(self, tag: str) -> dict:
        return evaluate_now(self.evaluate, self.group, self.p.prec, self.p.tok, self.logger, self.cfg, self.step, tag)

    def check(self) -> None:
        """Every process of the run, wherever this one waits."""
        self.workers.check()
        self.group.check()
        self.link.check()

    @contextmanager
    def stopping(self):
        """The loop's end by a failure, said once with what was saved, then raised on."""
        try:
            yield
        except RankFailed:  # a trainer rank: its shards went with it, nothing whole is left to save
            self._stopped()
            print(f"\n[asyncrl] stopped at step {self.step}: a trainer rank failed; no checkpoint (its shards are "
                  f"lost); fix the cause, then continue with --resume from the last one", file=sys.stderr)
            raise
        except (WorkerStalled, WorkerError) as e:  # a hung (reported with its stack) or dead worker:
            self._stopped()  # the trainer's own state is whole (checks run between updates): keep it, stop non-zero
            what = "is hung" if isinstance(e, WorkerStalled) else "failed"
            print(f"\n[asyncrl] stopped at step {self.step}: a worker {what}; checkpoint {self.checkpoint()}; "
                  f"fix the cause, then continue with --resume", file=sys.stderr)
            raise
        except KeyboardInterrupt as e:  # nothing lost: save the last completed step, then stop
            # (a Ctrl-C inside opt.step(), ~1% of a CPU step, saves a half-applied update: still
            # a valid model, one partial step off)
            self._stopped()
            ck = self.checkpoint()
            print(f"\n[asyncrl] interrupted (Ctrl-C or SIGTERM) at step {self.step}: checkpoint {ck}; continue with "
                  f"--resume")
            e.reported = True  # that line ends the run: task scripts print no traceback after it
            raise

    def _stopped(self) -> None:
        self.bar.close()
        _reward_errors_note(self.control, self.cfg.gen.error_reward)

    def finish(self) -> dict:
        """Generators stopped, the last evaluation and checkpoint; the last metrics."""
        self.bar.close()
        self.workers.shutdown()  # generators stop; the trainer ranks stay for the last evaluation and checkpoint
        self.link.stop()  # and those of other nodes
        print(f"[asyncrl] tokens per generator: {self.control.stats[:, Control.TOKENS].long().tolist()}")
        if self.p.store.device.type == "cuda":
            torch.cuda.ipc_collect()  # the generators have released the store: free what they held
        self.last.update(self.run_eval("after"))
        ck = self.checkpoint()
        where = ck / "model" if (ck / "model").is_dir() else ck / "adapter"  # LoRA: a PEFT adapter by default
        print(f"[asyncrl] final checkpoint (Hugging Face format in {where}), metrics in "
              f"{self.p.run_dir / 'metrics.jsonl'}")
        if self.stream is not None and self.stream.steps:
            print(f"[asyncrl] stream: {self.stream.steps} steps in {self.stream.dir}, "
                  f"{self.stream.bytes_per_step() / 1e6:.3g} MB per step")
        _reward_errors_note(self.control, self.cfg.gen.error_reward)
        self.logger.close()
        return self.last


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
