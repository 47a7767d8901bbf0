"""Rows that start with the same prefix, packed so that the prefix runs once: the full causal pass
of a micro-batch whose rows are samples of a few prompts (the trainer's forward and backward, the
generators' reference pass).

A micro-batch of R right-padded rows (B = R, T tokens) costs R x T tokens in every GEMM. When its
rows are groups of samples of P distinct prompts, `SharedPrefixes` packs it without padding:

    packed = [prefix 0 | prefix 1 | ... | prefix P-1 | suffix 0 | suffix 1 | ... | suffix R-1]

N = sum of the distinct prefixes' lengths + sum of the suffixes' lengths tokens, one (1, N) row
through embeddings, norms, GEMMs and MLPs. Attention is the only place the rows meet; per layer:

    prefix p (P, Lp):  causal attention over its own keys (`causal_attention`)
    suffix r (R, Ls):  attention over [its prefix's keys | its own keys], a query at suffix
                       position i seeing prefix keys j < len(prefix) and suffix keys j' <= i

which is the attention each row's unpacked causal pass computes (prefix keys are the same tensors
whichever row reads them; their gradients add up over the rows that read them, as autograd does
for a gather). RoPE positions are j in a prefix and len(prefix) + j in a suffix, as unpacked.
The result equals the unpacked pass up to floating-point summation order (`tests/test_prefix.py`).

Where rows share nothing (every prompt distinct) packing still drops the right padding; a pass
packs only when that runs at least `MIN_SAVING` fewer tokens than the padded rows, or, with
`train.pack_rows`, than the rows packed end to end (`common/engine/model/packing.py`, which decides
and runs the pass: `packed_logp`), and no more attention work than they do (`work`).
Shapes: R rows, P distinct prefixes, Lp / Ls longest prefix / suffix, N packed tokens, H query
heads, Hkv key/value heads, hd head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.model.causal_attention import causal_attention


# pack only when that drops at least this share of the padded rows' tokens: the packed pass adds
# gathers and copies around each attention, worth it for groups, not for a few pad tokens
MIN_SAVING = 0.1


@dataclass
class SharedPrefixes:
    """A micro-batch packed with each distinct prefix once (module docstring). Built on the
    host from the rows' tokens; every tensor on the rows' device."""
    tokens: torch.Tensor      # (N,) packed token ids: prefixes (prefix-major), then suffixes (row-major)
    pos: torch.Tensor         # (N,) RoPE positions
    pre_idx: torch.Tensor     # (P, Lp) packed index of prefix p's j-th token (0 past its end)
    pre_valid: torch.Tensor   # (P, Lp) bool: j < len(prefix p)
    suf_idx: torch.Tensor     # (R, Ls) packed index of row r's suffix token j (0 past its end)
    suf_valid: torch.Tensor   # (R, Ls) bool
    pre_take: torch.Tensor    # (n_pre,) flat (P x Lp) indices of the valid prefix positions, in packed order
    suf_take: torch.Tensor    # (n_suf,) flat (R x Ls) indices of the valid suffix positions, in packed order
    row_pre: torch.Tensor     # (R,) the prefix of each row
    pre_len: torch.Tensor     # (R,) its length (= the row's prefix length)
    sees: torch.Tensor        # (R, 1, Ls, Lp + Ls) bool: the keys a suffix query attends to
    max_pos: int              # > every position (RoPE table size, no host read)
    padded_tokens: int        # R x T: what the unpacked pass would run

    @property
    def n_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def n_prefixes(self) -> int:
        return self.pre_idx.shape[0]

    @classmethod
    def build(cls, tokens: torch.Tensor, prefix_lens, lengths) -> "SharedPrefixes":
        """tokens (R, T) right-padded rows; prefix_lens (R,) tokens of each row's prefix (>= 1);
        lengths (R,) real tokens per row (>= its prefix). Rows whose prefixes are equal token for
        token share one copy (found by content: no group ids needed)."""
        R, T = tokens.shape
        plen, rlen = [[int(x) for x in (v.tolist() if torch.is_tensor(v) else v)] for v in (prefix_lens, lengths)]
        if len(plen) != R or len(rlen) != R:
            raise ValueError(f"SharedPrefixes: {R} rows but {len(plen)} prefix lengths and {len(rlen)} lengths")
        if any(p < 1 or p > n or n > T for p, n in zip(plen, rlen)):
            raise ValueError(f"SharedPrefixes: need 1 <= prefix_len <= length <= T={T}; got {plen} / {rlen}")
        host = tokens.cpu()
        row_pre, prefixes = _distinct(host, plen)
        Lp = max(plen)
        slen = [n - p for p, n in zip(plen, rlen)]
        Ls = max(1, max(slen))
        # packed offsets: prefixes first, then suffixes
        p_start, n = [], 0
        for r in prefixes:
            p_start.append(n)
            n += plen[r]
        s_start = []
        for r in range(R):
            s_start.append(n)
            n += slen[r]
        j_p, j_s = torch.arange(Lp), torch.arange(Ls)
        p_len_t = torch.tensor([plen[r] for r in prefixes])
        pre_valid = j_p[None] < p_len_t[:, None]                                        # (P, Lp)
        pre_idx = torch.where(pre_valid, torch.tensor(p_start)[:, None] + j_p[None], 0)
        s_len_t, row_plen = torch.tensor(slen), torch.tensor(plen)
        suf_valid = j_s[None] < s_len_t[:, None]                                        # (R, Ls)
        suf_idx = torch.where(suf_valid, torch.tensor(s_start)[:, None] + j_s[None], 0)
        flat = torch.cat([pre_idx[pre_valid], suf_idx[suf_valid]])                      # (N,) the packed order
        toks = torch.cat([host[r, :plen[r]] for r in prefixes] + [host[r, plen[r]:rlen[r]] for r in range(R)])
        pos = torch.cat([torch.arange(plen[r]) for r in prefixes] +
                        [torch.arange(plen[r], rlen[r]) for r in range(R)])
        assert torch.equal(flat, torch.arange(n)) and toks.numel() == n  # `attend` concatenates in this order
        # suffix query i of row r sees prefix keys j < plen[r] and suffix keys j' <= i
        sees = torch.cat([(j_p[None, None, :] < row_plen[:, None, None]).expand(R, Ls, Lp),
                          (j_s[None, None, :] <= j_s[None, :, None]).expand(R, Ls, Ls)], dim=-1)
        dev = tokens.device
        # integer indices, not boolean masks, select the valid outputs in `attend`: a boolean index
        # on CUDA reads its count back to the host, a sync per layer
        take = [m.flatten().nonzero().squeeze(1).to(dev) for m in (pre_valid, suf_valid)]
        return cls(tokens=toks.to(dev), pos=pos.to(dev), pre_idx=pre_idx.to(dev), pre_valid=pre_valid.to(dev),
                   suf_idx=suf_idx.to(dev), suf_valid=suf_valid.to(dev), pre_take=take[0], suf_take=take[1],
                   row_pre=torch.tensor(row_pre, device=dev),
                   pre_len=row_plen.to(dev), sees=sees.unsqueeze(1).to(dev), max_pos=max(rlen),
                   padded_tokens=R * T)

    @staticmethod
    def work(tokens: torch.Tensor, prefix_lens: list[int], lengths: list[int]) -> tuple[int, int]:
        """(packed tokens, attention query-key pairs) of `build(tokens, prefix_lens, lengths)`
        without building it: the prefixes' causal attention P x Lp^2, the suffixes' masked one
        R x Ls x (Lp + Ls), both padded."""
        _, prefixes = _distinct(tokens.cpu(), prefix_lens)
        Lp, Ls = max(prefix_lens), max(1, max(n - p for p, n in zip(prefix_lens, lengths)))
        n = sum(prefix_lens[r] for r in prefixes) + sum(lengths) - sum(prefix_lens)
        return n, len(prefixes) * Lp * Lp + len(lengths) * Ls * (Lp + Ls)

    def index(self, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Packed index of position t of row `rows` (same shapes; t < the row's length)."""
        plen = self.pre_len[rows]
        in_pre = t < plen
        a = self.pre_idx[self.row_pre[rows], t.clamp(max=self.pre_idx.shape[1] - 1)]
        b = self.suf_idx[rows, (t - plen).clamp(min=0, max=self.suf_idx.shape[1] - 1)]
        return torch.where(in_pre, a, b)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the packed row: q (1, H, N, hd), k/v (1, Hkv, N, hd) -> (1, H, N, hd)
        (the `attend` a block calls on whatever it was given to attend through)."""
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)     # (N, heads, hd)
        # prefixes: (P, Lp, heads, hd) -> (P, heads, Lp, hd), causal over their own keys
        kp, vp = k[self.pre_idx].transpose(1, 2), v[self.pre_idx].transpose(1, 2)
        yp = causal_attention(q[self.pre_idx].transpose(1, 2), kp, vp)                  # (P, Lp, H, hd)
        # suffixes: keys = [their prefix's | their own], (R, Hkv, Lp + Ls, hd)
        ks = torch.cat([kp[self.row_pre], k[self.suf_idx].transpose(1, 2)], dim=2)
        vs = torch.cat([vp[self.row_pre], v[self.suf_idx].transpose(1, 2)], dim=2)
        qs = q[self.suf_idx].transpose(1, 2)                                            # (R, H, Ls, hd)
        ys = _masked_attention(qs, ks, vs, self.sees).transpose(1, 2)                   # (R, Ls, H, hd)
        y = torch.cat([yp.flatten(0, 1)[self.pre_take], ys.flatten(0, 1)[self.suf_take]])  # (N, H, hd) packed order
        return y.transpose(0, 1).unsqueeze(0)


def _distinct(host: torch.Tensor, plen: list[int]) -> tuple[list[int], list[int]]:
    """(each row's prefix index, the first row of each distinct prefix): rows whose first plen[r]
    tokens are equal share one prefix (by content)."""
    first: dict[tuple, int] = {}  # prefix content -> prefix index
    row_pre, prefixes = [], []
    for r in range(host.shape[0]):
        key = tuple(host[r, :plen[r]].tolist())
        if key not in first:
            first[key] = len(prefixes)
            prefixes.append(r)
        row_pre.append(first[key])
    return row_pre, prefixes


def _masked_attention(q, k, v, sees):
    """softmax(q k^T / sqrt(hd), keys where `sees`) v; q (R, H, L, hd), k/v (R, Hkv, S, hd)."""
    H, Hkv = q.shape[1], k.shape[1]
    if q.device.type == "cpu" or H == Hkv:  # the CPU flash kernel takes a mask and grouped heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, enable_gqa=H != Hkv)
    # CUDA: with a mask, grouped heads would send SDPA to its math path; expanded heads keep the
    # memory-efficient kernel
    k, v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees)
