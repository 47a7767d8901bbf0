"""Pure sampling functions, the sampler's random numbers, and its request/result types.

Per-row parameters (each slot of a continuous batch may belong to a different request):
temperature (B,), top_k (B,) with 0 = off, top_p (B,) with 1 = off. Greedy rows have T = 0.
Sampling is by inverse CDF: one uniform per row against the cumulative sum of
exp(logits / T - max), taken in two levels (blocks, then inside one block). (A Gumbel-max race
would need B x V exponential draws instead of B uniforms.) The temperature divides the fp32
logits (`scale_logits`), exactly as the trainer's head does (`common/engine/model/head.py`), so the
recorded log-probs are the trainer's at the same T whatever the model dtype (a bf16 1/T would
sample at a slightly different temperature); `sample` then makes three passes over (B, V): max,
exp, block sums, and the log-normaliser comes from the same sums instead of a full cumsum and a
separate logsumexp (BENCHMARKS.md, "Sampler").

Random numbers are counter-based (`uniforms`): the uniform for token t of sample j of request r
is a hash of (seed, r, j, t), computed with 32-bit integer arithmetic on the device. So a
sample does not depend on which slot it got or what else was in the batch, the same seed gives
the same tokens on CPU and CUDA, and a captured CUDA graph needs no generator state. Nothing
here reads a tensor back to the host: the caller says whether any row is greedy or filtered.
Shapes: B rows, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.contracts.ops import logp_from_logits

BLOCK = 1024  # columns per block of the two-level inverse-CDF draw (`draw`)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256          # generated tokens per sample at most (finish "length")
    temperature: float = 1.0           # 0 = greedy; log-probs are recorded at T (or 1 if greedy)
    top_p: float = 1.0                 # nucleus sampling mass in (0, 1]; 1 = off
    top_k: int = 0                     # keep the k most likely tokens; 0 = off
    n: int = 1                         # samples per prompt (they share one prefill)
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop token ends the sample (finish "stop"), kept in tokens
    seed: int | None = None            # the sampler's seed for this `generate` call (None: keep its own)

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
    n_preemptions: int = 0             # times its KV pages were taken back and its tokens re-prefilled

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


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """(B,) fp32 T_eff: T, or 1 for greedy rows (T = 0), the temperature log-probs are taken at
    (`common.contracts.ops.logp_temperature`)."""
    temperature = temperature.float()
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def scale_logits(logits: torch.Tensor, t_eff: torch.Tensor) -> torch.Tensor:
    """logits (B, V) in the head's dtype -> fp32 logits / T_eff (B, V), T_eff (B,) fp32. The
    division happens after the upcast, as in the trainer (`head_logp`: z = float(h W^T) / T)."""
    return logits.float() / t_eff.unsqueeze(1)


def block_sums(e: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(B, V) -> (B, ceil(V / block)): sums of consecutive blocks of `block` columns."""
    B, V = e.shape
    nb = V // block
    sums = e[:, :nb * block].view(B, nb, block).sum(-1)  # (B, nb)
    if V % block:
        sums = torch.cat((sums, e[:, nb * block:].sum(-1, keepdim=True)), dim=1)
    return sums


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32): in 16-bit halves of c, so that no product
    reaches 2^63 (int64 overflow is not something to rely on) and every device agrees."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: int, request_id: torch.Tensor, sample_idx: torch.Tensor) -> torch.Tensor:
    """(B,) int64 key of each sample, from the sampler's seed, its request id and its index."""
    k = _mix32(torch.full_like(request_id, seed & _M32) ^ (request_id & _M32))
    return _mix32(k ^ _mul32(sample_idx & _M32, 0x9E3779B9))


def uniforms(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """(B,) float32 uniforms in [0, 1) for token `counter` (B,) of the samples with keys `key` (B,)."""
    x = _mix32(key ^ _mix32((counter & _M32) ^ 0x5BD1E995))
    return (x >> 8).to(torch.float32) * 2.0 ** -24  # 24 random bits: every value exact in float32


def draw(e: torch.Tensor, sums: torch.Tensor, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """One index per row drawn with probability e / e.sum(-1) by inverse CDF, from the row's
    uniform u (B,) in [0, 1), in two levels: pick a block from the cumsum of its block sums
    `sums` (from `block_sums`), then a column from the cumsum of that block only.
    (B, V), (B, nb) -> (B,). Two short cumsums instead of one over the whole vocabulary. A
    zero-probability column is never drawn: searchsorted(right=True) returns the first column
    whose cumulative mass exceeds u, and u is kept strictly below each level's total against rounding."""
    B, V = e.shape
    below = 1 - 2.0 ** -20
    cb = sums.cumsum(-1)                                              # (B, nb)
    u = u.view(B, 1).to(cb.dtype) * cb[:, -1:]
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
           u: torch.Tensor, any_filtered: bool = True, any_greedy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from `scaled` = logits / T_eff (B, V) fp32 (see `scale_logits`)
    with the rows' uniforms u (B,). Greedy rows (B,) bool take the argmax. Returns tokens (B,)
    and their log-probs (B,) under softmax(scaled), i.e. before top-k / top-p truncation, via
    the shared `logp_from_logits`. `any_filtered` / `any_greedy`: whether some row has top-k /
    top-p set / is greedy (the caller knows; False skips that work, True is always correct)."""
    scaled = scaled.float()
    m = scaled.amax(-1, keepdim=True)                      # (B, 1)
    e = torch.sub(scaled, m).exp_()                        # (B, V) unnormalised probs
    sums = block_sums(e)                                   # (B, nb)
    lse = m.squeeze(1) + sums.sum(-1).log()                # logsumexp(scaled), reusing e
    if any_filtered:
        e = torch.sub(filter_logits(scaled, top_k, top_p), m).exp_()  # 0 outside the nucleus
        sums = block_sums(e)
    tokens = draw(e, sums, u)
    if any_greedy:
        tokens = torch.where(greedy, scaled.argmax(-1), tokens)
    return tokens, logp_from_logits(scaled, tokens, 1.0, lse=lse)
