"""The staleness controller's decisions on synthetic measure streams (common/runtime/staleness_control.py):
degrading importance weights lower eta, a waiting trainer with healthy weights raises it, hysteresis
holds it, the ceiling and the floor hold, and its state round-trips; and what of it (and of the
generators' preemptions) the console's step line shows."""
import json

import pytest

from common.runtime.run_log import step_line
from common.runtime.staleness_control import ControlSettings, StalenessBound, StalenessController
from common.runtime.train_config import TrainConfig

HEALTHY, SICK = (0.95, 0.0), (0.3, 0.2)  # (ESS fraction, capped fraction)


def _run(c: StalenessController, stream) -> list[int]:
    return [c.observe(ess, capped, wait) for ess, capped, wait in stream]


def test_a_waiting_trainer_with_healthy_weights_raises_eta_one_at_a_time_after_each_hold():
    c = StalenessController(ControlSettings(start=1, hold=3, ceiling=4))
    etas = _run(c, [(*HEALTHY, 0.5)] * 30)
    assert etas[0] == 1 and max(etas) == 4 and etas[-1] == 4  # up to the ceiling, never past it
    steps = [b - a for a, b in zip(etas, etas[1:]) if b != a]
    assert steps == [1, 1, 1]  # one at a time
    changes = [i for i in range(1, len(etas)) if etas[i] != etas[i - 1]]
    assert all(b - a > 3 for a, b in zip(changes, changes[1:]))  # the hold between changes
    assert c.last["eta_why"] == "keep"


def test_a_busy_trainer_keeps_eta():
    c = StalenessController(ControlSettings(start=2))
    assert set(_run(c, [(*HEALTHY, 0.01)] * 40)) == {2}


def test_degraded_weights_two_windows_running_halve_eta_down_to_zero():
    c = StalenessController(ControlSettings(start=8, window=4, hold=2))
    etas = _run(c, [(*SICK, 0.5)] * 60)  # the trainer waits too: sick weights win over waiting
    assert etas[6] == 8 and etas[7] == 4  # the second full window (step 8) closes degraded: halved
    assert etas[-1] == 0 and sorted(set(etas), reverse=True) == [8, 4, 2, 1, 0]
    assert c.last["eta_why"] == "keep" and c.eta == 0


def test_one_bad_window_is_not_enough():
    c = StalenessController(ControlSettings(start=4, window=4, hold=0))
    stream = [(*SICK, 0.0)] * 4 + [(*HEALTHY, 0.0)] * 4 + [(*SICK, 0.0)] * 4 + [(*HEALTHY, 0.0)] * 4
    assert set(_run(c, stream)) == {4}


def test_a_high_capped_fraction_alone_degrades():
    c = StalenessController(ControlSettings(start=4, window=2, hold=0))
    etas = _run(c, [(0.99, 0.3, 0.0)] * 4)
    assert etas[-1] == 2


def test_state_round_trips_through_json_and_decides_the_same():
    """Through the checkpoint's counters (numbers in meta.json), as a resumed run reads them."""
    s = ControlSettings(start=3, window=3, hold=1)
    stream = [(*HEALTHY, 0.5)] * 5 + [(*SICK, 0.0)] * 9 + [(*HEALTHY, 0.4)] * 7
    a = StalenessController(s)
    _run(a, stream[:8])
    b = StalenessController.from_counters(s, json.loads(json.dumps(a.counters())))
    assert _run(a, stream[8:]) == _run(b, stream[8:])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="start=9"):
        ControlSettings(start=9, ceiling=8)
    with pytest.raises(ValueError, match="window=0"):
        ControlSettings(window=0)


def test_the_console_step_line_shows_preemptions_reprefills_and_a_moved_eta_only_when_they_say_something(capsys):
    """The trainer's step line (`step_line` of a step's metrics row): reward, loss, version; the
    generators' preemptions and re-prefilled tokens only once non-zero; eta only once auto moved it."""
    class Control:
        def set_bound(self, eta):
            self.eta = eta
    row = {"reward_mean": 0.5, "loss": 0.1, "version": 3, "gen_preemptions": 0.0, "gen_reprefill_tokens": 0.0}
    assert step_line(row, False) == {"reward": 0.5, "loss": 0.1, "v": 3}
    assert step_line({**row, "gen_preemptions": 2.0, "gen_reprefill_tokens": 310.0, "eta": 1}, False) == \
        {"reward": 0.5, "loss": 0.1, "v": 3, "preempted": 2, "reprefill": 310}
    bound, control = StalenessBound(TrainConfig(max_staleness="auto")), Control()
    assert not bound.moved and not StalenessBound(TrainConfig(max_staleness=4)).moved
    rows = [bound.after_step({"behav_ess": 0.95, "capped_frac": 0.0}, 1.0, 1.0, control, None) for _ in range(8)]
    first = next(i for i, r in enumerate(rows) if r["eta"] != rows[0]["eta"])  # the trainer waited half its step
    assert bound.moved and control.eta == rows[first]["eta"] == 2
    assert step_line({**row, **rows[-1]}, bound.moved)["eta"] == 2
    assert "staleness: eta 1 -> 2" in capsys.readouterr().out
    assert StalenessBound(TrainConfig(max_staleness="auto"), bound.counters()).moved  # resumed away from its start
