"""LoRA adapters on the decoder's projections (Hu et al. 2021), computed as PEFT computes them:

    y = x W^T + b + (alpha / r) (dropout(x) A^T) B^T        A: (r, K), B: (N, r), B = 0 at the start

so a model with fresh adapters is its base. `add_lora` hangs an `Adapter` on each targeted
`Linear` (common/engine/model/linear.py calls it); the base's parameters are frozen and only A and
B train. Targets are module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj:
our names for every family, hf_layouts.py maps the fused ones) or roles: `attn`, `mlp`, `all`.

Runs in the trainer (forward and backward with the adapters; `adapters_off` is the base, the
reference), in the evaluation (`merged`: the adapters folded into the weights for as long as the
sampler needs them, the weights restored exactly after) and in generators (`Merger`: each published
A and B folded into a copy of the base, W0 + (alpha / r) B A, so the sampler's decode step, which
reads the weights directly, runs unchanged; `pristine` swaps W0 back for a reference pass).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.contracts.config_check import Rule, above, at_least, between
from common.engine.model.linear import Linear, linear

ROLES = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
ROLES["all"] = ROLES["attn"] + ROLES["mlp"]
PREFIX = ".lora."  # an adapter's parameters: <module>.lora.A, <module>.lora.B


@dataclass
class LoRAConfig:
    rank: int = 0                     # adapters' rank r; 0 = no adapters (full fine-tuning)
    alpha: float = 32.0               # the update is scaled by alpha / r
    dropout: float = 0.0              # dropout on the adapters' input (training only)
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # projections by name, or roles: attn, mlp, all (PEFT's default: q, v)
    init: str = ""                    # a PEFT adapter folder to start from (its rank, alpha and targets); "" = fresh
    export: Literal["adapter", "merged", "both"] = "adapter"  # checkpoints' model/: the adapter (PEFT's files), the merged model, or both

    CHECKS = {"rank": at_least(0), "alpha": above(0), "dropout": between(0, 1, open_hi=True),
              "targets": Rule(lambda v, s: bool(v) and all(t in ROLES or t in ROLES["all"] for t in v),
                              f"projections ({', '.join(ROLES['all'])}) or roles ({', '.join(ROLES)})")}

    @property
    def on(self) -> bool:
        """Whether the run trains adapters (a rank, or an adapter to start from)."""
        return self.rank > 0 or bool(self.init)


def target_names(targets) -> tuple[str, ...]:
    """Module names from names and roles, in a fixed order; an unknown one is a ValueError."""
    out: list[str] = []
    for t in targets:
        names = ROLES.get(t, (t,))
        for n in names:
            if n not in ROLES["all"]:
                raise ValueError(f"train.lora.targets: {t!r} is neither a projection ({', '.join(ROLES['all'])}) "
                                 f"nor a role ({', '.join(ROLES)})")
            if n not in out:
                out.append(n)
    return tuple(n for n in ROLES["all"] if n in out)


class Adapter(nn.Module):
    """A and B of one projection (module docstring); `enabled` False makes it a holder only."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # PEFT's init of A (B = 0: the base at start)
        self.rank, self.alpha, self.scale, self.p = rank, alpha, alpha / rank, dropout
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p and self.training:
            x = F.dropout(x, self.p)
        A, B = self.A, self.B
        if x.dtype != A.dtype and not torch.is_autocast_enabled(x.device.type):  # autocast casts them itself
            A, B = A.to(x.dtype), B.to(x.dtype)
        return linear(linear(x, A), B) * self.scale  # (..., K) -> (..., r) -> (..., N)

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """(alpha / r) B A in fp32, the update to W."""
        return (self.B.float() @ self.A.float()) * self.scale


def adapters(model: nn.Module) -> dict[str, tuple[Linear, Adapter]]:
    """Module name -> (the projection, its adapter), in the model's order."""
    return {n: (m, m._modules["lora"]) for n, m in model.named_modules()
            if isinstance(m, Linear) and m._modules.get("lora") is not None}


