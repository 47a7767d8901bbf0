"""What a run does before it loads a model: the devices it names checked against this machine,
`--random_weights` (every model the config names by hub id becomes a local random model of its
published shape) and `--print-memory` / the memory check (the plan of common/plan/memory_plan.py
against this machine's devices, from the configs alone).

Runs in the launching (trainer) process, from `task.setup`, before any worker starts, so workers
and reward workers only ever see local paths. The models a config names are its fields called
`model`, `ref_model` and `gold_model`, in any section (the policy and reference; TL;DR's reward and
gold models; red-teaming's victim and classifier). The memory plan counts the models the trainer and
the generators hold; reward models, victims and classifiers run in reward workers and are listed
with their weights only.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from common.plan import memory_fixes

from common.plan import memory_plan
from common.engine.checkpoints.hf_io import DEFAULT_MODEL, check_model, is_local, read_hf_config, resolve_checkpoint
from common.engine.checkpoints.shapes import SHAPES, cached_dir, hf_config, own_tokenizer, param_count, random_model_dir
from common.engine.checkpoints.tiny_model import TINY
from common.contracts.errors import UserError

MODEL_FIELDS = ("model", "ref_model", "gold_model")


class UnknownShape(UserError):
    """A model the plan needs is neither on disk nor in the shapes table (a hub id a run would fetch)."""

    def __init__(self, key: str, name: str):
        self.key, self.name = key, name
        super().__init__(f"memory plan: --{key}={name} is not on disk and has no published shape in "
                         f"common/engine/checkpoints/shapes.py; pass a local checkpoint, or --memory_check=false")


def fields_named(cfg, names: tuple, prefix: str = ""):
    """(dotted key, section object, field name, value) of every string field of a config, in any
    section, whose name is one of `names`."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from fields_named(v, names, f"{prefix}{f.name}.")
        elif f.name in names and isinstance(v, str):
            yield f"{prefix}{f.name}", cfg, f.name, v


def model_fields(cfg):
    """(dotted key, section object, field name, value) of every model a config names."""
    return fields_named(cfg, MODEL_FIELDS)


