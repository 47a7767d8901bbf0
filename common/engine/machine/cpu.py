"""What this machine has and how fast it runs the choices `common/engine/machine/precision.py` makes: the
CPU's model and flags, and timings of GEMMs and attention, cached per machine. Runs in the
trainer's process at start (`precision.resolve`), and in benchmarks.

`measure()`, at the process's thread count, about two seconds:
  - fp32 GEMMs of a decoder layer's MLP shape (256 x 576 @ 576 x 1536) on each backend, and bf16,
    in GFLOP/s, best of a few repeats (bf16 against the best fp32: the `dtype` choice);
  - the trainer's GEMMs of one MLP (gate and down projections, 512 rows, each forward x W^T,
    dX = dY W and dW = dY^T X) on ATen and oneDNN alternating call by call, the median of the
    per-round ratios (the `gemm` choice);
  - one decode attention in fp32 and bf16 (the `kv` choice), one full causal attention forward +
    backward, 2 rows x 200 tokens, 9 query / 3 kv heads of 64, our kernel and SDPA (`attention`);
  - with bf16, one decode layer's GEMMs and the head at 64 rows through F.linear and on weights
    packed for oneDNN (`decode_gemm`).
Why the trainer's GEMMs decide the backend: on CPU every run waits on the trainer, and a backend
can win the forward layout and lose the backward's (oneDNN copies a transposed first operand; an
AVX2 EPYC where oneDNN wins forward GEMMs runs the whole training step much slower on it:
BENCHMARKS.md). Why alternate: a shared host's speed drifts over seconds, and timings taken one
backend after the other can favour whichever ran in the faster phase.

The result is cached per machine in $ASYNCRL_CACHE/precision/ (keyed by CPU model, flags, torch
version and thread count) so that reruns on one machine make the same choice;
`--precision.remeasure` refreshes it. The same file holds the decode step's eager vs compiled
measurement (the `decode` choice), which costs a compile and so is taken only on request, by
`python -m common.runtime.measure_decode` (written by `record_decode`, read by `cached_decode`, kept
when the rest is measured again).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.engine.model.attention import attend_lse
from common.engine.model.causal_attention import causal_attention, set_kernel
from common.engine.checkpoints.hf_io import cache_root
from common.engine.model.linear import (bf16_packing_available, linear, linear_dw, linear_dx, onednn_available, pack,
                                 packed_linear, set_onednn)

_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_info() -> dict:
    """CPU model name, the flags that matter for bf16, and the ISA torch dispatches to."""
    name, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name":
                name = val.strip()
            elif key.strip() == "flags":
                flags = set(val.split())
                break
    except OSError:
        pass
    return {"model": name, "flags": [f for f in _FLAGS if f in flags],
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def has_bf16_hardware(info: dict) -> bool:
    return any(f in info["flags"] for f in ("amx_bf16", "avx512_bf16"))


def _best_time(fn, reps: int = 5) -> float:
    fn()  # warm-up: oneDNN builds its kernel on the first call
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def onednn_faster(m: dict) -> bool:
    """Whether `measure()`'s trainer GEMMs ran faster through oneDNN than ATen (absent: not available)."""
    return m.get("fp32_onednn_over_aten_train", math.inf) < 1.0


def backend_times(fn, rounds: int) -> dict[bool, list[float]]:
    """Seconds of `fn()` on ATen (False) and oneDNN (True, where available), the two alternating call
    by call, `rounds` calls each after a warm-up round (oneDNN builds its kernels on a first call);
    the caller's backend is given back. Alternating: module docstring."""
    sides = (False, True) if onednn_available() else (False,)
    times = {on: [] for on in sides}
    old = set_onednn(False)
    try:
        for r in range(rounds + 1):
            for on in sides:
                set_onednn(on)
                t = time.perf_counter()
                fn()
                if r:
                    times[on].append(time.perf_counter() - t)
    finally:
        set_onednn(old)
    return times


