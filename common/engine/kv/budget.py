"""Which KV cache a sampler gets, and how big: the paged pool's page size and token budget by device
(`Sampler(kv_layout=, kv_tokens=, page_size=)`, the run's `--gen.kv_layout`, `--gen.kv_tokens`,
`--gen.kv_page_size`). Runs in the sampler's process, once, when it is built.
"""
from __future__ import annotations

import math

import torch

from common.engine.kv.static_cache import KVCache
from common.engine.kv.paged_cache import WATERMARK, PagedKVCache

PAGE_SIZE = {"cpu": 64, "cuda": 256}  # tokens per KV page by device (BENCHMARKS.md, "Long outputs")
KV_FRACTION = 0.5  # CUDA: the share of free memory (after the model) a default pool takes; the trainer may share it


def kv_bytes_per_token(cfg, nbytes: int) -> int:
    """Bytes one token's K and V take in every layer, at `nbytes` per value (`cfg`: a ModelConfig)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * nbytes


def static_kv_tokens(max_batch: int, max_seq_len: int, max_prompt_len: int, page_size: int) -> int:
    """What the static cache holds, in whole pages (every slot at full length, every prompt entry
    full), plus the admission watermark's share on top."""
    def pages(n):
        return -(-n // page_size)
    held = max_batch * pages(max_seq_len + 1) + (max_batch + 1) * pages(max_prompt_len)
    return (math.ceil(held / (1 - WATERMARK)) + 1) * page_size


def default_kv_tokens(cfg, device, dtype, max_batch: int, max_seq_len: int, max_prompt_len: int, page_size: int) -> int:
    """The paged pool's budget when none is given. On CPU what the static cache holds, in whole pages
    (every slot at full length, every prompt entry full), plus the admission watermark's share on
    top, so every batch the static cache ran is admitted as it was and never preempted (untouched
    pages are never committed: the pool is taken from the lowest pages up). On CUDA, where memory
    is committed at allocation, `KV_FRACTION` of the free memory (within this process's cap,
    `--gen.memory_fraction`, where one is set), at most that."""
    full = static_kv_tokens(max_batch, max_seq_len, max_prompt_len, page_size)
    if torch.device(device).type != "cuda":
        return full
    per_token = kv_bytes_per_token(cfg, torch.empty(0, dtype=dtype).element_size())
    free, total = torch.cuda.mem_get_info(device)
    get_cap = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # --gen.memory_fraction's cap
    if get_cap is not None:
        free = min(free, int(total * get_cap(device)) - torch.cuda.memory_reserved(device))
    return max(page_size, min(full, int(max(free, 0) * KV_FRACTION) // per_token))


def make_cache(model, max_batch: int, max_seq_len: int, max_prompt_len: int, kv_dtype, kv_layout: str | None = None,
               kv_tokens: int | None = None, page_size: int | None = None):
    """The sampler's cache (`Sampler`'s arguments; None: the model's run settings, then the defaults)."""
    dev = model.device
    kv_layout = kv_layout or getattr(model, "kv_layout", None) or "paged"
    if kv_layout == "static":
        return KVCache(model.cfg, max_batch, max_seq_len, kv_dtype, dev, max_prompt_len=max_prompt_len)
    if kv_layout != "paged":
        raise ValueError(f"kv_layout={kv_layout!r}: expected 'paged' or 'static'")
    page_size = page_size or getattr(model, "kv_page_size", None) or PAGE_SIZE.get(dev.type, 64)
    kv_tokens = kv_tokens or getattr(model, "kv_tokens", None) or default_kv_tokens(
        model.cfg, dev, kv_dtype, max_batch, max_seq_len, max_prompt_len, page_size)
    return PagedKVCache(model.cfg, max_batch, max_seq_len, kv_dtype, dev, kv_tokens, page_size,
                        max_prompt_len=max_prompt_len)
