"""How what a user passes reaches the worker processes: by value, with cloudpickle.

Runs in the launching process (pickling) and in every worker (unpickling, `Payload.load`).
Spawned workers get their function and arguments pickled. Plain pickle sends a function by
name, so one defined in a notebook (or `python -c`, or a script run as `__main__`), a lambda,
a closure or a class defined in a cell cannot be found in the child. cloudpickle (what Ray,
Dask and PySpark use for the same reason) sends those by value, with the globals and closure
cells they use; everything importable still goes by name. Its pickler here also carries
torch.multiprocessing's reducers, so shared-memory tensors, queues and events in the same
arguments travel as they always did (as handles, not copies).

What cannot be pickled even so (an open file for writing, a lock, a CUDA stream, a socket) is
refused before any process starts: `check_sendable` names the argument, the part of it that
failed (a global, a closure variable, an attribute) and pickle's reason.
"""
from __future__ import annotations

import functools
import inspect
import io
import pickle
import types
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler

import cloudpickle
import torch.multiprocessing  # noqa: F401 - importing it registers torch's tensor reducers on ForkingPickler

from common.contracts.errors import UserError

_SEARCH_DEPTH = 3  # how deep `_culprit` looks into an unpicklable object for the part to blame


class NotSendable(UserError, ValueError):
    """An argument cannot be pickled for a worker process (the message names it and why)."""


class _Pickler(cloudpickle.Pickler):
    """cloudpickle plus multiprocessing's and torch's reducers (shared tensors, queues, events,
    pipes: sent as handles, valid only while a process is being spawned)."""
    dispatch_table = ChainMap(ForkingPickler._extra_reducers, cloudpickle.Pickler.dispatch_table)


def dumps(obj, shared: bool = False) -> bytes:
    """obj pickled with cloudpickle. shared=True (only while spawning a process): tensors move
    to shared memory and travel as handles, as torch.multiprocessing sends them; False: every
    tensor is copied into the bytes."""
    if not shared:
        return cloudpickle.dumps(obj)
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


class Payload:
    """A worker's function and arguments, pickled (shared=True) when its process is spawned and
    unpickled by the worker itself (`load`), where a failure is reported like any other error
    of the worker (an unknown class, a module the child cannot import, a `__setstate__` that
    raises) instead of killing the child before it could say why."""

    def __init__(self, name: str, obj):
        self.name, self.obj, self.data = name, obj, None

    def __reduce__(self):  # called by the spawn machinery, inside the spawning context
        if self.data is None:
            try:
                return (Payload._pickled, (self.name, dumps(self.obj, shared=True)))
            except Exception as e:
                raise NotSendable(f"worker {self.name!r}: {_blame(self.obj, e)}") from e
        return (Payload._pickled, (self.name, self.data))

    @staticmethod
    def _pickled(name: str, data: bytes) -> "Payload":
        p = Payload(name, None)
        p.data = data
        return p

    def load(self):
        """The object (in the worker): unpickled once, then dropped from here."""
        data, self.data = self.data, None
        return pickle.loads(data)


def check_sendable(**named) -> None:
    """Raise NotSendable naming the first of `named` (None values skipped) that cloudpickle
    cannot pickle, with the part of it to blame and pickle's reason."""
    for name, obj in named.items():
        if obj is None:
            continue
        try:
            dumps(obj)
        except Exception as e:
            raise NotSendable(f"{name} cannot be sent to a worker process: {_reason(obj, e)}") from e


def _call_args(fn, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """[(parameter name, value)] of a call fn(*args, **kwargs), positions when unbindable."""
    try:
        return list(inspect.signature(fn).bind_partial(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):
        return [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())


def _blame(obj, err: Exception) -> str:
    """For a Payload ([fn, args, kwargs]) that failed to pickle: which argument, and why."""
    fn, args, kwargs = obj
    for name, value in [("the function", fn), *_call_args(fn, args, kwargs)]:
        try:
            dumps(value, shared=True)
        except Exception as e:
            return f"{name} cannot be sent to it: {_reason(value, e)}"
    return f"arguments cannot be sent to it: {type(err).__name__}: {err}"


def _reason(obj, err: Exception) -> str:
    where = _culprit(obj, _SEARCH_DEPTH)
    part = f"{where[0]} ({type(where[1]).__module__}.{type(where[1]).__qualname__}) " if where else ""
    return (f"{part}cannot be pickled ({type(err).__name__}: {err}). Functions, lambdas, closures and classes "
            f"(also ones defined in a notebook) are sent by value; an open file, a lock, a socket or a CUDA "
            f"stream cannot be: create it inside the worker (e.g. on first call, or in a reward factory)")


def _parts(obj):
    """(label, value) of what pickling `obj` by value pickles next."""
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for n, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield f"closure variable {n!r}", cell.cell_contents
            except ValueError:  # an empty cell
                pass
        for n in sorted(_global_names(code)):
            if n in obj.__globals__:
                yield f"global {n!r}", obj.__globals__[n]
        for i, d in enumerate(obj.__defaults__ or ()):
            yield f"default {i}", d
    elif isinstance(obj, functools.partial):
        yield "function", obj.func
        yield from ((f"argument {i}", a) for i, a in enumerate(obj.args))
        yield from ((f"keyword {k!r}", a) for k, a in obj.keywords.items())
    elif isinstance(obj, types.MethodType):
        yield "object", obj.__self__
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from ((f"item {i}", a) for i, a in enumerate(obj))
    elif isinstance(obj, dict):
        yield from ((f"key {k!r}", a) for k, a in obj.items())
    elif not isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None), dict):
        yield from ((f"attribute {k!r}", a) for k, a in vars(obj).items())


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _culprit(obj, depth: int) -> tuple[str, object] | None:
    """The deepest part of `obj` that fails to pickle on its own, as ("a -> b", value)."""
    if depth == 0 or isinstance(obj, types.ModuleType):
        return None
    for label, value in _parts(obj):
        if isinstance(value, types.ModuleType):
            continue  # sent by name
        try:
            cloudpickle.dumps(value)
        except Exception:
            deeper = _culprit(value, depth - 1)
            return (f"{label} -> {deeper[0]}", deeper[1]) if deeper else (label, value)
    return None
