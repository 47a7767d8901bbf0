"""Liveness watchdog: a hung worker is named with its phase, its silence and its stack; a
worker that waits while beating is not; warn mode keeps going; a stopped process is reported."""
import contextlib
import os
import signal
import time

import pytest

from common.runtime.launch import Workers
from common.runtime.watchdog import Heartbeats, WorkerStalled


def _hang_in_reward(beat, *, stop_event):
    """Beats once as 'scoring' request 7, then blocks forever (a reward stuck on the network)."""
    beat.start()
    beat("scoring", 7)
    while True:
        time.sleep(3600)


def _wait_but_beat(beat, *, stop_event):
    """Waits a long time, beating on every poll: alive, not hung."""
    beat.start()
    while not stop_event.is_set():
        beat("waiting")
        time.sleep(0.05)


@contextlib.contextmanager
def _watched(tmp_path, name, fn, timeout, action="stop", join_timeout=10.0):
    """Workers running `fn` as `name`, watched once its first beat is in (spawn and imports
    take seconds on a busy box and are not what these tests time). Yields (workers, watchdog)."""
    hb = Heartbeats([name], tmp_path / "stacks")
    with Workers(join_timeout=join_timeout) as w:
        w.start(name, fn, beat=hb.beat_for(name))
        assert w.wait_event(lambda: hb.row(name)[1] not in ("spawning", "starting"), timeout=60)
        yield w, w.watch(hb, timeout=timeout, action=action)


def test_hung_worker_is_named_with_phase_and_stack(tmp_path):
    with _watched(tmp_path, "reward0", _hang_in_reward, timeout=1.5) as (w, _):
        t = time.monotonic()
        with pytest.raises(WorkerStalled) as e:
            w.wait_event(lambda: False, timeout=30)
        assert time.monotonic() - t < 10  # within the timeout (+ the stack dump), not the wait's 30 s
    msg = str(e.value)
    assert "'reward0'" in msg and "phase 'scoring' on request 7" in msg and "no progress for" in msg
    assert "_hang_in_reward" in msg and "test_watchdog.py" in msg  # the worker's own Python stack
    assert not w.alive()


def test_waiting_worker_that_beats_is_not_flagged(tmp_path):
    with _watched(tmp_path, "generator0", _wait_but_beat, timeout=1.0) as (w, _):
        assert w.wait_event(lambda: False, timeout=3.5) is False  # waited it out, no stall raised


def test_warn_mode_reports_and_keeps_going(tmp_path, capsys):
    with _watched(tmp_path, "reward0", _hang_in_reward, timeout=1.0, action="warn") as (w, dog):
        w.wait_event(lambda: dog.n_reports >= 2, timeout=30)
        assert w.alive() == ["reward0"]  # still running: warn never stops the run
    err = capsys.readouterr().err
    assert err.count("still waiting") >= 2 and "_hang_in_reward" in err


def test_stopped_process_is_reported_as_stopped(tmp_path):
    with _watched(tmp_path, "generator0", _wait_but_beat, timeout=1.0, join_timeout=2) as (w, _):
        os.kill(w.pid_of("generator0"), signal.SIGSTOP)  # a hang the worker cannot see
        with pytest.raises(WorkerStalled, match=r"(?s)state T\).*phase 'waiting'.*process is stopped") as e:
            w.wait_event(lambda: False, timeout=30)
    assert "generator0" in str(e.value) and not w.alive()  # and shutdown still removed it


@pytest.mark.slow  # the suite's time: 13 s to see nothing happen
def test_timeout_zero_is_off(tmp_path):
    with _watched(tmp_path, "reward0", _hang_in_reward, timeout=0) as (w, _):
        assert w.wait_event(lambda: False, timeout=2.0) is False


def hang_reward(tokens, meta) -> float:
    """A reward function that never returns (a grader blocked on a dead server)."""
    while True:
        time.sleep(3600)


def test_trainer_stops_on_a_hung_reward_with_a_checkpoint(tmp_path):
    from common.train import train
    from tests.test_e2e import _cfg, _prompts, _tba
    cfg = _cfg(tmp_path, steps=3, stall_timeout=15.0)  # > spawn + imports + tiny model load here
    t = time.monotonic()
    with pytest.raises(WorkerStalled) as e:
        train(cfg, _tba(cfg), _prompts(), hang_reward, stop_token_ids=())
    msg = str(e.value)
    assert "'generator0'" in msg and "phase 'scoring'" in msg and "hang_reward" in msg
    assert time.monotonic() - t < 120
    ckpts = list((tmp_path / "runs" / cfg.name / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and (ckpts[0] / "trainer_state.pt").exists()  # the work so far is kept
