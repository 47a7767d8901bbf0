"""A controller for the staleness bound eta (`--train.max_staleness=auto`): it moves eta between 0
and a ceiling from the run's own off-policy measures. Runs in the trainer process, called once per
trainer step with that step's measures; it only ever changes the admission bound (generators pause
at it), never drops a row already sampled: dropping rows biases the batch toward short answers.

Rules (windowed means over the last `window` steps, AIMD like TCP's congestion window):
  degraded  the importance weights are unhealthy: the mean ESS fraction (`behav_ess`, areal/loss.py:
            (sum w)^2 / (n sum w^2) of the behaviour weights) below `ess_floor`, or the mean
            capped fraction (`capped_frac`: weights at `behav_imp_weight_cap`) above `capped_max`;
  lower     degraded in two windows running: eta -> eta // 2 (multiplicative: collapse is fast);
  raise     the trainer waited for data for more than `wait_share` of its step (mean over the
            window) and the window is healthy: eta -> eta + 1, at most `ceiling`;
  hold      after any change, no other for `hold` steps (the measures lag eta: rows admitted under
            the old bound are still being trained on).
Every decision is recorded (`last`: eta, the measures behind it, why), for the run's metrics.
The state is a few numbers, `counters()`, which a checkpoint keeps (common/runtime/files/checkpoint.py);
`from_counters` restores it.
`lr_scale()` (`train.lr_by_ess`): sqrt of the window's mean ESS fraction, the factor VCPO
(arXiv 2602.17616) scales the learning rate by; 1 before any measure.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class ControlSettings:
    ceiling: int = 8            # the largest eta it may set (train.max_staleness_max)
    start: int = 1              # eta at the first step
    window: int = 4             # steps per window of measures
    hold: int = 4               # steps without a change after one
    ess_floor: float = 0.6      # mean ESS fraction below this: degraded
    capped_max: float = 0.05    # mean capped fraction above this: degraded
    wait_share: float = 0.2     # mean share of the step the trainer waited for data above this: raise

    def __post_init__(self):
        if not 0 <= self.start <= self.ceiling:
            raise ValueError(f"staleness control: start={self.start} must be in [0, ceiling={self.ceiling}]")
        if self.window < 1 or self.hold < 0:
            raise ValueError(f"staleness control: window={self.window} must be >= 1 and hold={self.hold} >= 0")


class StalenessController:
    def __init__(self, settings: ControlSettings = ControlSettings()):
        self.s = settings
        self.eta = settings.start
        self.measures: deque[tuple[float, float, float]] = deque(maxlen=settings.window)
        self.since_change = 0     # steps since eta last changed
        self.degraded_windows = 0  # consecutive full windows found degraded
        self.steps = 0
        self.last: dict = {}

    def observe(self, ess_frac: float, capped_frac: float, wait_share: float) -> int:
        """One trainer step's measures -> the eta for the next admissions."""
        self.measures.append((ess_frac, capped_frac, wait_share))
        self.steps += 1
        self.since_change += 1
        n = len(self.measures)
        ess, capped, wait = (sum(m[i] for m in self.measures) / n for i in range(3))
        degraded = ess < self.s.ess_floor or capped > self.s.capped_max
        if self.steps % self.s.window == 0:  # a full window closes: count it
            self.degraded_windows = self.degraded_windows + 1 if degraded else 0
        why, old = "hold", self.eta
        if self.since_change > self.s.hold:
            if self.degraded_windows >= 2 and self.eta > 0:
                self.eta, why = self.eta // 2, "lower: importance weights degraded two windows running"
                self.degraded_windows = 0
            elif not degraded and wait > self.s.wait_share and self.eta < self.s.ceiling:
                self.eta, why = self.eta + 1, "raise: the trainer waits for data, weights healthy"
            else:
                why = "keep"
        if self.eta != old:
            self.since_change = 0
            self.measures.clear()  # measures taken under the old bound say little about the new one
        self.last = {"eta": self.eta, "eta_ess": ess, "eta_capped": capped, "eta_wait": wait, "eta_why": why}
        return self.eta

    def lr_scale(self) -> float:
        """The learning-rate factor for the next step: sqrt(mean ESS fraction over the window)."""
        if not self.measures:
            return 1.0
        ess = sum(m[0] for m in self.measures) / len(self.measures)
        return min(1.0, max(ess, 0.0)) ** 0.5

    def counters(self, prefix: str = "staleness.") -> dict[str, float]:
        """The state as flat numbers (a checkpoint's counters); settings come from the run's config."""
        out = {"eta": self.eta, "since_change": self.since_change, "degraded_windows": self.degraded_windows,
               "steps": self.steps, "n_measures": len(self.measures)}
        for i, m in enumerate(self.measures):
            out.update({f"m{i}_ess": m[0], f"m{i}_capped": m[1], f"m{i}_wait": m[2]})
        return {prefix + k: v for k, v in out.items()}

    @classmethod
    def from_counters(cls, settings: ControlSettings, counters: dict,
                      prefix: str = "staleness.") -> "StalenessController":
        """`counters()`'s inverse; a checkpoint without them (a fixed-eta run's) starts afresh."""
        c = cls(settings)
        if prefix + "eta" not in counters:
            return c
        g = lambda k: counters[prefix + k]  # noqa: E731
        c.eta = min(int(g("eta")), settings.ceiling)
        c.since_change, c.degraded_windows, c.steps = int(g("since_change")), int(g("degraded_windows")), int(g("steps"))
        c.measures.extend((float(g(f"m{i}_ess")), float(g(f"m{i}_capped")), float(g(f"m{i}_wait")))
                          for i in range(int(g("n_measures"))))
        return c


