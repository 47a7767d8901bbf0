"""Tests for common.runtime.launch: failure propagation, clean/forced shutdown, Ctrl-C, no leaks.
Worker functions are module-level so the spawn start method can pickle them by name."""
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from common.runtime import spawn
from common.runtime.launch import WorkerError, Workers
from bench.leaks import leaked, shm_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- worker functions (run in spawned children) ----------------------------------------------
def _raise_boom(ready, stop_event):
    ready.put(os.getpid())
    time.sleep(0.5)
    raise ValueError("boom 42")


def _hard_exit(stop_event):
    os._exit(3)


def _loop_until_stop(ready=None, *, stop_event):
    if ready is not None:
        ready.put(os.getpid())
    while not stop_event.wait(0.05):
        pass


def _ignore_stop(ready, ignore_sigterm=False, *, stop_event):
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.put(os.getpid())
    while True:
        time.sleep(1)


def _write_shared(t, stop_event):
    t += torch.arange(1.0, 5.0)
    while not stop_event.wait(0.05):
        pass


# ---- helpers -----------------------------------------------------------------------------------
def _shm():
    return shm_entries()


def _ours(w):
    """The pids whose /dev/shm entries this test could own: this process and its workers. Others'
    entries (another program's live semaphore, say) are ignored (bench/leaks.py), so concurrent
    runs on the machine can't make this flaky."""
    return {os.getpid()} | {p.pid for p in w.procs.values()}


def _leaked(before, ours):
    """Our new /dev/shm entries once everything is released. Spawn-context semaphores are named
    and unlinked when their owner is collected, hence the gc.collect(); one this process still
    holds counts (it is ours and should have been released)."""
    gc.collect()
    return leaked(before, ours)


def _assert_all_gone(w):
    assert all(not p.is_alive() for p in w.procs.values())
    assert all(p.exitcode is not None for p in w.procs.values())  # reaped, not zombies
    assert not [c for c in multiprocessing.active_children() if c in w.procs.values()]
    assert w.alive() == []


def _pid_state(pid):
    """None once the process is gone (reaped), else its /proc state letter ("Z" = zombie)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:")).split()[1]
    except (ProcessLookupError, FileNotFoundError):
        return None


# ---- tests -------------------------------------------------------------------------------------
def test_child_exception_reraised_with_traceback():
    before = _shm()
    w = Workers(join_timeout=5)
    ready = w.queue()
    w.start("boom", _raise_boom, ready)
    w.start("idle", _loop_until_stop)
    ready.get(timeout=30)  # "boom" is running (spawn start-up, i.e. importing torch, is over)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as ei:
        while time.monotonic() - t0 < 15:
            w.check()
            time.sleep(0.05)
    assert time.monotonic() - t0 < 5  # fails 0.5 s after start; noticed well within 5 s
    msg = str(ei.value)
    assert "boom 42" in msg and "_raise_boom" in msg and "'boom'" in msg
    assert "Traceback" in msg
    _assert_all_gone(w)
    assert w.procs["idle"].exitcode == 0  # sibling saw stop_event and returned on its own
    ours = _ours(w)
    assert leaked(before, ours)  # the check does see our live semaphores (this process holds them)
    del w, ei, ready
    assert _leaked(before, ours) == set()


def test_silent_death_reports_exit_code():
    with Workers(join_timeout=5) as w:
        w.start("exiter", _hard_exit)
        with pytest.raises(WorkerError, match=r"'exiter'.*exit code 3"):
            w.wait_event(lambda: False, timeout=15)
    _assert_all_gone(w)


def test_shutdown_joins_cooperative_and_terminates_stubborn():
    # A cooperative torch worker needs ~0.5 s (2 s on a loaded box) of interpreter teardown.
    w = Workers(join_timeout=4.0)
    ready = w.queue()
    for i in range(2):
        w.start(f"loop{i}", _loop_until_stop, ready)
    w.start("stubborn", _ignore_stop, ready)
    w.start("very_stubborn", _ignore_stop, ready, ignore_sigterm=True)
    pids = {ready.get(timeout=30) for _ in range(4)}  # all running (SIGTERM handler installed)
    assert pids == {p.pid for p in w.procs.values()}
    assert sorted(w.alive()) == ["loop0", "loop1", "stubborn", "very_stubborn"]
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 4.0 + 5  # join timeout + SIGTERM grace + SIGKILL grace
    _assert_all_gone(w)
    assert w.procs["loop0"].exitcode == 0 and w.procs["loop1"].exitcode == 0
    assert w.procs["stubborn"].exitcode == -signal.SIGTERM
    assert w.procs["very_stubborn"].exitcode == -signal.SIGKILL
    w.shutdown()  # idempotent
    w.check()     # no-op after shutdown: our own SIGTERM/SIGKILL are not worker failures


def test_context_manager_shuts_down_on_body_exception():
    with pytest.raises(KeyError, match="body"):
        with Workers(join_timeout=5) as w:
            w.start("loop", _loop_until_stop)
            raise KeyError("body")
    assert w.stop_event.is_set()
    _assert_all_gone(w)


def test_shared_tensor_written_by_worker_without_shm_leak():
    # The strategy launch.py relies on; `file_system` would leave torch_* files after a crash.
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    before = _shm()
    t = torch.zeros(4).share_memory_()
    with Workers(join_timeout=5) as w:
        w.start("writer", _write_shared, t)
        assert w.wait_event(lambda: bool((t == torch.arange(1.0, 5.0)).all()), timeout=15)
    _assert_all_gone(w)
    ours = _ours(w)
    del t, w
    assert _leaked(before, ours) == set()


_CTRL_C_SCRIPT = """
import time, torch
torch.set_num_threads(1)
from common.runtime.launch import Workers

