"""Rows packed end to end, without padding: the full causal pass of a micro-batch of rows of uneven
lengths (the trainer's forward and backward, `train.pack_rows`).

Runs in the trainer process, inside `Transformer.forward(tokens, targets=...)` when the model's
`pack_rows` is set (common/runtime/step.py), and wherever a model is handed `prefix_lens`
(prompt sharing, `common/engine/model/prefix.py`): `packed_logp` picks the layout and runs the pass.

A right-padded micro-batch of R rows costs R x T tokens (T its longest row) in every GEMM and
R x T^2 in attention. `PackedRows` runs only each row's real tokens:

    tokens     = [row 0 | row 1 | ... | row R-1]       (1, N), N = sum of the rows' lengths
    cu_seqlens = [0, l0, l0 + l1, ..., N]              (R + 1,) row r is tokens[cu[r]:cu[r + 1]]
    pos        = [0 .. l0-1 | 0 .. l1-1 | ...]          (N,) positions restart per row

Embeddings, norms, GEMMs, MLPs and the head see N tokens; attention is the only place rows meet,
and it runs per row (varlen causal, `attend`):
  CUDA in bf16/fp16  FlashAttention-2's varlen kernel bundled with PyTorch
                     (`torch.ops.aten._flash_attention_forward` with cu_seqlens, causal; ATen's
                     autograd formula runs its backward). NOT run on the dev machines (no GPU):
                     guarded by `_flash_ok`, tested only by the GPU-marked test.
  elsewhere          `causal_attention` on each row's slice: the kernel this machine measured
                     faster (`precision.attention`), no mask, no padding. Measured on CPU against
                     the padded kernel, one SDPA over the packed row with a block-diagonal causal
                     mask (both O(R T^2) or O(N^2)) and FlexAttention (no CPU backward in torch
                     2.13): `bench/_long_train.py`, `attention_candidates`.
A row ends after its last predicting position (causal: later tokens change nothing before them).
Every family packs: RoPE (Llama, Qwen, Mistral, GPT-NeoX's partial rotary) and GPT-2's learned
positions read `pos`; Gemma 3's sliding-window layers are exact because each row fits the window
as unpacked (`Transformer.check_positions` refuses longer rows) and attention never crosses rows.
Not with `train.compile_blocks`: compiled blocks run plain padded rows only (`model.hidden`).

Log-probs come back in the padded (R, T) layout, target-aligned by `common/contracts/ops.py` as before, so
the losses are unchanged. Shapes: R rows, T padded length, N packed tokens, H query heads, Hkv
key/value heads, hd head dim.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from common.engine.model.causal_attention import causal_attention
from common.engine.model.head import head_logp
from common.engine.model.prefix import MIN_SAVING, SharedPrefixes

_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)


@dataclass
class PackedRows:
    """A micro-batch's rows end to end (module docstring); every tensor on the rows' device."""
    tokens: torch.Tensor      # (N,) packed token ids, row-major
    pos: torch.Tensor         # (N,) positions, 0 at each row's start
    cu_seqlens: torch.Tensor  # (R + 1,) int32 row starts, then N
    starts: tuple[int, ...]   # (R + 1,) the same on the host (per-row splits, no device read)
    max_pos: int              # the longest row: > every position
    padded_tokens: int        # R x T: what the padded pass would run

    @property
    def n_tokens(self) -> int:
        return self.starts[-1]

    @property
    def pairs(self) -> int:
        """Query-key pairs of the per-row attention, counted as `SharedPrefixes.work` counts (l^2)."""
        return sum((b - a) ** 2 for a, b in zip(self.starts, self.starts[1:]))

    @classmethod
    def build(cls, tokens: torch.Tensor, lengths: list[int]) -> "PackedRows":
        """tokens (R, T) right-padded rows; lengths (R,) real tokens per row, 1 <= length <= T."""
        R, T = tokens.shape
        if len(lengths) != R or any(n < 1 or n > T for n in lengths):
            raise ValueError(f"PackedRows: need {R} lengths in [1, {T}], got {lengths}")
        dev = tokens.device
        t = torch.arange(T, device=dev)
        keep = t[None] < torch.tensor(lengths, device=dev)[:, None]        # (R, T) a prefix of each row
        starts = tuple(itertools.accumulate(lengths, initial=0))
        return cls(tokens=tokens[keep], pos=t.expand(R, T)[keep],         # (N,) each, row-major
                   cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=dev), starts=starts,
                   max_pos=max(lengths), padded_tokens=R * T)

    def index(self, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Packed index of position t of row `rows` (same shapes; t < the row's length)."""
        return self.cu_seqlens.long()[rows] + t

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention within each row: q (1, H, N, hd), k/v (1, Hkv, N, hd) -> (1, H, N, hd)
        (the `attend` a block calls on whatever it was given to attend through)."""
        if _flash_ok(q):
            return _flash_varlen_causal(q, k, v, self.cu_seqlens, self.max_pos)
        # split, not a slice per row: a slice's backward writes a zero-filled (1, heads, N, hd) per row
        lengths = [b - a for a, b in zip(self.starts, self.starts[1:])]
        rows = zip(*(x.split(lengths, dim=2) for x in (q, k, v)))
        y = [causal_attention(qr, kr, vr) for qr, kr, vr in rows]  # (1, l, H, hd) each
        return torch.cat(y, 1).transpose(1, 2)


def _flash_ok(q: torch.Tensor) -> bool:
    """Whether the varlen flash kernel takes this pass: CUDA with the kernel on an Ampere or newer
    GPU, half-precision compute (autocast's dtype or q's), a head dim it supports."""
    if q.device.type != "cuda" or _FLASH is None or not torch.backends.cuda.is_flash_attention_available():
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 8:
        return False
    dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    return dt in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _flash_varlen_causal(q, k, v, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """FlashAttention-2 varlen, causal per sequence cu[b]:cu[b + 1], grouped heads as they come
    (Hkv divides H). q (1, H, N, hd), k/v (1, Hkv, N, hd) -> (1, H, N, hd) in the compute dtype."""
    dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    qf, kf, vf = (x[0].transpose(0, 1).to(dt).contiguous() for x in (q, k, v))  # (N, heads, hd)
    out = _FLASH(qf, kf, vf, cu, cu, max_len, max_len, 0.0, True, False)[0]    # (N, H, hd)
    return out.transpose(0, 1).unsqueeze(0)


def row_lengths(targets: torch.Tensor) -> list[int]:
    """(R,) tokens each row needs: up to its last predicting position (targets >= 0), at least 1."""
    sel = targets >= 0
    last = targets.shape[1] - 1 - sel.flip(1).int().argmax(1)             # (R,) last predicting position
    return torch.where(sel.any(1), last + 1, 1).tolist()


def layout_for(tokens, lengths: list[int], prefix_lens, pack_rows: bool):
    """The layout a pass runs through, or None for the padded rows:
      prompt sharing (`prefix_lens` given) when it runs MIN_SAVING fewer tokens than the
      alternative (the packed rows with `pack_rows`, else the padded ones) and, against packed
      rows, no more attention pairs (its suffixes' attention is padded: a long row among short
      ones would cost it more than it saves);
      else the packed rows with `pack_rows`; else None."""
    rows = PackedRows.build(tokens, lengths) if pack_rows else None
    if prefix_lens is not None and bool((prefix_lens >= 1).all()):
        plen = prefix_lens.tolist()
        full = [max(n, p) for n, p in zip(lengths, plen)]                     # a row never ends inside its prefix
        n, pairs = SharedPrefixes.work(tokens, plen, full)
        versus = (rows.n_tokens, rows.pairs) if rows is not None else (tokens.numel(), pairs)
        if n <= (1 - MIN_SAVING) * versus[0] and pairs <= versus[1]:
            return SharedPrefixes.build(tokens, plen, full)
    return rows


def packed_logp(model, tokens, targets, prefix_lens, temperature) -> torch.Tensor | None:
    """`Transformer.forward(tokens, targets=, ...)`'s log-probs (R, T) through the layout
    `layout_for` picks (the model's `pack_rows`, `prefix_lens` if given), or None where that is
    the padded rows (the caller runs them)."""
    sel = targets >= 0                                                      # (R, T) predicting positions
    if not bool(sel.any()):
        return None
    layout = layout_for(tokens, row_lengths(targets), prefix_lens, bool(getattr(model, "pack_rows", False)))
    if layout is None:
        return None
    rows, t = sel.nonzero(as_tuple=True)                                    # (n,) each
    h = model.hidden(None, layout=layout)[0]                                # (N, D) packed
    lp = head_logp(h[layout.index(rows, t)], model.lm_head.weight, targets[rows, t], temperature)  # (n,)
    return torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).index_put((rows, t), lp)