def _trainer_gemms(rounds: int = 5) -> dict:
    """ms of one MLP's GEMMs as the trainer runs them (forward, dX, dW of the gate (D -> I) and the
    down (I -> D) projections, 512 rows) on ATen and oneDNN alternating, and the median of the
    per-round ratios oneDNN / ATen (module docstring)."""
    g = torch.Generator().manual_seed(0)
    ops = [(torch.randn(512, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(512, n, generator=g))
           for k, n in ((576, 1536), (1536, 576))]  # (x (M, K), W (N, K), dY (M, N)) per projection

    def step():
        for x, w, dy in ops:
            linear(x, w), linear_dx(dy, w), linear_dw(dy, x)
    times = backend_times(step, rounds)
    out = {f"fp32_{'onednn' if on else 'aten'}_train_ms": 1e3 * statistics.median(ts) for on, ts in times.items()}
    if True in times:
        out["fp32_onednn_over_aten_train"] = statistics.median(a / b for a, b in zip(times[True], times[False]))
    return out


def _full_attention_ms(kernel: bool) -> float:
    """ms of one fp32 causal attention forward + backward at a trainer's shape, our kernel or SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 200, h, 64, generator=g).transpose(1, 2).requires_grad_() for h in (9, 3, 3))
    dy = torch.randn(2, 200, 9, 64, generator=g)
    old = set_kernel(kernel)
    try:
        return 1e3 * _best_time(lambda: causal_attention(q, k, v).backward(dy), reps=3)
    finally:
        set_kernel(old)


def measure(bf16: bool = True) -> dict:
    """GFLOP/s of fp32 GEMMs through ATen and oneDNN (and bf16 if asked), the ms of one
    decode-shaped attention in fp32 and bf16, and of one full causal attention forward +
    backward in fp32 through our kernel and through SDPA; the trainer's GEMMs on each backend
    (`_trainer_gemms`). One call, about two seconds."""
    M, K, N = 256, 576, 1536
    flops = 2 * M * K * N
    x, w = torch.randn(M, K), torch.randn(N, K) / K ** 0.5
    out = {"shape": [M, K, N], "fp32_aten_gflops": flops / _best_time(lambda: F.linear(x, w)) / 1e9}
    if onednn_available():
        mm = torch.ops.mkldnn._linear_pointwise
        out["fp32_onednn_gflops"] = flops / _best_time(lambda: mm(x, w, None, "none", [], "")) / 1e9
    out.update(_trainer_gemms())
    old = set_onednn(onednn_faster(out))  # the kernel's GEMMs as auto will run them
    try:
        out["full_attn_kernel_ms"], out["full_attn_sdpa_ms"] = _full_attention_ms(True), _full_attention_ms(False)
    finally:
        set_onednn(old)
    if bf16:
        xb, wb = x.bfloat16(), w.bfloat16()
        out["bf16_gflops"] = flops / _best_time(lambda: F.linear(xb, wb)) / 1e9
        # one layer's decode attention: 64 rows, 9 query / 3 kv heads, 256 cached tokens
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            q, k = torch.randn(64, 9, 1, 64, dtype=dt), torch.randn(64, 3, 256, 64, dtype=dt)
            mask = torch.zeros(64, 1, 1, 256, dtype=dt)
            out[f"attn_{name}_ms"] = 1e3 * _best_time(lambda: attend_lse(q, k, k, mask))
        if bf16_packing_available():
            out["bf16_decode_gemm_ms"], out["bf16_decode_packed_ms"] = _decode_gemms_ms()
    return out


def _decode_gemms_ms() -> tuple[float, float]:
    """ms of one decode layer's bf16 GEMMs plus a 49,152-token head at 64 rows (SmolLM2-135M's
    shapes), through F.linear and on oneDNN-packed weights (`precision.decode_gemm`)."""
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(64, k, generator=g).bfloat16() for k in (576, 1536)}
    ws = [torch.randn(n, k, generator=g).bfloat16() for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536),
                                                                (49152, 576))]
    packed = [pack(w) for w in ws]
    plain = _best_time(lambda: [F.linear(x[w.shape[1]], w) for w in ws])
    return 1e3 * plain, 1e3 * _best_time(lambda: [packed_linear(x[w.shape[1]], p) for w, p in zip(ws, packed)])


def _cache_file(info: dict) -> Path:
    key = json.dumps([info, torch.__version__], sort_keys=True)
    return cache_root() / "precision" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> dict:
    """A cache file's entries; {} when absent or unreadable (then measured again)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, m: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(m))
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    except OSError:
        pass  # read-only home: the choice still holds for this run


def _decode_entries(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("decode_")}


def measured(info: dict, bf16: bool, remeasure: bool = False) -> dict:
    """`measure()` through the per-machine cache (a file per CPU/flags/torch/threads key). A fresh
    measurement keeps the file's decode measurement (taken only on request: `cached_decode`)."""
    path = _cache_file(info)
    old = _read(path)
    if (not remeasure and (not bf16 or "bf16_gflops" in old) and "full_attn_kernel_ms" in old
            and (not bf16 or not bf16_packing_available() or "bf16_decode_packed_ms" in old)
            and "fp32_aten_train_ms" in old):
        return {**old, "cached": str(path)}
    m = measure(bf16)
    _write(path, {**m, **_decode_entries(old)})
    return m


def cached_decode(info: dict) -> dict:
    """This machine's decode measurement (`decode_*` entries, `common/engine/machine/decode_choice.py`) from
    its cache file; {} where none was taken. Only reads: the measurement itself costs a compile."""
    return _decode_entries(_read(_cache_file(info)))


def record_decode(info: dict, entries: dict) -> Path:
    """Merge a decode measurement into this machine's cache file (the fast entries kept); its path."""
    path = _cache_file(info)
    _write(path, {**_read(path), **_decode_entries(entries)})
    return path