class StalenessBound:
    """The trainer's side of eta; `run_trainer` builds one (with a checkpoint's counters on resume)
    and calls `after_step` once per step. A fixed bound (a number, or None: unbounded) does nothing
    there; `auto` feeds the controller, moves the admission quota (`Control.set_bound`: a lower eta
    pauses claims, no started prompt is withdrawn) and, with `train.lr_by_ess`, scales the
    optimizer's rate for the next step (after the schedule's step has set it)."""

    def __init__(self, tc, counters: dict | None = None):
        self.auto, self.lr_by_ess = tc.max_staleness == "auto", tc.lr_by_ess
        self.ctl = None
        if self.auto:
            settings = ControlSettings(ceiling=tc.max_staleness_max, start=min(ControlSettings.start, tc.max_staleness_max))
            self.ctl = StalenessController.from_counters(settings, counters or {})
        self.eta = self.ctl.eta if self.auto else tc.max_staleness  # the admission bound now
        self.moved = self.auto and self.eta != self.ctl.s.start  # auto has set eta away from its start (console)

    def after_step(self, stats: dict, wait_s: float, train_s: float, control, opt) -> dict:
        """One trainer step's decision from its stats and the seconds it waited for data and trained;
        returns what the metrics row gets (eta and the measures behind it; nothing when fixed)."""
        if not self.auto:
            return {}
        if "behav_ess" not in stats:
            raise RuntimeError("train.max_staleness=auto: the algorithm's step reported no behav_ess "
                               "(areal/loss.py: behaviour_stats); use a fixed eta with this algorithm")
        old = self.eta
        self.eta = self.ctl.observe(stats["behav_ess"], stats.get("capped_frac", 0.0),
                                    wait_s / max(wait_s + train_s, 1e-9))
        last = self.ctl.last
        if self.eta != old:
            control.set_bound(self.eta)
            self.moved = True
            print(f"[asyncrl] staleness: eta {old} -> {self.eta} ({last['eta_why']}; window means: ESS fraction "
                  f"{last['eta_ess']:.3f}, capped {last['eta_capped']:.3f}, waiting {last['eta_wait']:.0%} of the step)")
        row = {k: v for k, v in last.items() if k != "eta_why"}
        if self.lr_by_ess:
            row["lr_scale"] = scale = self.ctl.lr_scale()
            for g in opt.param_groups:
                g["lr"] *= scale
        return row

    def counters(self) -> dict:
        """The controller's state for the checkpoint (none for a fixed bound)."""
        return self.ctl.counters() if self.auto else {}
