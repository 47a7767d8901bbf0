"""Typed data contracts shared by every process: the prompts a task hands the runtime (`PromptSet`),
one response (`Trajectory`) and a padded training batch (`Batch`).

Alignment convention (used everywhere, established by `common.contracts.ops.token_logp`):
per-token arrays are *target-aligned* over the full sequence: `x[b, t]` describes token
`tokens[b, t]` (its log-prob given `tokens[b, :t]`, the version that sampled it). Position 0
and prompt positions carry no value (0 / -1) and are excluded by `loss_mask`.

Shapes: B = batch rows, T = padded prompt+completion length, Tc = completion length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FINISH_REASONS = ("stop", "length", "interrupted")


class Scored(float):
    """A reward with the reason it is what it is, for a reward that runs something that can fail
    (a program's tests): "timeout", "crashed" or "refused" (it did what it may not), counted in the
    run's metrics (`reward_timeouts`, `reward_crashes`, `reward_refused`); "" = no reason to count.
    A float everywhere else."""

    REASONS = ("timeout", "crashed", "refused")

    def __new__(cls, value: float, reason: str = ""):
        if reason and reason not in cls.REASONS:
            raise ValueError(f"Scored reason {reason!r}: expected one of {cls.REASONS}")
        x = super().__new__(cls, value)
        x.reason = reason
        return x

    def __reduce__(self):  # across processes (a reward worker's answer) with its reason
        return Scored, (float(self), self.reason)


@dataclass
class PromptSet:
    """Tokenised prompts plus whatever per-prompt data the reward needs (picklable): what a task
    gives `train` (common/train.py), which every generator draws its prompts from."""
    tokens: list[list[int]]
    meta: list = field(default_factory=list)  # e.g. gold answers; meta[i] goes to reward_fn

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("PromptSet is empty")
        if self.meta and len(self.meta) != len(self.tokens):
            raise ValueError(f"PromptSet: {len(self.tokens)} prompts but {len(self.meta)} meta entries")


@dataclass
class Trajectory:
    """One sampled response to one prompt, as written by a generator into the buffer."""
    prompt: torch.Tensor          # (Tp,) int64 prompt token ids
    completion: torch.Tensor      # (Tc,) int64 generated token ids (stop token included if hit)
    logp: torch.Tensor            # (Tc,) float32 behaviour log-prob of each generated token
    versions: torch.Tensor        # (Tc,) int64 policy version that sampled each token
    reward: float                 # scalar task reward
    group_id: int                 # prompt id: responses to the same prompt share it
    finish_reason: str = "stop"   # one of FINISH_REASONS
    ref_seq_logp: float = math.nan  # sum of reference-model token log-probs (NaN: not computed)

    def __post_init__(self):
        tc = self.completion.numel()
        if self.logp.numel() != tc or self.versions.numel() != tc:
            raise ValueError(f"Trajectory: completion has {tc} tokens but logp has {self.logp.numel()}"
                             f" and versions {self.versions.numel()}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Trajectory.finish_reason={self.finish_reason!r}, expected one of {FINISH_REASONS}")

    @property
    def seq_len(self) -> int:
        return self.prompt.numel() + self.completion.numel()


@dataclass
class Batch:
    """A right-padded training batch. Per-token fields are target-aligned (see module doc)."""
    tokens: torch.Tensor        # (B, T) int64 prompt + completion, right-padded with pad_id
    loss_mask: torch.Tensor     # (B, T) bool, True exactly on completion tokens
    behav_logp: torch.Tensor    # (B, T) float32 sampler log-prob of tokens[b, t]; 0 off-mask
    versions: torch.Tensor      # (B, T) int64 version that sampled tokens[b, t]; -1 off-mask
    reward: torch.Tensor        # (B,) float32
    group_id: torch.Tensor      # (B,) int64
    prompt_lens: torch.Tensor   # (B,) int64
    comp_lens: torch.Tensor     # (B,) int64
    ref_seq_logp: torch.Tensor  # (B,) float32, NaN where not computed
    extra: dict = field(default_factory=dict)  # (B, ...) tensors: "finish" (FINISH_REASONS index), the algorithm's own

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "Batch":
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items() if k != "extra"}
        return Batch(**moved, extra={k: v.to(device) for k, v in self.extra.items()})

    def select(self, idx) -> "Batch":
        """Rows `idx` (list or LongTensor), trimmed to their own max length."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        T = int((self.prompt_lens[idx] + self.comp_lens[idx]).max())
        def take(v):
            return v[idx, :T] if v.dim() == 2 else v[idx]
        return Batch(**{k: take(v) for k, v in self.__dict__.items() if k != "extra"},
                     extra={k: take(v) for k, v in self.extra.items()})


def collate(trajs: list[Trajectory], pad_id: int = 0) -> Batch:
    """Pad a list of trajectories into a `Batch` (target-aligned per-token fields)."""
    if not trajs:
        raise ValueError("collate: empty list of trajectories")
    B, T = len(trajs), max(t.seq_len for t in trajs)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float32)
    vers = torch.full((B, T), -1, dtype=torch.long)
    for b, t in enumerate(trajs):
        p, c = t.prompt.numel(), t.completion.numel()
        tokens[b, :p] = t.prompt
        tokens[b, p:p + c] = t.completion
        mask[b, p:p + c] = True
        logp[b, p:p + c] = t.logp.float()
        vers[b, p:p + c] = t.versions
    return Batch(
        tokens=tokens, loss_mask=mask, behav_logp=logp, versions=vers,
        reward=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        group_id=torch.tensor([t.group_id for t in trajs], dtype=torch.long),
        prompt_lens=torch.tensor([t.prompt.numel() for t in trajs], dtype=torch.long),
        comp_lens=torch.tensor([t.completion.numel() for t in trajs], dtype=torch.long),
        ref_seq_logp=torch.tensor([t.ref_seq_logp for t in trajs], dtype=torch.float32),
        extra={"finish": torch.tensor([FINISH_REASONS.index(t.finish_reason) for t in trajs], dtype=torch.long)},
    )