def sleeper(ready, stop_event):
    ready.put(1)
    while not stop_event.wait(0.05):
        pass

if __name__ == "__main__":
    with Workers(join_timeout=5) as w:
        ready = w.queue()
        w.start("a", sleeper, ready)
        w.start("b", sleeper, ready)
        ready.get(timeout=30); ready.get(timeout=30)
        print(*(p.pid for p in w.procs.values()), flush=True)
        print("ready", flush=True)
        while True:
            w.check()
            time.sleep(0.05)
"""


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_script(tmp_path, script_text=_CTRL_C_SCRIPT, preexec_fn=_sigint_default):
    """Start the script in its own session (so a group signal reaches only it and its workers);
    return (Popen, worker pids) once both workers are running. By default with SIGINT's default
    action, as a terminal's foreground job has it, whatever this process inherited (pytest run in
    the background of a non-interactive shell has SIGINT ignored, and a child inherits that)."""
    script = tmp_path / "launch_script.py"
    script.write_text(textwrap.dedent(script_text))
    env = dict(os.environ, PYTHONPATH=ROOT, ASYNCRL_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                            start_new_session=True, preexec_fn=preexec_fn,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert proc.stdout.readline().strip() == "ready"
        assert len(pids) == 2 and all(_pid_state(p) not in (None, "Z") for p in pids)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(proc.communicate(timeout=10)[1])
    return proc, pids


def test_ctrl_c_stops_cleanly(tmp_path):
    proc, pids = _run_script(tmp_path)
    try:
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # like a terminal's Ctrl-C: parent *and* workers
        _, err = proc.communicate(timeout=10)
        assert time.monotonic() - t0 < 10
        assert "KeyboardInterrupt" in err  # the parent re-raised it after shutting down
        assert "[worker" not in err        # workers ignored SIGINT and returned via stop_event
        assert [_pid_state(pid) for pid in pids] == [None, None]  # reaped: not even zombies
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_is_a_ctrl_c_to_the_trainer(tmp_path, sigint):
    """In `sigterm_as_interrupt` a SIGTERM to the parent alone stops it as a Ctrl-C would, also
    where the process started with SIGINT ignored (a background job of a script, nohup)."""
    script = _CTRL_C_SCRIPT.replace("    with Workers(join_timeout=5) as w:",
                                    "    from common.runtime.process import sigterm_as_interrupt\n"
                                    "    with sigterm_as_interrupt(), Workers(join_timeout=5) as w:")
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else _sigint_default
    proc, pids = _run_script(tmp_path, script, ignore)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert "KeyboardInterrupt" in err, err[-2000:]
        assert [_pid_state(pid) for pid in pids] == [None, None]  # the shutdown ran: workers reaped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILLed trainer (e.g. OOM killer): no shutdown runs, PR_SET_PDEATHSIG kills workers.
    Orphans are reaped by whatever init this box has, so a zombie ("Z") counts as dead here."""
    proc, pids = _run_script(tmp_path)
    try:
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_pid_state(p) not in (None, "Z") for p in pids):
            time.sleep(0.05)
        assert all(_pid_state(p) in (None, "Z") for p in pids)
    finally:  # if the test fails, don't leave orphans behind
        for pid in pids:
            if _pid_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()


