"""What a process of the runtime sets for itself: its CPU threads, its allocator, and how it takes
SIGTERM. Every process that runs a model calls `set_process_defaults` (generators and trainer ranks
when they start, `train` and a replay for the trainer in the launching process, the task scripts
and benchmarks for theirs); the trainer's process holds `sigterm_as_interrupt` around its run.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading

import torch

from common.engine.model.kernels import kernels_kept

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)


def set_process_defaults(device: str) -> None:
    """Per-process defaults of a process that runs a model on `device`. On CPU: cap intra-op
    threads (ASYNCRL_NUM_THREADS, default 1): with several processes sharing few cores,
    oversubscribed thread pools make small ops up to two orders of magnitude slower (measured
    on the 2-core dev boxes: docs/internals.md, "CPU threads"); and keep freed memory in the process
    (`keep_freed_memory`). GPU processes need neither (their big buffers live on the GPU)."""
    if torch.device(device).type == "cpu":
        cap_threads()
        keep_freed_memory()


def cap_threads() -> None:
    """Intra-op threads of this process: ASYNCRL_NUM_THREADS, default 1 (`set_process_defaults`)."""
    torch.set_num_threads(int(os.environ.get("ASYNCRL_NUM_THREADS", 1)))


@contextlib.contextmanager
def trainer_process(device: str, threads: int | None = None, precision=None):
    """Run a trainer in the caller's process (`train`, a replay) as a worker runs: with
    `set_process_defaults(device)`, and `threads` intra-op threads if given (a replay: the
    recording's), also in the trainer ranks spawned meanwhile (they read ASYNCRL_NUM_THREADS).
    Yields the thread count. The count, that variable, and the GEMM backend and attention kernel
    (`precision` applied here if given; `train` applies its own inside) are restored after, so a
    notebook's kernel or a script keeps its own. Why a fixed count: it decides how a CPU GEMM
    splits its sums, so a run computed with another count than its replay differs in the last bits."""
    before, env = torch.get_num_threads(), os.environ.get("ASYNCRL_NUM_THREADS")
    if threads is not None:
        os.environ["ASYNCRL_NUM_THREADS"] = str(threads)
    try:
        with kernels_kept():
            set_process_defaults(device)
            if precision is not None:
                precision.apply()
            yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("ASYNCRL_NUM_THREADS", None)
        else:
            os.environ["ASYNCRL_NUM_THREADS"] = env


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in this process (ASYNCRL_MALLOC=system leaves its
    defaults). By default glibc serves every block above its mmap threshold (32 MiB at most)
    with its own mmap, unmapped on free, and hands the heap's free top back to the kernel. A
    training or sampling step frees and reallocates the same big tensors every time
    (activations, log-prob chunks, gradients, AdamW's temporaries), so the kernel faults in and
    zeroes every page of them again each step: time in the kernel, and memory traffic that
    processes sharing a socket pay together. With no mmap and no trimming, the heap grows to
    the step's peak once and is reused (PyTorch's CPU launcher does the same with jemalloc's
    decay off). Price: the process never returns memory, its RSS stays at its peak. Returns
    whether the setting took (False without glibc, e.g. on macOS)."""
    how = os.environ.get("ASYNCRL_MALLOC", "keep")
    if how not in ("keep", "system"):
        raise ValueError(f"ASYNCRL_MALLOC={how!r}: expected 'keep' or 'system'")
    if how == "system":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # no glibc
        return False


@contextlib.contextmanager
def sigterm_as_interrupt():
    """In the block (main thread only), a SIGTERM to this process acts as a Ctrl-C to it alone:
    SIGINT is raised in this process, not in its workers' (they are stopped by the shutdown that
    follows), and whatever defers or handles a Ctrl-C handles it. Where SIGINT is ignored (a
    process started in the background by a script, `nohup`, some batch systems: Python then keeps
    it ignored) or has no Python handler, KeyboardInterrupt is raised directly: otherwise the
    SIGTERM would be lost and the run would go on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)


def _term_as_interrupt(*_) -> None:
    if callable(signal.getsignal(signal.SIGINT)):  # Python's Ctrl-C handler, or one holding it back
        signal.raise_signal(signal.SIGINT)
    else:  # SIG_IGN or SIG_DFL: a raised SIGINT would be dropped, or kill us without a checkpoint
        raise KeyboardInterrupt
