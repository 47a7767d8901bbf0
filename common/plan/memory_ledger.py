"""A memory plan's ledger: its lines (bytes a process holds on a device, and what for), the devices'
capacities and the processes' caps (`memory_fraction`), whether it fits, how far from fitting, and
its report. Filled by common/plan/memory_plan.py, its changes by common/plan/memory_fixes.py.

Runs in the launching process, before anything loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from common.engine.model.model_config import ModelConfig


class Sizes(NamedTuple):
    model: ModelConfig   # the policy's
    params: int          # the policy's parameters
    n_gpu: int           # GPUs planned for (0: a CPU run)
    per: int             # a KV pool token's bytes
    seq: int             # a full-length sample: prompt + gen.max_new_tokens
    page: int            # the KV pool's page, in tokens


@dataclass
class Line:
    device: str
    process: str
    what: str
    nbytes: int
    follows: str = ""  # the section whose `device` setting places it (reward, victim), "" otherwise


@dataclass
class Plan:
    lines: list = field(default_factory=list)
    capacity: dict = field(default_factory=dict)   # device -> bytes (None: unknown here)
    caps: dict = field(default_factory=dict)       # (device, process) -> bytes (memory_fraction)
    fixes: list = field(default_factory=list)      # (setting, what it does)
    notes: list = field(default_factory=list)
    errors: list = field(default_factory=list)     # what cannot run whatever the memory
    kv_tokens: dict = field(default_factory=dict)  # process -> its KV pool's tokens
    sizes: Sizes | None = None                     # what the plan was computed from (memory_fixes.py reads it)
    together: str = ""                             # the fixes that, taken together, re-plan to a fit (or what they leave)

    def add(self, device, process, what, nbytes, follows: str = ""):
        self.lines.append(Line(device, process, what, int(nbytes), follows))

    def used(self, device, process=None, allocator: bool = False) -> int:
        """Bytes on `device` (of `process`); `allocator`: only what its caching allocator holds, the
        share a memory_fraction caps (a CUDA context is outside it)."""
        return sum(x.nbytes for x in self.lines if x.device == device and process in (None, x.process)
                   and not (allocator and x.what.startswith("CUDA context")))

    def over(self) -> list[str]:
        """What does not fit: each device past its memory, each process past its cap."""
        out = list(self.errors)
        for d, cap in self.capacity.items():
            if cap is not None and self.used(d) > cap:
                out.append(f"{d} needs {gb(self.used(d))} of {gb(cap)}")
        for (d, p), cap in self.caps.items():
            if self.capacity.get(d) is not None and self.used(d, p, allocator=True) > cap:
                out.append(f"{p} needs {gb(self.used(d, p, allocator=True))} of its {gb(cap)} share of {d}")
        return out

    @property
    def fits(self) -> bool:
        return not self.over()

    def excess(self) -> tuple:
        """How far from fitting, to compare plans: (errors, bytes past each device's memory and each
        process's cap)."""
        out = sum(max(0, self.used(d) - c) for d, c in self.capacity.items() if c is not None)
        return len(self.errors), out + sum(max(0, self.used(d, p, allocator=True) - c)
                                           for (d, p), c in self.caps.items() if self.capacity.get(d) is not None)

    def summary(self) -> str:
        return ", ".join(f"{d} {gb(self.used(d))} of {gb(c)}" for d, c in self.capacity.items() if c is not None)

    def report(self) -> str:
        rows = []
        for d, cap in self.capacity.items():
            rows.append(f"{d}: {gb(self.used(d))} of {gb(cap) if cap is not None else 'unknown (give --print-memory=<GB>)'}")
            for x in self.lines:
                if x.device == d:
                    rows.append(f"  {x.process:<16} {x.what:<64} {gb(x.nbytes):>9}")
        rows += self.notes
        bad, unknown = self.over(), [d for d, c in self.capacity.items() if c is None]
        if bad:
            rows.append("does not fit: " + "; ".join(bad) + ". " + self.advice_tail())
        elif unknown:  # nothing past a memory that is known, the rest not judged: not a fit
            example = "80" if len(unknown) == 1 else f"80x{len(unknown)}"
            rows.append(f"not judged: the memory of {', '.join(unknown)} is unknown on this machine; give it as "
                        f"--print-memory=<GB> (or <GB>x<GPUs>), e.g. --print-memory={example}")
        else:
            rows.append("fits")
        return "\n".join(rows)

    def advice_tail(self) -> str:
        out = ("Change: " + "; ".join(f"{s} ({what})" for s, what in self.fixes)) if self.fixes else ""
        return out + (f". {self.together}" if self.together else "")

    def advice(self) -> str:
        return ("memory plan: " + "; ".join(self.over()) + " (python <script> ... --print-memory shows each part). "
                + self.advice_tail() + "; or --memory_check=false to start anyway")


def share(nbytes: float, total: float) -> float:
    """The memory_fraction, in hundredths rounded up, that holds `nbytes` of `total`."""
    return math.ceil(100 * nbytes / total) / 100


def gb(n) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"
