"""Progress bars (tqdm). The trainer's: steps done, the last step's reward and loss, or what the
trainer waits for (run by the trainer process and by a replay). A sampling's, `SampleBar`: samples
finished, with an ETA only once a rate is real (an evaluation's, in the trainer or a notebook).
"""
from __future__ import annotations

import math
import numbers
import time

import numpy as np
import torch
from tqdm import tqdm


def _fmt(v) -> str:
    if torch.is_tensor(v) or isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if v != 0 and math.isfinite(v) and (abs(v) < 1e-2 or abs(v) >= 1e5):
        mant, exp = f"{v:.1e}".split("e")
        return f"{mant}e{int(exp)}"  # 1.2e-3, not 1.2e-03
    return f"{v:.3g}"


class Progress:
    """Trainer progress bar: `update(1, reward=0.41, loss=1.2e-3, **{"tok/s": 120})`."""

    def __init__(self, total: int | None, initial: int = 0, desc: str | None = None):
        self._bar = tqdm(total=total, initial=initial, desc=desc, mininterval=1.0, dynamic_ncols=True)
        self._last_wait = 0.0  # when `waiting` last redrew

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:  # no refresh here: tqdm redraws at most every mininterval inside update()
            self._bar.set_postfix_str(" ".join(f"{k}={_fmt(v)}" for k, v in postfix.items()), refresh=False)
        self._bar.update(n)

    def waiting(self, what) -> bool:
        """Show what the trainer is waiting for, `what` a string or a function returning one
        (evaluated at most once a second); returns False so it can sit in a wait condition."""
        now = time.monotonic()
        if now - self._last_wait >= 1.0:
            self._last_wait = now
            self._bar.set_postfix_str(f"waiting for {what() if callable(what) else what}", refresh=True)
        return False

    def close(self) -> None:
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SampleBar:
    """Samples finished of `total`, `concurrent` of them sampled at once (the sampler's rows). The
    first wave finishes nearly together (its samples start together; the longest decides), so a rate
    taken from its first few samples says nothing about the rest: an ETA from it was off by two
    orders of magnitude. The bar shows none until `concurrent` samples have finished, then the mean
    rate since the start (smoothing 0: one wave's burst does not swing it); where every sample runs
    at once, never."""

    NO_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, total: int, concurrent: int, desc: str = "generate"):
        self._eta_from = concurrent if concurrent < total else None  # None: one wave, no rate to give
        self._bar = tqdm(total=total, desc=desc, unit="sample", smoothing=0, mininterval=1.0, dynamic_ncols=True,
                         bar_format=self.NO_ETA)

    def update(self, n: int = 1) -> None:
        if self._eta_from is not None and self._bar.n + n >= self._eta_from:
            self._bar.bar_format, self._eta_from = None, None  # tqdm's own: elapsed<remaining, rate
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()
