"""What a run has and starts before its trainer loop (common/runtime/trainer.py): the run folder,
the precision (resolved once, saved as runs/<name>/precision.json), the trainer's model and the
weight store, the settings refused before any worker starts, the checkpoint to resume from, the
recorded stream and the peers (`prepare`); then, once the loop has its buffer and quota, this
node's generators and reward workers, watched for stalls (`start_generators`). Runs in the
launching process.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from common.contracts.batch import PromptSet
from common.contracts.run_files import record
from common.engine.machine.precision import resolve
from common.engine.model.lora import adapter_state
from common.runtime.files.checkpoint import latest_checkpoint
from common.runtime.files.checkpoint_dir import clean_checkpoints
from common.runtime.files.stream import StreamWriter
from common.runtime.generator import check_kv_pool, generator_main
from common.runtime.launch import Workers
from common.runtime.peers import Peers
from common.runtime.reward_service import start_reward_workers
from common.runtime.run_log import prepare_run_dir
from common.runtime.shared.weights import WeightStore
from common.runtime.step import OneRank, trainer_model
from common.runtime.watchdog import Heartbeats


@dataclass
class Prepared:
    """What a run has before any process starts: its folder, precision, model, weight store, the
    checkpoint it resumes from, its stream and the peers (module docstring)."""
    run_dir: Path
    prec: object
    model: torch.nn.Module
    tok: object
    max_seq_len: int
    store: WeightStore
    ck: Optional[Path]
    generation: dict
    stream: Optional[StreamWriter]
    pad_id: int
    link: Peers


def prepare(cfg, prompts: PromptSet, stop_token_ids: tuple, resume: bool, ranks: type[OneRank],
            peers: type[Peers]) -> Prepared:
    """The run folder, the precision (resolved, saved), the trainer's model and the weight store;
    settings refused before any worker starts; the checkpoint to resume from; the stream; the peers."""
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
    # in the generators' dtype; CUDA: shared with generators (and trainer ranks) via IPC. With LoRA the
    # adapters alone, in fp32 (a few MB: each generator folds them into its own copy of the base)
    ads = adapter_state(model)
    store = (WeightStore({n: (p.shape, torch.float32) for n, p in ads.items()}, device=model.device) if ads else
             WeightStore.from_module(model, device=model.device, dtype=prec.torch_dtype))
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
    return Prepared(run_dir, prec, model, tok, max_seq_len, store, ck, generation, stream, pad_id, link)


def _gen_device(train_device: str, rank: int, trainer_devices: int) -> str:
    """Generator r's device: the GPUs after the trainer's N, shared round-robin when too few."""
    if not train_device.startswith("cuda"):
        return "cpu"
    n = torch.cuda.device_count()
    return f"cuda:{(trainer_devices + rank) % n}"


def start_generators(cfg, workers: Workers, link: Peers, group: OneRank, run_dir, store, buffer, control,
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
                      beat=hb.beat_for(f"generator{r}"), cuda_device=dev if dev.startswith("cuda") else None,
                      lora=tc.lora if tc.lora.on else None)
    record(run_dir / "workers.json")
    (run_dir / "workers.json").write_text(json.dumps({"trainer": os.getpid(), **group.pids(), **link.pids(),
                                                      **workers.pids()}) + "\n")
    return reward_fn