class _Witness:
    """Sets `freed` when its unpickled copy in a worker is garbage-collected while that
    interpreter is still whole (the parent's own copy never sets it)."""

    def __init__(self, freed):
        self.freed, self.parent = freed, os.getpid()

    def __del__(self):
        if os.getpid() != self.parent and not sys.is_finalizing():
            self.freed.set()


def _hold_then_return(witness, stop_event):
    time.sleep(0.05)


def test_worker_releases_its_arguments_before_teardown():
    """A worker's arguments (the weight store and buffer: CUDA IPC tensors on GPU) are freed
    when its function returns, not left to interpreter teardown, where a CUDA IPC tensor may
    never tell the trainer it was released."""
    with Workers() as w:
        freed = w.ctx.Event()
        w.start("holder", _hold_then_return, _Witness(freed))
        assert freed.wait(30), "the worker's argument was still referenced when its function had returned"
        w.shutdown()


# ---- a worker that cannot start ---------------------------------------------------------------------
def _payload_len(data, *, stop_event):
    print("ran", len(data), flush=True)


def _shadow_common(tmp_path, body: str) -> str:
    """A folder whose `common` package runs `body` on import: put first on sys.path after this
    process imported the real one, it is what a child finds when it unpickles its process object
    (before `_worker_main` runs), as a sys.path changed after the imports would do."""
    (tmp_path / "shadow" / "common").mkdir(parents=True)
    (tmp_path / "shadow" / "common" / "__init__.py").write_text(body)
    return str(tmp_path / "shadow")


@pytest.mark.parametrize("size", [10, 4 << 20])  # 4 MiB: far more than a pipe holds
def test_a_worker_failing_before_its_function_runs_raises_with_its_traceback(tmp_path, monkeypatch, size):
    """It used to block `start` forever when its start-up data did not fit the pipe (the parent
    kept the pipe's read end open while it wrote), and said nothing of its cause when it did."""
    monkeypatch.syspath_prepend(_shadow_common(tmp_path, 'raise ImportError("no common here 41")'))
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        with Workers(join_timeout=5) as w:
            w.start("gen0", _payload_len, b"x" * size)
            w.wait_event(lambda: False, timeout=60)
    assert time.monotonic() - t0 < 30
    assert e.value.worker == "gen0" and "ImportError: no common here 41" in e.value.traceback
    msg = str(e.value)
    assert "'gen0'" in msg and "ImportError: no common here 41" in msg and "Traceback" in msg
    assert ("could not start" in msg) == (size > 1 << 20)  # the big payload: `start` itself raised
    _assert_all_gone(w)


def test_a_worker_stuck_before_reading_its_start_up_data_is_killed_and_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(_shadow_common(tmp_path, "import time\ntime.sleep(600)"))
    monkeypatch.setattr(spawn, "START_TIMEOUT_S", 3.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"'gen0' could not start: it did not read its start-up data within 3 s"):
        with Workers(join_timeout=5) as w:
            w.start("gen0", _payload_len, b"x" * (4 << 20))
    assert time.monotonic() - t0 < 30
    _assert_all_gone(w)
    assert w.procs["gen0"].exitcode == -signal.SIGKILL


