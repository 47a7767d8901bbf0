"""Pure sampling functions and the request/result types of the sampler.

Per-row parameters (each slot of a continuous batch may belong to a different request):
temperature (B,), top_k (B,) with 0 = off, top_p (B,) with 1 = off. Greedy rows have T = 0.
Sampling is by inverse CDF: one uniform per row from one seeded generator against the
cumulative sum of exp(logits / T - max), taken in two levels (blocks, then inside one block);
reproducible for a fixed seed and schedule. (A Gumbel-max race would need B x V exponential
draws instead of B uniforms.) The temperature is applied before the lm_head, to its input
(`inv_temperature`), so `sample` receives logits / T_eff and makes three passes over (B, V):
max, exp, block sums; the log-normaliser comes from the same sums, instead of a (B, V) divide,
a full cumsum and a separate logsumexp (the saving is measured in BENCHMARKS.md, "Sampler").
Shapes: B rows, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.ops import logp_from_logits

BLOCK = 1024  # columns per block of the two-level inverse-CDF draw (`draw`)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256          # generated tokens per sample at most (finish "length")
    temperature: float = 1.0           # 0 = greedy; log-probs are recorded at T (or 1 if greedy)
    top_p: float = 1.0                 # nucleus sampling mass in (0, 1]; 1 = off
    top_k: int = 0                     # keep the k most likely tokens; 0 = off
    n: int = 1                         # samples per prompt (they share one prefill)
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop token ends the sample (finish "stop"), kept in tokens
    seed: int | None = None            # reseeds the sampler's generator in `generate`

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n}: need n >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: need >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: need 0 < top_p <= 1")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: need >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: need >= 1")


@dataclass
class Completion:
    """One finished sample. Per-token lists are aligned with `tokens`."""
    request_id: int
    sample_idx: int                    # 0..n-1 within its request
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)     # behaviour log-prob of each token
    versions: list[int] = field(default_factory=list)   # policy version that sampled each token
    finish_reason: str = ""            # "stop" | "length" | "interrupted"
    n_interrupts: int = 0              # weight updates applied while this sample was in flight

    def logp_tensor(self) -> torch.Tensor:
        return torch.tensor(self.logp, dtype=torch.float32)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. (B, V) -> (B, V)."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=logits.device).unsqueeze(0)
    drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
    probs = sorted_logits.softmax(-1)
    # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
    drop |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def inv_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """(B,) 1 / T_eff, with T_eff = T, or 1 for greedy rows (T = 0): the factor the sampler
    applies to the lm_head's *input*, so the head emits logits / T_eff with no (B, V) pass."""
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature)).reciprocal()


def block_sums(e: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(B, V) -> (B, ceil(V / block)): sums of consecutive blocks of `block` columns."""
    B, V = e.shape
    nb = V // block
    sums = e[:, :nb * block].view(B, nb, block).sum(-1)  # (B, nb)
    if V % block:
        sums = torch.cat((sums, e[:, nb * block:].sum(-1, keepdim=True)), dim=1)
    return sums


def draw(e: torch.Tensor, sums: torch.Tensor, generator: torch.Generator | None, block: int = BLOCK) -> torch.Tensor:
    """One index per row drawn with probability e / e.sum(-1) by inverse CDF, in two levels:
    pick a block from the cumsum of its block sums `sums` (from `block_sums`), then a column
    from the cumsum of that block only. (B, V), (B, nb) -> (B,). Two short cumsums instead of
    one over the whole vocabulary (an order of magnitude less work). A zero-probability column is never
    drawn: searchsorted(right=True) returns the first column whose cumulative mass exceeds u,
    and u is kept strictly below each level's total against rounding."""
    B, V = e.shape
    below = 1 - 2.0 ** -20
    cb = sums.cumsum(-1)                                              # (B, nb)
    u = torch.rand(B, 1, generator=generator, device=e.device) * cb[:, -1:]
    u = torch.minimum(u, cb[:, -1:] * below)
    j = torch.searchsorted(cb, u, right=True)                         # (B, 1) block index
    u = u - torch.where(j > 0, cb.gather(-1, (j - 1).clamp(min=0)), torch.zeros_like(u))  # mass left inside block j
    cols = j * block + torch.arange(block, device=e.device)            # (B, block)
    inside = e.gather(-1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0)
    c = inside.cumsum(-1)                                             # (B, block)
    u = torch.minimum(u, c[:, -1:] * below)
    k = torch.searchsorted(c, u, right=True)                          # (B, 1)
    return (j * block + k).squeeze(1)


def sample(scaled: torch.Tensor, greedy: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from `scaled` = logits / T_eff (B, V) (see `inv_temperature`).
    Greedy rows (B,) bool take the argmax. Returns tokens (B,) and their log-probs (B,) under
    softmax(scaled), i.e. before top-k / top-p truncation, via the shared `logp_from_logits`."""
    scaled = scaled.float()
    m = scaled.amax(-1, keepdim=True)                      # (B, 1)
    e = torch.sub(scaled, m).exp_()                        # (B, V) unnormalised probs
    sums = block_sums(e)                                   # (B, nb)
    lse = m.squeeze(1) + sums.sum(-1).log()                # logsumexp(scaled), reusing e
    if bool(((top_k > 0) | (top_p < 1)).any()):
        e = torch.sub(filter_logits(scaled, top_k, top_p), m).exp_()  # 0 outside the nucleus
        sums = block_sums(e)
    tokens = draw(e, sums, generator)
    if bool(greedy.any()):
        tokens = torch.where(greedy, scaled.argmax(-1), tokens)
    return tokens, logp_from_logits(scaled, tokens, 1.0, lse=lse)