def add_lora(model: nn.Module, cfg: LoRAConfig, freeze: bool = True) -> list[str]:
    """Adapters of rank `cfg.rank` on every targeted projection (fp32, on the weights' device); with
    `freeze` every other parameter stops taking gradients. Returns the adapted modules' names."""
    if cfg.rank < 1:
        raise ValueError(f"train.lora.rank={cfg.rank}: adapters need rank >= 1")
    wanted = set(target_names(cfg.targets))
    names = []
    for n, m in model.named_modules():
        if isinstance(m, Linear) and n.rsplit(".", 1)[-1] in wanted and m._modules.get("lora") is None:
            m.lora = Adapter(m.in_features, m.out_features, cfg.rank, cfg.alpha, cfg.dropout).to(m.weight.device)
            names.append(n)
    if not names:
        raise ValueError(f"train.lora.targets={list(cfg.targets)}: no projection of this model has those names")
    attached(model, freeze)
    return names


def attached(model: nn.Module, freeze: bool) -> None:
    """After adapters were hung on `model`: MLPs with one run unfused (the fused path reads the
    weights alone), and with `freeze` only the adapters take gradients."""
    for mlp in (m for m in model.modules() if hasattr(m, "up_proj")):
        mlp.unfused = any(getattr(mlp, k, None) is not None and getattr(mlp, k)._modules.get("lora") is not None
                          for k in ("gate_proj", "up_proj", "down_proj"))
    if freeze:
        for pn, p in model.named_parameters():
            p.requires_grad_(PREFIX in pn)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by name (`<module>.lora.A`, `.B`): what a publish moves."""
    return {n: p for n, p in model.named_parameters() if PREFIX in n}


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model (the reference): every adapter skipped inside the block."""
    ads = [a for _, a in adapters(model).values()]
    was = [a.enabled for a in ads]
    for a in ads:
        a.enabled = False
    try:
        yield model
    finally:
        for a, w in zip(ads, was):
            a.enabled = w


@contextlib.contextmanager
@torch.no_grad()
def merged(model: nn.Module):
    """The adapters folded into the weights (W + (alpha / r) B A) and skipped, for code that reads
    the weights directly (the sampler's decode step); the weights restored bit for bit after."""
    kept = []
    for m, a in adapters(model).values():
        if a.enabled:
            kept.append((m, a, m.weight.detach().clone()))
            m.weight.data.copy_((m.weight.float() + a.delta()).to(m.weight.dtype))
            a.enabled = False
    try:
        yield model
    finally:
        for m, a, w in kept:
            m.weight.data.copy_(w)
            a.enabled = True


@dataclass
class Merger:
    """A generator's adapters (attached to `model` already, as the trainer's are: peft_io.attach_lora):
    the base's targeted weights kept as loaded (W0), the published A and B read into the adapters,
    which stay disabled (the weights carry them), and folded into the weights."""
    model: nn.Module
    base: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self._jobs = []
        for n, (m, a) in adapters(self.model).items():
            a.enabled = False
            # A and B in the weights' dtype (a load casts into them): the merge is one addmm, whose
            # accumulation is fp32 inside, rounded once into the weight
            a.A.data, a.B.data = a.A.data.to(m.weight.dtype), a.B.data.to(m.weight.dtype)
            self.base[n] = m.weight.detach().clone()
            self._jobs.append((self.base[n], a.B, a.A, a.scale, m.weight.data))

    @torch.no_grad()
    def merge(self) -> None:
        """W = W0 + (alpha / r) B A for every adapted projection (after the adapters were loaded)."""
        for w0, B, A, scale, w in self._jobs:
            torch.addmm(w0, B, A, alpha=scale, out=w)

    @contextlib.contextmanager
    @torch.no_grad()
    def pristine(self):
        """The base's weights inside the block (a reference pass), the merged ones back after."""
        for w0, _, _, _, w in self._jobs:
            w.copy_(w0)
        try:
            yield self.model
        finally:
            self.merge()
