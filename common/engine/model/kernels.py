"""`kernels_kept`: the process-wide kernel switches that `Precision.apply` sets, the CPU fp32 GEMM
backend (`common/engine/model/linear.py`) and the full-pass attention kernel
(`common/engine/model/causal_attention.py`), given back to the process after a block. The trainer's
process holds it around a run (`common/runtime/process.py: trainer_process`). A file of its own
so that it stays light (torch only): `process.py` is imported by every worker.
"""
from __future__ import annotations

import contextlib

from common.engine.model.causal_attention import kernel_enabled, set_kernel
from common.engine.model.linear import onednn_enabled, set_onednn


@contextlib.contextmanager
def kernels_kept():
    """Give the process its GEMM backend and attention kernel back after the block, whatever
    `Precision.apply` chose inside it: `train` or a replay run in a notebook's or a script's
    process leaves that process's later model calls on the kernels it had."""
    gemm, attention = onednn_enabled(), kernel_enabled()
    try:
        yield
    finally:
        set_onednn(gemm)
        set_kernel(attention)
