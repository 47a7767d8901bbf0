"""Prefill: prompts into the KV cache's prefix entries (several per forward), and a sample's own
tokens into its slot after a weight update (re-prefill, AReaL's interruption), all at once.

Runs inside the sampler's process (`common/engine/sampler/sampler.py`). Sequences of different lengths
are right-padded into one (b, T) batch: with causal attention a real token never sees the
padding after it, and the padding's K/V land in columns the decode masks never open (a prompt's
columns end at its length; a slot's own columns are overwritten as the sample grows). Index and
token tensors reach the device without making the host wait (`inflight.to_device`).
"""
from __future__ import annotations

import torch

from common.engine.kv.transfer import to_device
from common.engine.sampler.sampling import effective_temperature, scale_logits


def padded(seqs: list[list[int]], device) -> torch.Tensor:
    """Right-padded (b, max len) token tensor (pad id 0)."""
    T = max(len(s) for s in seqs)
    return to_device([s + [0] * (T - len(s)) for s in seqs], device)


def batches(lengths: list[int], budget: int) -> list[range]:
    """Consecutive index ranges whose padded size (rows x longest) fits `budget` (one always does)."""
    out, i = [], 0
    while i < len(lengths):
        j = i + 1
        while j < len(lengths) and (j + 1 - i) * max(lengths[i:j + 1]) <= budget:
            j += 1
        out.append(range(i, j))
        i = j
    return out


def prefill_prompts(model, cache, prompts: list[list[int]], entries: list[int], temperatures: list[float | None],
                    budget: int) -> tuple[list[torch.Tensor | None], int]:
    """K/V of each prompt into its prefix entry, `budget` padded tokens per forward. Returns, per
    prompt, its last position's logits / T_eff (V,) where a temperature is given (samples still
    to draw their first token), else None (fp32 logits / T_eff); and the number of forwards."""
    dev, out = model.device, [None] * len(prompts)
    parts = batches([len(p) for p in prompts], budget)
    for part in parts:
        cache.begin_prompts(to_device([entries[k] for k in part], dev))
        h = model.hidden(padded([prompts[k] for k in part], dev), cache=cache)  # (b, T, D)
        want = [k for k in part if temperatures[k] is not None]
        if want:
            rows = to_device([k - part.start for k in want], dev)
            last = to_device([len(prompts[k]) - 1 for k in want], dev)
            t_eff = effective_temperature(to_device([temperatures[k] for k in want], dev, torch.float32))
            scaled = scale_logits(model.lm_head(h[rows, last]), t_eff)  # (w, V) fp32: each prompt's last position
            for k, lg in zip(want, scaled):
                out[k] = lg
    return out, len(parts)


def prefill_continuations(model, cache, slots: list[int], entries: list[int], prompt_lens: list[int],
                          tokens: list[list[int]], max_pos: int) -> None:
    """K/V of tokens[i] (which follow entry entries[i]'s prompt of prompt_lens[i] tokens) into
    slot slots[i], columns 0.., in one forward (interrupts only: it gathers each row's prompt)."""
    dev = model.device
    plen = to_device(prompt_lens, dev)
    cache.begin_continuations(to_device(slots, dev), to_device(entries, dev), plen, max(prompt_lens))
    T = max(len(t) for t in tokens)
    pos = plen.unsqueeze(1) + torch.arange(T, device=dev)  # (b, T) absolute positions
    model.hidden(padded(tokens, dev), cache=cache, pos=pos, max_pos=max_pos)
