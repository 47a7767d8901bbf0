"""Attention of one decode step against the sampler's KV cache: the prompt part and the own part,
each with its log-sum-exp, merged later by `attention.merge` (inside the compiled layer body).

Runs in the sampler's process (`common/engine/sampler/decode_model.py` calls it between the two compiled
pieces of every layer). Two ways to compute the same thing, chosen once per sampler:
  flash  (CUDA, bf16/fp16 cache): PyTorch's bundled FlashAttention-2 varlen kernel
         (`torch.ops.aten._flash_attention_forward`), two launches per layer:
           own part     every row b is one query sequence of G tokens (its G query heads per
                        key/value head) against its slot's first own_pos[b] + 1 keys
                        (cu_seqlens_k points at the slot, seqused_k gives its length);
           prompt part  entry e's n samples x G heads are one sequence of n*G queries against its
                        prompt's first plen[e] keys (each shared prompt read once per step);
         the kernel reads K/V through a strided token-major view (`_token_major`): of the static
         cache's (rows, Hkv, cols, hd) stores themselves (nothing copied), or of the paged cache's
         one gather per part and layer (`PagedKVCache.own_kv`, `prompt_kv`);
  dense  (CPU, and CUDA without the kernel): masked attention (`attention.attend_lse`) over the
         bucket's S own and P prompt columns; on a CPU with the paged cache, the own part over
         rows grouped by length, each group up to its longest row (`PagedKVCache.own_groups`).
The cache says where K/V are (`indices`, `own_kv`, `prompt_kv`, `row_tokens`): the same code
serves the static slots (`kv/static_cache.py`) and the pages (`kv/paged_cache.py`).
Shapes (G = H / Hkv query heads per key/value head): q_own (B, G, Hkv, hd) one row per slot;
q_prompt (E*n, G, Hkv, hd), query row e*n + i = the i-th live sample of entry e. Outputs: o_own
(B, G, Hkv, hd), lse_own (B, G, Hkv); o_prompt (E, n, G, Hkv, hd), lse_prompt (E, n, G, Hkv);
any strides (the compiled layer body reads them as they come).
Nothing here reads a device value on the host: a step is captured into a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.model.attention import additive_mask, attend_lse

_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
_HAS_SEQUSED = _FLASH is not None and "seqused_k" in {a.name for a in _FLASH.default._schema.arguments}


def flash_available(device, dtype) -> bool:
    """Whether decode attention can take the flash path here (CUDA build with the kernel and its
    seqused_k argument, half-precision cache)."""
    return (torch.device(device).type == "cuda" and _HAS_SEQUSED and dtype in (torch.bfloat16, torch.float16)
            and torch.backends.cuda.is_flash_attention_available())


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, seqused_k):
    """softmax(q k^T / sqrt(hd)) v per sequence, non-causal, and its log-sum-exp: q (total_q, Hq, hd),
    k/v (N, Hk, hd) any row stride; sequence b is queries cu_q[b]:cu_q[b+1] against keys
    cu_k[b]:cu_k[b] + seqused_k[b]. Returns out (total_q, Hq, hd) and lse in the kernel's layout
    (`lse_rows` reads both)."""
    out, lse, *_ = _FLASH(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, seqused_k=seqused_k)
    return out, lse


def lse_rows(lse: torch.Tensor, seqs: int, per_seq: int) -> torch.Tensor:
    """The kernel's log-sum-exp as (seqs, per_seq, heads): FlashAttention-2 returns it padded per
    sequence, (seqs, heads, max_q), newer versions unpadded, (heads, total_q). A view either way."""
    if lse.dim() == 3:
        return lse[:, :, :per_seq].transpose(1, 2)
    return lse.view(-1, seqs, per_seq).permute(1, 2, 0)


def _token_major(kv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A (B, Hkv, S, hd) view of the cache (rows 0..B-1, columns 0..S-1, any row and token
    strides, hd contiguous) seen as (N, Hkv, hd) tokens without a copy, and the tokens between two
    rows' starts (what cu_seqlens_k steps by): token t of row r is index r * row_tokens + t."""
    B, Hkv, S, hd = kv.shape
    st_row, st_head, st_tok = kv.stride()[:3]
    row_tokens = st_row // st_tok
    n = (B - 1) * row_tokens + S  # up to the last row's column S - 1: within the storage
    return kv.as_strided((n, Hkv, hd), (st_tok, st_head, 1), kv.storage_offset()), row_tokens


