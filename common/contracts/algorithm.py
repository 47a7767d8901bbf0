"""The trainer's hook: what an algorithm (tba/algo.py, areal/algo.py) gives the trainer each step.

The trainer (`common/runtime/trainer.py`, the trainer process) calls down into an `Algorithm`;
an algorithm never calls the runtime. It sees the replay buffer only through `BufferView`, the
reading side the trainer hands it:

    buffer.sample_tba_batch(...)  TBA: a batch of K responses for each of P prompt slots, mixed
                                  from the latest sync round and the whole buffer; not consumed
    buffer.pop_oldest(...)        AReaL / on-policy: the n oldest unconsumed rows within a
                                  staleness bound, consumed once (None until n are there)
    buffer.capacity               ring size in rows

One trainer step = next_batch, then for each of minibatches(...): zero_grad, backward, clip,
optimizer step; then the LR scheduler steps once and weights are published every k steps.

The loss contract (`call_loss`, the same for TBA, GRPO and AReaL): a loss is a pure function
called once per micro-batch with the algorithm's positional arguments (TBA: seq_logp,
ref_seq_logp, reward, group_id, beta; GRPO: token_logp, behav_logp, loss_mask, advantages;
AReaL: logp, prox_logp, behav_logp, advantages, mask), then by keyword whatever else its
signature names out of the algorithm's settings (AReaL: eps_clip, eps_clip_high,
behav_imp_weight_cap; GRPO: eps_clip) and the micro-batch's fields (`Batch`'s: tokens,
loss_mask, comp_lens, prompt_lens, versions, ...; and `Batch.extra`'s, e.g. AReaL's prox_logp,
advantages). It returns the scalar loss, or (loss, stats) with stats a dict of scalars: every
one is logged (averaged over micro-batches, weighted as the loss), none is required.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Callable, Literal, Optional, Protocol

import torch

from common.contracts.batch import Batch

BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(Batch) if f.name != "extra")  # a loss may ask for these
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _plan(fn: Callable, n_args: int, settings, extra=None) -> tuple[list[str], list[str], bool]:
    """(settings fn takes, micro-batch fields it asks for, takes **kwargs). Raises ValueError
    naming fn and the parameter it cannot be given. extra=None: Batch.extra's keys not known yet."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable (no signature): given every setting
        return list(settings), [], True
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in _POSITIONAL]
    if len(positional) < n_args and not var_pos:
        raise ValueError(f"loss {name} takes {len(positional)} positional arguments, the algorithm passes {n_args} "
                         f"(common/contracts/algorithm.py: the loss contract)")
    wanted, fields = [], []
    for p in params[min(n_args, len(positional)):]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        if p.name in settings:
            wanted.append(p.name)
        elif p.name in BATCH_FIELDS or (extra is not None and p.name in extra):
            fields.append(p.name)
        elif p.default is p.empty and extra is not None:
            raise ValueError(f"loss {name} asks for {p.name!r}: not one of the algorithm's settings "
                             f"{tuple(settings)} nor a micro-batch field {BATCH_FIELDS + tuple(extra)}")
    return wanted, fields, any(p.kind is p.VAR_KEYWORD for p in params)


def check_loss(fn: Callable, n_args: int, settings=()) -> Callable:
    """Check at construction that `fn` can take the algorithm's `n_args` positional arguments;
    returns fn."""
    if not callable(fn):
        raise TypeError(f"loss_fn must be a function, got {type(fn).__name__}")
    _plan(fn, n_args, settings)
    return fn


def call_loss(fn: Callable, mb: Batch, *args, **settings) -> tuple[torch.Tensor, dict]:
    """fn(*args, **what it asks for) on micro-batch `mb` (module docstring); returns (loss,
    {stat: float}), checked: a scalar loss, scalar stats."""
    wanted, fields, var_kw = _plan(fn, len(args), settings, mb.extra)
    kw = dict(settings) if var_kw else {k: settings[k] for k in wanted}
    kw.update({f: mb.extra[f] if f in mb.extra else getattr(mb, f) for f in fields})
    out = fn(*args, **kw)
    loss, stats = out if isinstance(out, tuple) else (out, {})
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(f"loss {name} must return a scalar tensor (or (loss, stats)), got "
                         f"{tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__}")
    return loss.reshape(()), scalar_stats(stats or {}, name)


def scalar_stats(stats: dict, who: str = "loss") -> dict:
    """{key: float} of a loss's stats; a value that is not one number is an error naming it."""
    out = {}
    for k, v in stats.items():
        if torch.is_tensor(v) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy scalars too
            raise ValueError(f"{who}: stat {k!r} must be a scalar (float, int or one-element tensor), got "
                             f"{type(v).__name__}{tuple(v.shape) if torch.is_tensor(v) else ''}")
        out[k] = float(v)
    return out


def accumulate(totals: dict, weight: float, loss: torch.Tensor, stats: dict) -> None:
    """Add one micro-batch's loss and stats, weighted by its share of the (mini)batch."""
    for key, v in {"loss": loss.item(), **stats}.items():
        totals[key] = totals.get(key, 0.0) + weight * v


class BufferView(Protocol):
    """The replay buffer's members an algorithm may call (`common/runtime/shared/buffer.py` implements them)."""
    capacity: int

    def sample_tba_batch(self, n_groups: int, k: int, m: float, latest_version: int,
                         mode: Literal["uniform", "reward"] = "uniform", inv_temp: float = 1.0,
                         generator: torch.Generator | None = None, max_per_group: int = 100) -> Batch: ...

    def pop_oldest(self, n: int, max_staleness: int | None, current_version: int,
                   success: tuple[float, float] | None = None, group_size: int = 1) -> Batch | None: ...


class Algorithm:
    """What the trainer asks of an algorithm each step (subclassed by tba/algo.py, areal/algo.py)."""

    def next_batch(self, buffer: BufferView, step: int, version: int, sync: bool) -> Optional[Batch]:
        """Rows for this step, or None if the buffer cannot provide them yet."""
        raise NotImplementedError

    def minibatches(self, model, batch: Batch, step: int) -> list[Batch]:
        """The batches to make one optimizer step on each, in order; called once per step, before
        any update (AReaL computes its proximal log-probs here). Default: the whole batch once."""
        return [batch]

    def backward(self, model, batch: Batch, step: int) -> dict:
        """Accumulate gradients of one minibatch's loss into model; return scalar stats."""
        raise NotImplementedError