def check_devices(cfg) -> None:
    """Every device the config names, against this machine, before anything is built or loaded: a
    name torch cannot read, a kind other than cpu and cuda, a CUDA one where there is no GPU (a GPU
    preset on a CPU machine) or not that many GPUs: refused in one line naming what to change."""
    gpus, cuda = torch.cuda.device_count(), []
    for key, _, _, value in fields_named(cfg, ("device",)):
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError):
            raise UserError(f"--{key}={value}: not a device; use cpu, cuda or cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise UserError(f"--{key}={value}: runs take cpu or cuda devices only")
        if dev.type == "cuda":
            cuda.append(key)
            if gpus and dev.index is not None and dev.index >= gpus:
                raise UserError(f"--{key}={value}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}")
    if cuda and not gpus:
        why = "a torch built without CUDA" if not torch.backends.cuda.is_built() else "no GPU is visible"
        raise UserError(f"this machine has no CUDA GPU ({why}), and {', '.join('--' + k for k in cuda)} ask for one "
                        f"(the GPU presets set them); on the CPU instead: {' '.join(f'--{k}=cpu' for k in cuda)}")


def _hub_id(name: str) -> bool:
    """A name a run would fetch from the hub: in the shapes table, or owner/name and not local."""
    return name in SHAPES or (name.count("/") == 1 and ":" not in name and not is_local(name))


def use_random_weights(cfg) -> None:
    """Replace every hub id the config names by a random model of its published shape, built
    locally (common/engine/checkpoints/shapes.py). Refused in one line, before anything is built: a hub id
    without a table entry, and a guard scored by a verdict token of its own tokenizer when that
    tokenizer is not on disk (a random model takes SmolLM2's, which has no such verdict)."""
    todo = []
    for key, section, name, value in model_fields(cfg):
        if value in (DEFAULT_MODEL, TINY) or not _hub_id(value):
            continue  # offline already: the default model, tiny, a path, "offline", a classifier package
        if value not in SHAPES:
            raise UserError(f"--random_weights: --{key}={value} has no published shape in common/engine/checkpoints/shapes.py; "
                            f"add its config.json sizes to SHAPES, or pass a local checkpoint (--{key}=/path)")
        if getattr(section, "guard", False) and own_tokenizer(value) is None:
            sec = key.rsplit(".", 1)[0]
            raise UserError(f"--random_weights: --{key}={value} is a guard scored by P({section.label!r}) as its "
                            f"verdict token, a token of its own tokenizer, which is not on disk (a random model "
                            f"would take SmolLM2's); pass the guard by path (--{key}=/path), or another classifier "
                            f"(--{sec}.guard=false --{key}=profanity-check)")
        todo.append((section, name, value))
    for section, name, value in todo:
        setattr(section, name, str(random_model_dir(value)))


def model_config(name: str, key: str = "model") -> dict:
    """config.json of a model a run names: a local checkpoint's (the default model and tiny are
    built offline), the hub cache's, else the shapes table's; never a download."""
    if name in (DEFAULT_MODEL, TINY) or is_local(name):
        check_model(name, f"--{key}")  # a missing folder or file named with its setting
        return read_hf_config(resolve_checkpoint(name))
    d = cached_dir(name)
    if d is not None and (d / "config.json").is_file():
        return read_hf_config(d)
    if name in SHAPES:
        return hf_config(name)
    raise UnknownShape(key, name)


def _planned(key: str, value: str) -> bool:
    """A model the plan counts: not the policy's pair, not a package or a function."""
    return key not in ("model", "ref_model") and value not in ("offline", "profanity-check") and ":" not in value


def plan_of(cfg, gpus: list | None = None) -> memory_plan.Plan:
    """The memory plan of `cfg` (common/plan/memory_plan.py) from its models' configs; `gpus`:
    the GPUs' memory (None: this machine's, where it has CUDA)."""
    if gpus is None and cfg.train.device.startswith("cuda") and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    policy = model_config(cfg.model)
    ref = model_config(cfg.ref_model, "ref_model") if cfg.ref_model else policy
    others = {key: model_config(v, key) for key, _, _, v in model_fields(cfg) if _planned(key, v)}

    def planned(c):  # the plan of config c and, where it does not fit, what to change
        q = memory_plan.plan(c, policy, ref, others, gpus, param_count)
        memory_fixes.fixes(q, c)
        return q
    p = planned(cfg)
    if not p.fits:
        p.together = memory_fixes.together(cfg, p, planned)
    return p


def parse_gpus(value: str) -> list[int]:
    """`--print-memory=<GB>` or `<GB>x<N>`: N GPUs of that memory each (for a machine without them)."""
    gb_, _, n = value.lower().partition("x")
    try:
        size, count = float(gb_), int(n or 1)
    except ValueError:
        raise UserError(f"--print-memory={value}: expected <GB> or <GB>x<GPUs>, e.g. --print-memory=80 or 80x2") from None
    if not (size > 0 and count >= 1):
        raise UserError(f"--print-memory={value}: the GPU memory must be > 0 GB and the count >= 1")
    return [int(size * 1e9)] * count


def check_memory(cfg, show: bool = False, gpus: list | None = None) -> None:
    """`--print-memory`: print the plan and exit (0 when it fits or cannot be judged here, 2 when
    not). Otherwise, before a run loads anything: stop with one line naming what to change when the
    plan does not fit (what it cannot know is not judged: unknown GPU memory, as on a machine without
    CUDA, or a hub model not downloaded yet and not in the shapes table, which the run may fetch)."""
    try:
        p = plan_of(cfg, gpus)
    except UnknownShape as e:
        if show:
            raise
        print(f"[asyncrl] memory plan not checked: --{e.key}={e.name} is neither on disk nor in "
              f"common/engine/checkpoints/shapes.py (the run fetches it)", file=sys.stderr)
        return
    if show:
        if gpus and not cfg.train.device.startswith("cuda"):
            print(f"(the GPUs asked for are not planned: this run's trainer is on {cfg.train.device})")
        print(p.report())
        sys.exit(0 if p.fits else 2)
    if not p.fits:
        raise UserError(p.advice())