@dataclass
class DecodePlan:
    """One step's attention inputs, shared by every layer (built by `plan`, device tensors only)."""
    flash: bool
    B: int
    E: int
    n: int
    S: int
    P: int
    back_e: torch.Tensor          # (B,) the entry of row b's prompt query row (back // n)
    back_i: torch.Tensor          # (B,) its index among the entry's n query rows (back % n)
    write: torch.Tensor           # (B,) where row b's new K/V go: its own column (static), a token (paged)
    idx: tuple | None = None      # the paged cache's gather indices (`PagedKVCache.indices`), None: static
    own_groups: list | None = None  # dense, paged on CPU: [(rows, gather indices, S_g, mask (b, 1, 1, S_g))]
    own_mask: torch.Tensor | None = None     # dense: (B, 1, 1, S) additive
    prompt_mask: torch.Tensor | None = None  # dense: (E, 1, 1, P) additive
    cu_q_own: torch.Tensor | None = None     # flash: (B+1,) int32, G queries per row
    cu_k_own: torch.Tensor | None = None     # flash: (B+1,) int32, row starts in `_token_major`
    used_own: torch.Tensor | None = None     # flash: (B,) int32, own_pos + 1
    cu_q_prompt: torch.Tensor | None = None  # flash: (E+1,) int32, n*G queries per entry
    cu_k_prompt: torch.Tensor | None = None  # flash: (E+1,) int32, entry starts
    used_prompt: torch.Tensor | None = None  # flash: (E,) int32, prompt lengths (>= 1)


def plan(cache, own_pos: torch.Tensor, prompt_len: torch.Tensor, back: torch.Tensor, shape, flash: bool) -> DecodePlan:
    """The plan of a step over slot rows 0..B-1 and entries 0..E-1 (`decode.Shape`): own_pos (B,)
    each row's new column, prompt_len (E,) (0 = unused entry), back (B,) each row's prompt query
    row. S > every own_pos and P >= every prompt_len; larger values give the same result."""
    B, E, n, S, P = shape
    dev = own_pos.device
    write, idx = cache.indices(own_pos, B, S, E, P, group=not flash)
    p = DecodePlan(flash, B, E, n, S, P, torch.div(back, n, rounding_mode="floor"), back % n, write, idx)
    plen = prompt_len.clamp(min=1)  # an unused entry sees column 0: finite garbage nobody reads
    if not flash:
        cols = torch.arange(S, device=dev)
        groups = idx[2] if idx is not None else None
        if groups:  # rows grouped by own length, each group read up to its longest (`PagedKVCache.own_groups`)
            p.own_groups = [(r, i, S_g, additive_mask((cols[:S_g] <= own_pos[r].unsqueeze(1))[:, None, None, :],
                                                      cache.dtype)) for r, i, S_g in groups]
        else:
            p.own_mask = additive_mask((cols <= own_pos.unsqueeze(1))[:, None, None, :], cache.dtype)
        pcols = torch.arange(P, device=dev)
        p.prompt_mask = additive_mask((pcols < plen.unsqueeze(1))[:, None, None, :], cache.dtype)
        return p
    G = cache.G
    own_row, prompt_row = cache.row_tokens(S, P)
    i32 = dict(dtype=torch.int32, device=dev)
    p.cu_q_own = torch.arange(0, (B + 1) * G, G, **i32)
    p.cu_k_own = torch.arange(0, (B + 1) * own_row, own_row, **i32)
    p.used_own = (own_pos + 1).to(torch.int32)
    p.cu_q_prompt = torch.arange(0, (E + 1) * n * G, n * G, **i32)
    p.cu_k_prompt = torch.arange(0, (E + 1) * prompt_row, prompt_row, **i32)
    p.used_prompt = plen.to(torch.int32)
    return p


