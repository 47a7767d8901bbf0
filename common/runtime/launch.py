"""Process launcher of the async runtime: the trainer stays in the launching (main) process,
every other role (generators, optional reward workers) runs in a spawned worker process.

Who runs what
-------------
* main process: builds a `Workers`, calls `start(name, fn, ...)` once per worker, then runs the
  training loop, calling `Workers.check()` every step (cheap: one pipe poll + one waitpid each).
* worker process: `_worker_main` caps torch's CPU threads, unpickles `fn` and its arguments,
  then runs `fn(*args, stop_event=stop_event, **kwargs)`. `fn` must take `stop_event` by
  keyword (after its positional parameters), poll it and return once it is set. `fn` and its
  arguments travel by value where they cannot by name (`common/runtime/pickling.py`:
  cloudpickle, so functions and classes defined in a notebook work), shared tensors, queues
  and events as handles.

Processes are started with the *spawn* method: forking a process that has touched CUDA is
unsafe, and spawn gives every worker a clean interpreter. Ours (`common/runtime/spawn.py`) never
re-runs the parent's main module in a child (so `python - <<EOF`, `python -c`, a notebook and a
script start workers alike), never blocks on a child that died while starting, and keeps the
traceback of one that died before its function ran. Anything shared with workers (queues,
events, shared-memory tensors) must come from `Workers.ctx` / `Workers.queue()`.

Shutdown protocol
-----------------
1. A worker raising (in `fn`, or before it: unpickling its arguments, an import, device init)
   puts `(name, formatted traceback)` on the error queue, sets `stop_event` (so its siblings
   wind down) and exits with code 1. One that fails earlier still, before `_worker_main` runs
   (an import while its process object is unpickled), leaves its traceback in its start-up
   error pipe (spawn.py). A worker dying without a word (signal, `os._exit`, segfault) shows up
   as a non-zero exit code.
2. The next `check()` (or `wait_event`, or leaving the `with` block) sees any of these, shuts
   down and raises `WorkerError` carrying the child's traceback, so the run ends within seconds;
   `start()` itself raises it for a child that died (or got stuck) before it had read its
   start-up data.
3. `shutdown()` (idempotent) SIGKILLs workers the watchdog reported hung (they cannot honour
   `stop_event`), sets `stop_event`, joins everyone against one deadline, then
   SIGTERMs stragglers, then SIGKILLs them; every join has a timeout and every child is reaped
   (no zombies). Even a cooperative worker needs ~0.5 s after `fn` returns (interpreter
   teardown with torch loaded; more on a busy box), hence the 10 s default. Queues get
   `cancel_join_thread()` so a feeder thread stuck on a full pipe to a dead reader can never
   hang interpreter exit.
4. Ctrl-C: workers ignore SIGINT (a terminal sends it to the whole process group) so only the
   main process reacts; its KeyboardInterrupt leaves the `with` block, which shuts down and
   re-raises. If the main process is SIGKILLed (e.g. OOM killer), Linux kills the workers via
   PR_SET_PDEATHSIG, so they never linger holding GPU memory. That signal fires when the *thread*
   that started the worker exits, so call `start()` from the main thread.
5. SIGTERM (torchrun's agents ending a job, Slurm's preemption, `kill`): inside
   `process.sigterm_as_interrupt()` the main process takes it as its own Ctrl-C, so it too ends in a
   checkpoint and a clean shutdown instead of an instant death.

/dev/shm: shared CPU tensors use torch's `file_descriptor` sharing strategy (Linux default):
segments travel as fds and are unlinked at once, so nothing is left behind. (Don't switch to
`file_system`: its `torch_<pid>_*` files survive a crashed process.) The spawn context's
Event/Queues are named semaphores (`sem.mp-*`); each is unlinked when its Python object is
garbage-collected, i.e. when the `Workers` (and any queue you kept) goes away, or at exit.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import time
import traceback

import torch

from common.runtime.pickling import Payload
from common.runtime.process import cap_threads
from common.runtime.spawn import Context
from common.runtime.watchdog import Watchdog, WorkerStalled

_TERM_GRACE_S = 2.0   # how long SIGTERM / SIGKILL get before we give up waiting on a process


class WorkerError(RuntimeError):
    """A worker process failed; the message names it and holds the child's full traceback
    (the original exception's type, message and frames). `worker`: its name; `traceback`:
    the child's formatted traceback ("" when it died without one, e.g. killed)."""

    def __init__(self, message: str, worker: str = "", traceback: str = ""):
        super().__init__(message)
        self.worker, self.traceback = worker, traceback


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the parent dies, so an OOM-killed trainer leaves no orphans."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux / no glibc: best effort only
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # parent died before prctl took effect
        os._exit(1)


def _worker_main(name, payload: Payload, stop_event, error_queue, cuda_device: str | None = None) -> None:
    """Entry point of every worker process (runs in the child). payload = [fn, args, kwargs],
    unpickled here, inside the error handling, into a list that is emptied while the process is
    whole (see the `finally`). cuda_device: the worker's GPU, made current before the payload is
    unpickled, so that opening the trainer's CUDA IPC handles (the weight store) creates no
    context on another GPU, outside that GPU's memory caps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    # Thread cap applies to every worker's CPU-side ops; a GPU worker's kernels are unaffected.
    # A worker that runs a model calls set_process_defaults(its device) too (generators, ranks).
    cap_threads()
    call: list = []
    try:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        call += payload.load()  # [fn, args, kwargs]: a failure here is reported like fn's own
        fn, args, kwargs = call
        fn(*args, stop_event=stop_event, **kwargs)
    except KeyboardInterrupt:  # parent handles Ctrl-C and will stop us via stop_event
        return
    except Exception:
        tb = traceback.format_exc()
        print(f"[worker {name}] failed:\n{tb}", file=sys.stderr, flush=True)  # in logs even if
        error_queue.put((name, tb))  # ... the parent never calls check(); flushed at exit
        stop_event.set()
        sys.exit(1)
    finally:
        # Drop the shared tensors this worker received (weight store, buffer) while the process
        # is whole: a CUDA IPC tensor tells its producer (the trainer) it is released only when
        # it is freed, and the call that started us keeps its arguments alive into interpreter
        # teardown, where that may never happen ("Producer process has been terminated before
        # all shared CUDA tensors released").
        call.clear()
        fn = args = kwargs = None  # noqa: F841 - this frame's own references
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()


class Workers:
    """Context manager owning spawned workers, a shared stop Event and an error Queue."""

    def __init__(self, join_timeout: float = 10.0):
        self.join_timeout = join_timeout
        self.ctx = Context()  # spawn, safe to start from stdin and never blocking (spawn.py)
        self.stop_event = self.ctx.Event()
        self.error_queue = self.ctx.Queue()
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self._queues = [self.error_queue]
        self._closed = False
        self.watchdog = None  # common/runtime/watchdog.py: set by watch(); check() runs it
        self._hung: set[str] = set()  # workers the watchdog found stalled

    def watch(self, hb, timeout: float, action: str = "stop"):
        """Check the workers named in `hb` for stalls on every check() (timeout 0 = off)."""
        self.watchdog = Watchdog(hb, self.pid_of, timeout, action)
        return self.watchdog

    def pids(self) -> dict[str, int]:
        """{name: pid} of every started worker (for `py-spy dump --pid`, gdb, fault injection)."""
        return {n: p.pid for n, p in self.procs.items()}

    def pid_of(self, name: str) -> int | None:
        p = self.procs.get(name)
        return p.pid if p is not None and p.is_alive() else None

    # ---- starting -------------------------------------------------------------------------
    def queue(self, maxsize: int = 0):
        """A spawn-context Queue that shutdown() will close (so it can't hang the exit)."""
        q = self.ctx.Queue(maxsize)
        self._queues.append(q)
        return q

    def start(self, name: str, fn, *args, cuda_device: str | None = None, **kwargs) -> None:
        """Spawn worker `name` running fn(*args, stop_event=..., **kwargs). An argument that
        cannot be pickled raises `NotSendable` here, naming it, and no process is left.
        cuda_device ("cuda:N"): the GPU the worker runs on, current before its arguments are
        unpickled (`_worker_main`). A child that exits, or gets stuck, before it has read its
        start-up data raises WorkerError here (everything started is stopped first)."""
        if self._closed:
            raise RuntimeError("Workers already shut down")
        if name in self.procs:
            raise ValueError(f"duplicate worker name {name!r}")
        p = self.ctx.Process(target=_worker_main, name=name, daemon=True,
                             args=(name, Payload(name, [fn, args, kwargs]), self.stop_event, self.error_queue,
                                   cuda_device))
        p.start()
        self.procs[name] = p
        if p._popen.start_failure is not None:
            p.join(_TERM_GRACE_S)  # it has exited, or was killed as stuck: reap it
            tb = p._popen.early_error()
            cause = f"; its traceback:\n{tb}" if tb else f" (exit code {p.exitcode}; see its stderr)"
            err = WorkerError(f"worker {name!r} could not start: {p._popen.start_failure}{cause}", name, tb)
            self.shutdown()
            raise err

    # ---- monitoring -----------------------------------------------------------------------
    def _pending_error(self) -> WorkerError | None:
        """The first failure to report, or None. Exit codes are read *before* the queue: a
        failing child flushes its traceback into the pipe before it exits, so if we see the exit
        code the traceback is already readable and we report that instead of a bare code."""
        dead = [(n, p.exitcode) for n, p in self.procs.items() if p.exitcode not in (None, 0)]
        try:
            name, tb = self.error_queue.get_nowait()
            return WorkerError(f"worker {name!r} failed:\n{tb}", name, tb)
        except Exception:  # queue.Empty (or a truncated message from a killed writer)
            pass
        if dead:
            name, code = dead[0]
            tb = self.procs[name]._popen.early_error()
            if tb:  # it failed before its function ran (spawn.py keeps that traceback)
                return WorkerError(f"worker {name!r} failed before its function ran:\n{tb}", name, tb)
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 else
                   "os._exit, or failed while Python started it: see its stderr")
            return WorkerError(f"worker {name!r} died with exit code {code} ({how})", name)
        return None

    def check(self) -> None:
        """Raise WorkerError (after shutting everything down) if any worker failed, or
        WorkerStalled (workers left running: the caller checkpoints, then leaves the `with`
        block, which stops them) if the watchdog finds one that stopped making progress."""
        if self._closed:
            return
        err = self._pending_error()
        if err is not None:
            self.shutdown()
            raise err
        if self.watchdog is not None:
            try:
                self.watchdog.check()
            except WorkerStalled as e:
                self._hung.add(e.worker)  # shutdown() will not wait for it to stop by itself
                raise

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.is_alive()]

    def wait_event(self, event_or_callable, timeout: float) -> bool:
        """Wait up to `timeout` s for an Event (or a callable returning truthy), calling check()
        every ~0.1 s so a worker crash during the wait raises instead of waiting it out."""
        cond = getattr(event_or_callable, "is_set", event_or_callable)
        deadline = time.monotonic() + timeout
        while True:
            if cond():
                return True
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.1, left))

    # ---- shutdown -------------------------------------------------------------------------
    def _join_all(self, procs, deadline: float) -> list:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [p for p in procs if p.is_alive()]

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every worker; returns within about timeout + 2 * _TERM_GRACE_S seconds."""
        if self._closed:
            return
        self._closed = True
        self.stop_event.set()
        timeout = self.join_timeout if timeout is None else timeout
        procs, interrupted = list(self.procs.values()), False
        for n in self._hung:  # stuck in a call (or SIGSTOPped): it will never see stop_event
            self.procs[n].kill()
        try:
            left = self._join_all(procs, time.monotonic() + timeout)  # polite: honour stop_event
            for p in left:
                p.terminate()  # SIGTERM: a worker stuck in a blocking call ignores stop_event
            left = self._join_all(left, time.monotonic() + _TERM_GRACE_S)
        except KeyboardInterrupt:  # a second Ctrl-C while waiting: skip straight to SIGKILL
            interrupted, left = True, [p for p in procs if p.is_alive()]
        for p in left:
            p.kill()           # SIGKILL: last resort for one that ignores or blocks SIGTERM
        left = self._join_all(left, time.monotonic() + _TERM_GRACE_S)
        if left:  # unkillable (uninterruptible sleep in a driver): report, don't hang
            print(f"[launch] workers still alive after kill: {[p.name for p in left]}",
                  file=sys.stderr)
        for q in self._queues:
            q.cancel_join_thread()  # never block exit flushing into a pipe nobody reads
            q.close()
        if interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # A crash in the body (e.g. a queue.get timeout) is often *caused* by a dead worker:
        # surface that worker's traceback, chained to the body's exception. Ctrl-C is kept as is.
        err = None
        if not self._closed and exc_type is not KeyboardInterrupt:
            err = self._pending_error()
        self.shutdown()
        if err is not None:
            raise err from exc
        return False  # re-raise the body's exception (KeyboardInterrupt included)
