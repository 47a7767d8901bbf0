"""The entry of a training run: `train` settles the config, picks this process's role, the trainer's
ranks and its peers, and runs the trainer loop (common/runtime/trainer.py). Runs in the launching
process.

One node, one device: the core alone (common/runtime/: `OneRank`, `Peers`). `train.trainer_devices`
> 1: the trainer as N sharded ranks (common/runtime/ranks/: `TrainerGroup`). Under torchrun, one
node of several (common/runtime/nodes/): a generator node or a trainer node after the first runs
its own loop instead; the first trainer node runs the trainer with `TrainerLink` as its peers.
"""
from __future__ import annotations

from typing import Callable, Optional

from common.contracts.algorithm import Algorithm
from common.contracts.batch import PromptSet
from common.contracts.config_check import check
from common.runtime.nodes.generator_node import generator_node
from common.runtime.nodes.link import TrainerLink
from common.runtime.nodes.trainer_node import trainer_node
from common.runtime.nodes.world import checked, is_generator_node, is_trainer_member_node, join, restarted
from common.runtime.peers import Peers
from common.runtime.pickling import check_sendable
from common.runtime.process import trainer_process
from common.runtime.ranks.group import TrainerGroup
from common.runtime.step import OneRank
from common.runtime.train_config import DistConfig, check_config, torchrun_restarts, under_torchrun
from common.runtime.trainer import run_trainer


def train(cfg, algo: Algorithm, prompts: PromptSet, reward_fn, stop_token_ids: tuple,
          evaluate: Optional[Callable] = None, resume: bool = False, reward_factory: Optional[Callable] = None) -> dict:
    """Run a full training job; returns the last logged metrics ({} on a node that does not log).

    reward_fn(text, meta) -> float runs inside the generators. For expensive rewards set
    train.reward_workers > 0 and pass `reward_factory`, a function (sent by value, may be a notebook's) that builds
    fn(texts, metas) -> list[float] once per reward worker (common/runtime/reward_service.py).
    evaluate(model, tokenizer) -> {metric: value} runs before, every train.eval_every steps and after.
    The trainer runs in the calling process with ASYNCRL_NUM_THREADS CPU threads (default 1, as
    every worker; the caller's count is restored after): `process.trainer_process`."""
    check(cfg)  # every setting in range before anything starts (a config built in Python too)
    with trainer_process(cfg.train.device):
        tc = check_config(cfg.train)
        if tc.reward_workers > 0 and reward_factory is None:
            raise ValueError("train.reward_workers > 0 needs train(..., reward_factory=...)")
        # what reaches worker processes (by value: common/runtime/pickling.py) is refused here, naming it
        check_sendable(reward_fn=None if tc.reward_workers else reward_fn,
                       reward_factory=reward_factory if tc.reward_workers else None,
                       algorithm=algo if tc.trainer_devices > 1 else None)
        nodes, peers, restarts = 1, Peers, torchrun_restarts()
        if under_torchrun():  # one node of several: its role comes from the world (common/runtime/nodes/)
            checked(cfg, tc)  # the world's settings, the secret, the store's address: before any folder or socket
            if is_generator_node(cfg):  # generates, trains nothing, logs nothing
                return generator_node(join(cfg, tc), cfg, prompts, reward_fn, stop_token_ids, reward_factory)
            if is_trainer_member_node(cfg):  # a trainer node after the first: its trainer ranks
                return trainer_node(cfg)
            nodes = (getattr(cfg, "dist", None) or DistConfig()).trainer_nodes
            peers, restarts = TrainerLink, restarted()  # restarts counted across the nodes
        if restarts and not resume:  # torchrun --max-restarts brought the job back up after a failure
            print(f"[asyncrl] torchrun restart {restarts}: continuing from the last checkpoint")
            resume = True
        return run_trainer(cfg, algo, prompts, reward_fn, stop_token_ids, evaluate, resume, reward_factory,
                           trainer_ranks(tc, nodes), peers)


def trainer_ranks(tc, nodes: int = 1) -> type[OneRank]:
    """The trainer's model and optimizer for `train.trainer_devices` ranks on each of `nodes` trainer
    nodes: one rank (common/runtime/step.py), or N sharded ones (common/runtime/ranks/group.py)."""
    return TrainerGroup if tc.trainer_devices * nodes > 1 else OneRank


def logs_here(cfg) -> bool:
    """Whether this process logs and plots the run: the trainer's (on one node always; under
    torchrun the first trainer node's, not a generator node's or another trainer node's)."""
    return not (under_torchrun() and (is_generator_node(cfg) or is_trainer_member_node(cfg)))
