"""The spawn start method, made safe to start from anywhere and to fail loudly.

Runs in the launching process (`Context`, `Popen`) and, for its first lines, in every child (the
bootstrap in `_BOOT`). `Workers` (common/runtime/launch.py) starts every process of the runtime
through `Context`. Three changes to multiprocessing's own spawn (popen_spawn_posix):

1. A child never re-runs the parent's main module. Standard spawn re-imports it (as
   `__mp_main__`) so that objects pickled by reference to `__main__` resolve; here everything a
   worker gets from `__main__` travels by value (common/runtime/pickling.py: cloudpickle), so
   the re-run only costs time, and it fails where the main module is no file: under
   `python - <<EOF` its `__file__` is '<stdin>' and the child died with FileNotFoundError; a
   script without an `if __name__ == "__main__":` guard would start its run again in every
   child. Now `python -`, `python -c`, a notebook and a script start workers alike.
2. The parent never blocks on a child that is gone. Standard spawn writes a child's start-up
   data (the pickled process object: a worker's payload can be megabytes) in one blocking write
   into a pipe whose read end the parent itself keeps open until the write returns, so a child
   that dies before reading it all left the parent blocked forever, silent. Here the parent
   closes its copies of the child's ends first, then writes without blocking while it watches
   the child's sentinel (end of file when the child exits), and gives up after
   `START_TIMEOUT_S` on a child that lives but does not read (stuck in an import); that child
   is killed.
3. A child that dies before its function runs says why. Its bootstrap runs spawn's entry point
   inside a `try` and writes the traceback (its last `_TRACE_CHARS` characters) to an extra pipe
   as well as to stderr; `Popen.early_error()` reads it, so the caller can raise with the
   cause (in a notebook a child's stderr goes to the kernel's terminal, not to the notebook).
"""
from __future__ import annotations

import io
import multiprocessing.context as mp_context
import os
import select
import time
from multiprocessing import popen_spawn_posix, resource_tracker, spawn, util
from multiprocessing.context import reduction, set_spawning_popen

START_TIMEOUT_S = 120.0  # a live child that reads none of its start-up data for this long is stuck
_TRACE_CHARS = 16000     # the tail of an early traceback that goes through the pipe (it holds 64 KiB)
_CHUNK = 1 << 16

# The child's first code (python -c). SIGINT is ignored from the start: a terminal's Ctrl-C
# reaches the whole process group, and the parent alone handles it (launch.py: shutdown).
_BOOT = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    from multiprocessing.spawn import spawn_main
    spawn_main(tracker_fd={tracker}, pipe_handle={pipe})
except SystemExit:
    raise
except BaseException:
    import traceback
    tb = traceback.format_exc()
    sys.stderr.write(tb)
    os.write({err}, tb[-{chars}:].encode("utf-8", "replace"))
    sys.exit(1)
"""


class Popen(popen_spawn_posix.Popen):
    """popen_spawn_posix.Popen with the three changes of the module docstring. After `_launch`,
    `start_failure` is None (the child has its start-up data) or why it could not be given it."""

    start_failure: str | None = None
    _early = ""  # what early_error() has read so far

    def _launch(self, process_obj):
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep = spawn.get_preparation_data(process_obj._name)
        prep.pop("init_main_from_path", None)  # (1): the child runs no main module
        prep.pop("init_main_from_name", None)
        fp = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, fp)
            reduction.dump(process_obj, fp)
        finally:
            set_spawning_popen(None)
        parent_r, child_w = os.pipe()  # the sentinel: end of file once the child (holding child_w) exits
        child_r, parent_w = os.pipe()  # start-up data
        err_r, err_w = os.pipe()       # an early traceback (3)
        child_fds = (child_r, child_w, err_w)
        try:
            boot = _BOOT.format(tracker=tracker_fd, pipe=child_r, err=err_w, chars=_TRACE_CHARS)
            cmd = [spawn.get_executable(), *util._args_from_interpreter_flags(), "-c", boot, "--multiprocessing-fork"]
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, [*self._fds, *child_fds])
        except BaseException:
            util.close_fds(parent_r, parent_w, err_r, *child_fds)
            raise
        util.close_fds(*child_fds)  # (2): from here only the child holds them
        self.sentinel, self._err = parent_r, err_r
        # parent_w stays open for the child's life: its end of file tells the child the parent died
        self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w, err_r))
        try:
            self.start_failure = _send(parent_w, fp.getbuffer(), parent_r, START_TIMEOUT_S)
        except BaseException:  # a Ctrl-C while it starts: the caller never gets this Popen, leave no child
            self.kill()
            self.wait()
            raise
        if self.start_failure is not None and self.poll(os.WNOHANG) is None:
            self.kill()  # alive but not reading: stuck; nothing is left running

    def early_error(self) -> str:
        """What the child's bootstrap wrote before it exited (a traceback), "" if nothing; the
        same text on every call (read once the child has exited: it is complete then)."""
        out = b""
        try:
            os.set_blocking(self._err, False)
            while chunk := os.read(self._err, _CHUNK):
                out += chunk
        except OSError:  # nothing (more) to read (BlockingIOError), or already closed
            pass
        self._early += out.decode("utf-8", "replace")
        return self._early


def _send(fd: int, data: memoryview, sentinel: int, timeout: float) -> str | None:
    """Write `data` into the pipe `fd` without ever blocking on it; None once all is written,
    else why not: the child exited (its sentinel ended) or read nothing for `timeout` seconds."""
    os.set_blocking(fd, False)
    poller = select.poll()  # not select(): it fails on descriptors above 1023 (a busy notebook)
    poller.register(sentinel, select.POLLIN)
    poller.register(fd, select.POLLOUT)
    deadline, view = time.monotonic() + timeout, data
    while len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            return f"it did not read its start-up data within {timeout:g} s (stuck while starting)"
        events = dict(poller.poll(min(left, 1.0) * 1000))
        if events.get(sentinel):
            return "it exited before it had read its start-up data"
        if events.get(fd, 0) & select.POLLERR:
            return "it closed its start-up pipe"
        if fd in events:
            try:
                n = os.write(fd, view[:_CHUNK])
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return "it exited before it had read its start-up data"
            deadline, view = time.monotonic() + timeout, view[n:]  # reading: the bound restarts
    return None


class Process(mp_context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        return Popen(process_obj)


class Context(mp_context.SpawnContext):
    """multiprocessing's spawn context with `Popen` (queues, events and locks as spawn's)."""
    Process = Process
