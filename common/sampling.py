"""Pure sampling functions and the request/result types of the sampler.

Per-row parameters (each slot of a continuous batch may belong to a different request):
temperature (B,), top_k (B,) with 0 = off, top_p (B,) with 1 = off. Greedy rows have T = 0.
Sampling is by inverse CDF: one uniform per row from one seeded generator against the
cumulative sum of exp(logits / T - max); reproducible for a fixed seed and schedule. (A
Gumbel-max race needs B x V exponential draws: 2.5x slower at B=64, V=49152 on CPU.)
Shapes: B rows, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.ops import logp_from_logits


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


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns tokens (B,) and their log-probs (B,) under
    softmax(logits / T) (T = 1 for greedy rows), via the shared `logp_from_logits`."""
    logits = logits.float()
    greedy = temperature <= 0
    t_eff = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)  # (B, 1)
    scaled = logits / t_eff
    if bool(((top_k > 0) | (top_p < 1)).any()):
        scaled = filter_logits(scaled, top_k, top_p)
    e = (scaled - scaled.amax(-1, keepdim=True)).exp_()  # (B, V) unnormalised probs
    cdf = e.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return tokens, logp_from_logits(logits, tokens, t_eff)