def attend(cache, layer: int, q_own: torch.Tensor, q_prompt: torch.Tensor, p: DecodePlan):
    """(o_own, lse_own, o_prompt, lse_prompt) of one layer (module docstring: shapes). The step's
    K/V are already in the cache (the compiled layer body wrote them)."""
    B, E, n, S, P = p.B, p.E, p.n, p.S, p.P
    G, Hkv, hd = q_own.shape[1:]
    pk, pv = cache.prompt_kv(layer, E, P, p.idx)    # (E, Hkv, P, hd) views
    if p.own_groups:  # dense over rows grouped by length: each group's rows against its own columns only
        qt = q_own.transpose(1, 2)                                                     # (B, Hkv, G, hd)
        o_s, l_s = qt.new_empty(qt.shape), torch.empty(qt.shape[:-1], dtype=torch.float32, device=qt.device)
        for r, i, S_g, mask in p.own_groups:
            o_s[r], l_s[r] = attend_lse(qt[r], *cache.group_kv(layer, i, len(r), S_g), mask)
        return (o_s.transpose(1, 2), l_s.transpose(1, 2)) + _dense_prompt(q_prompt, pk, pv, p)
    kc, vc = cache.own_kv(layer, B, S, p.idx)       # (B, Hkv, S, hd) views
    if p.flash:
        o_s, l_s = flash_varlen(q_own.view(B * G, Hkv, hd), _token_major(kc)[0], _token_major(vc)[0],
                                p.cu_q_own, p.cu_k_own, G, S, p.used_own)
        o_p, l_p = flash_varlen(q_prompt.view(E * n * G, Hkv, hd), _token_major(pk)[0], _token_major(pv)[0],
                                p.cu_q_prompt, p.cu_k_prompt, n * G, P, p.used_prompt)
        return (o_s.view(B, G, Hkv, hd), lse_rows(l_s, B, G), o_p.view(E, n, G, Hkv, hd),
                lse_rows(l_p, E, n * G).view(E, n, G, Hkv))
    # dense: the G heads sharing a key/value head are G query rows against it (no K/V copies)
    o_s, l_s = attend_lse(q_own.transpose(1, 2), kc, vc, p.own_mask)               # (B, Hkv, G, hd), (B, Hkv, G)
    return (o_s.transpose(1, 2), l_s.transpose(1, 2)) + _dense_prompt(q_prompt, pk, pv, p)


def _dense_prompt(q_prompt: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, p: DecodePlan) -> tuple:
    """The prompt part on the dense path: (o_prompt (E, n, G, Hkv, hd), lse_prompt (E, n, G, Hkv))."""
    E, n = p.E, p.n
    G, Hkv, hd = q_prompt.shape[1:]
    qp = q_prompt.view(E, n * G, Hkv, hd).transpose(1, 2)                          # (E, Hkv, n*G, hd)
    o_p, l_p = attend_lse(qp, pk, pv, p.prompt_mask)                               # (E, Hkv, n*G, hd)
    # the prompt part copied into the flash path's layout (small): a compiled layer body then sees the
    # same strides whatever E and n are (a size-1 dim's stride would otherwise vary: a recompile)
    o_p, l_p = o_p.view(E, Hkv, n, G, hd).permute(0, 2, 3, 1, 4), l_p.view(E, Hkv, n, G).permute(0, 2, 3, 1)
    return o_p.new_empty(o_p.shape).copy_(o_p), l_p.new_empty(l_p.shape).copy_(l_p)