def test_a_worker_failing_in_device_init_is_named_with_its_cause():
    with pytest.raises(WorkerError) as e:
        with Workers(join_timeout=5) as w:
            w.start("gen0", _payload_len, b"x", cuda_device="cuda:99")  # no such GPU anywhere
            w.wait_event(lambda: False, timeout=60)
    assert e.value.worker == "gen0" and "set_device" in e.value.traceback and "'gen0' failed" in str(e.value)


_NO_GUARD = """
import os, sys, time
sys.path.insert(0, {root!r})
with open({marker!r}, "a") as f:  # runs once per interpreter that runs this file
    f.write(f"{{os.getpid()}}\\n")
from common.runtime.launch import Workers

def report(q, data, *, stop_event):
    q.put(len(data))

with Workers(join_timeout=5) as w:  # no `if __name__ == "__main__":` guard
    q = w.queue()
    w.start("a", report, q, b"x" * (1 << 20))
    print("got", q.get(timeout=60), flush=True)
"""


@pytest.mark.parametrize("how", ["stdin", "file"])
def test_workers_start_from_stdin_and_never_rerun_the_main_file(tmp_path, how):
    """`python - <<EOF` (main file '<stdin>') works like `python -c`; a script without a main
    guard is not run again in its workers (spawn's standard re-import would start it again)."""
    marker = tmp_path / "runs.txt"
    code = _NO_GUARD.format(root=ROOT, marker=str(marker))
    if how == "file":
        (tmp_path / "script.py").write_text(code)
    args = [sys.executable, "-"] if how == "stdin" else [sys.executable, str(tmp_path / "script.py")]
    p = subprocess.run(args, input=code if how == "stdin" else None, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "ASYNCRL_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "got 1048576" in p.stdout
    assert len(marker.read_text().split()) == 1  # the parent alone ran the file


# ---- keep_freed_memory ---------------------------------------------------------------------------
_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    sys.path.insert(0, {root!r})
    from common.runtime.process import keep_freed_memory
    took = keep_freed_memory()
    def faults():
        x = torch.empty(64 << 18); x.fill_(1.0); del x  # 64 MiB of fp32, every page touched
    for _ in range(20):  # kept: the heap grows for the first few (fragments), then stays put
        faults()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        faults()
    print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
""")


def _faults_per_alloc(how: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS.format(root=ROOT)], capture_output=True, text=True,
                         env={**os.environ, "ASYNCRL_MALLOC": how}, timeout=120)
    assert out.returncode == 0, out.stderr
    took, faults = out.stdout.split()
    return took, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="mallopt is glibc's")
def test_freed_memory_is_kept_so_a_reallocation_faults_no_pages():
    took, kept = _faults_per_alloc("keep")
    system_took, system = _faults_per_alloc("system")
    assert (took, system_took) == ("True", "False")
    assert system > 8000, system  # glibc unmaps the 64 MiB block: all 16384 pages fault again
    assert kept < 100, kept       # kept: the heap is reused, no page faults again


def test_a_bad_malloc_setting_is_an_error(monkeypatch):
    from common.runtime.process import keep_freed_memory
    monkeypatch.setenv("ASYNCRL_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="ASYNCRL_MALLOC='jemalloc'"):
        keep_freed_memory()


def test_host_memory_bench_runs_both_policies(tmp_path):
    from tests.tiny import save_hf
    save_hf("llama_tied", tmp_path / "m")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_memory.py"), "--model", str(tmp_path / "m"),
                        "--steps", "3", "--tokens-per-step", "400", "--min-len", "50", "--max-len", "200"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for policy in ("keep", "system"):
        r = res[policy]
        assert r["policy"] == policy and len(r["rss_after_step_gib"]) == len(r["shapes"]) == 3
        assert r["wall_s"] > 0 and r["peak_rss_gib"] >= max(r["rss_after_step_gib"]) - 1e-3 > 0  # RSS rounded to MiB
    assert res["keep_vs_system_wall"] > 0
