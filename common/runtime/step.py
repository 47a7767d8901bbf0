"""The trainer's model on one device: loading it, its optimizer, one trainer step's updates, and
`OneRank`, what the trainer loop calls for a step, a publish, the model to evaluate and a checkpoint.

Runs in the trainer process. The trainer as N ranks (`train.trainer_devices` > 1, or several
trainer nodes) is `TrainerGroup` (common/runtime/ranks/group.py), a subclass that does each of
these on every rank; its ranks run the same `update` (common/runtime/ranks/rank.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from common.contracts.algorithm import Algorithm
from common.contracts.batch import Batch
from common.contracts.micro import Ranks
from common.engine.checkpoints.peft_io import attach_lora
from common.engine.model.lora import adapter_state
from common.runtime.files.checkpoint import ResumeState, load_checkpoint, save_checkpoint
from common.runtime.launch import WorkerError


class RankFailed(WorkerError):
    """A trainer rank died, raised or hung (the message names it). Its shards are gone with it,
    so no checkpoint can be written: --resume continues from the last one. Raised by the
    trainer's ranks (common/runtime/ranks/); the trainer loop stops on it without a checkpoint."""


def trainer_model(prec, path: str, tc, device: str):
    """(model, tokenizer): the policy at `path` on `device` (`prec` loads it: fp32 master weights),
    in training mode with `train`'s activation checkpointing, block compilation, prompt sharing and
    row packing (`tc` settled by `check_config`)."""
    model, tok = prec.load(path, device=device, role="trainer", frozen=tc.lora.on)  # LoRA: the base in its compute dtype
    model.train()
    model.checkpoint_layers, model.compile_blocks = tc.activation_checkpointing, tc.compile_blocks
    model.share_prompts, model.pack_rows = tc.share_prompts, bool(tc.pack_rows)
    if tc.lora.on:
        with_lora(model, tc.lora)
    return model, tok


def with_lora(model, cfg) -> list[str]:
    """`model` training LoRA adapters (`cfg`: train.lora) instead of its weights: the base frozen in the
    dtype the trainer computes in (bf16 under bf16 autocast: half the fp32 master weights' memory, and
    no fp32 copy to cast each pass), the adapters in fp32, fresh or read from a PEFT folder."""
    if model.compute_dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(model.compute_dtype)  # tied weights are one Parameter: cast once
    names = attach_lora(model, cfg)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"[asyncrl] LoRA: {len(names)} projections, {n:,} trainable parameters "
          f"({n / sum(p.numel() for p in model.parameters()):.2%} of the model)")
    return names


def make_optimizer(model, lr: float, weight_decay: float, beta2: float = 0.95, eps: float = 1e-8) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters (its shards when sharded), betas (0.9, `beta2`)."""
    # fused: one pass over each parameter's weights, gradient and moments, on CUDA and on CPU
    # (where torch's default loops over parameters with several passes each: BENCHMARKS, AdamW)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone hold state
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, beta2), eps=eps, fused=True)


def update(algo: Algorithm, model, opt, batch: Batch, step: int, grad_clip: float,
           ranks: Ranks = Ranks()) -> tuple[dict, float]:
    """One trainer step's optimizer updates, one per minibatch (each of N ranks runs this on the
    same batch, `ranks` its `Share`); stats (and the grad norm) averaged over minibatches."""
    mbs = algo.minibatches(model, batch, step)
    totals: dict[str, float] = {}
    for mb in mbs:
        opt.zero_grad(set_to_none=True)
        st = algo.backward(model, mb, step)
        ranks.end_backward()  # N ranks: the short ranks' padding passes (and the flush), before the norm's all-reduce
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)  # global over shards
        opt.step()
        for k, v in {**st, "grad_norm": float(gnorm)}.items():
            totals[k] = totals.get(k, 0.0) + float(v) / len(mbs)
    totals["opt_steps"] = len(mbs)
    return totals, totals.pop("grad_norm")


class OneRank:
    """The trainer's model, optimizer and weight store on one device (module docstring). Use as a
    context manager; `opt` is the optimizer the loop's LR schedule drives."""

    @staticmethod
    def model_device(tc) -> str:
        """Where the trainer loads its model: `train.device`."""
        return tc.device

    def __init__(self, model, tc, prec, model_path: str, algo: Algorithm, store, run_dir, peers=None):
        # the arguments every kind of trainer takes: the N ranks build the same model in each rank
        # (model_path, prec) and report into run_dir; `peers` (common/runtime/peers.py) are the
        # other nodes, whose trainer ranks join theirs
        self.model, self.algo, self.store, self.device = model, algo, store, model.device
        self.opt = make_optimizer(model, tc.lr, tc.weight_decay, tc.adam_beta2, tc.adam_eps)
        self._published = adapter_state(model) or model  # LoRA: the adapters' parameters (the same objects throughout)

    def update(self, batch: Batch, step: int, lr: float, grad_clip: float) -> tuple[dict, float]:
        """One trainer step on `batch` (CPU); returns its (averaged) stats and grad norm. `lr`:
        the rate the loop's schedule set on `opt` (other ranks are told it)."""
        return update(self.algo, self.model, self.opt, batch.to(self.device), step, grad_clip)

    def publish(self, version: int) -> None:
        """The weights into the store, as `version` (common/runtime/shared/weights.py): with LoRA, the
        adapters alone (the generators fold them into their copy of the base)."""
        self.store.publish(self._published, version)

    def full_model(self):
        """The whole model on this device (an evaluation's)."""
        return self.model

    def save(self, run_dir, step: int, sched, **kw) -> Path:
        """`save_checkpoint` of the model, optimizer and `sched` (common/runtime/files/checkpoint.py)."""
        return save_checkpoint(run_dir, step, self.model, self.opt, sched, **kw)

    def load(self, path, sched, buffer_size: tuple[int, int] | None = None) -> ResumeState:
        """`load_checkpoint` into the model, optimizer and `sched`; a saved buffer must be `buffer_size`."""
        return load_checkpoint(path, self.model, self.opt, sched, buffer_size=buffer_size)

    def check(self) -> None:
        """Raise for a failed rank (call wherever the loop waits): one rank is this process."""

    def pids(self) -> dict[str, int]:
        """The processes of other ranks, by name (workers.json): none."""
        return {}

    def close(self, failed: bool = False) -> None:
        """Stop other ranks (every exit path): none."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(failed=exc_type is not None)
        return False
