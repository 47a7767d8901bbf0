"""Range checks of typed configs (common/contracts/config.py), run over the whole tree before a run starts.

Each config section states the ranges of its fields in one class-level table below them,

    CHECKS = {"max_batch": at_least(1), "top_p": between(0, 1, open_lo=True), "top_k": at_least(0)}

keyed by field name (or by a dotted path below the section, for a rule across sections), valued by
a rule or a tuple of rules. `check(cfg)` walks the tree depth first (a section's fields before its
own rules across them) and raises `ConfigError` at the first value out of range, naming the full
key, the value, the range and the field's comment:

    --gen.max_batch=0: must be >= 1 (sampler slots per generator process)

A range passes None where the field is Optional (its comment says what None means); a relation
sees None. Whatever the rules, a float field is refused NaN and +-inf, an int field a value
outside int64, and a numeric field a value of another type (a config built in Python). A contract:
imports only common/contracts/config.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args, get_origin

from common.contracts.config import ConfigError, _comments, _hints, _is_union

_INT64 = 2**63
MAX_PROCESSES = 1024  # processes of one kind a run may start on one node: more is a typo, and a fork storm


@dataclass(frozen=True)
class Rule:
    test: Callable[[Any, Any], bool]  # (value, the section holding the table) -> in range
    text: str                         # what "must be" ...; formatted with s = that section, p = its "--key." prefix
    none_ok: bool = True              # None passes (ranges); relations are asked about None too


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def at_least(lo: float) -> Rule:
    return Rule(lambda v, s: v >= lo, f">= {_num(lo)}")


def above(lo: float) -> Rule:
    return Rule(lambda v, s: v > lo, f"> {_num(lo)}")


def between(lo: float, hi: float, open_lo: bool = False, open_hi: bool = False) -> Rule:
    def test(v, s):
        return (v > lo if open_lo else v >= lo) and (v < hi if open_hi else v <= hi)
    return Rule(test, f"in {'(' if open_lo else '['}{_num(lo)}, {_num(hi)}{')' if open_hi else ']'}")


def processes(lo: int = 1) -> Rule:
    """A count of processes this run starts."""
    return between(lo, MAX_PROCESSES)


def any_finite() -> Rule:
    """Any number (the walker refuses NaN and +-inf)."""
    return Rule(lambda v, s: True, "finite")


def relation(test: Callable[[Any, Any], bool], text: str) -> Rule:
    """A rule on a value and others of its section: `text` may name them as "{p}field={s.field}"."""
    return Rule(test, text, none_ok=False)


def _numeric(tp: Any) -> tuple[type | None, bool]:
    """(int or float or None, whether None is allowed) of a field's type."""
    args = get_args(tp) if _is_union(tp) else (tp,)
    kinds = [a for a in args if a in (int, float)]
    return (kinds[0] if len(kinds) == 1 else None), type(None) in args


def _fmt(v: Any) -> str:
    return "none" if v is None else repr(v) if isinstance(v, (float, str)) else str(v)


def _refuse(key: str, v: Any, must: str, comment: str) -> ConfigError:
    return ConfigError(f"--{key}={_fmt(v)}: must be {must}" + (f" ({comment})" if comment else ""))


def _words(tp: Any) -> tuple:
    """The strings a numeric field also takes (`int | Literal["auto"]`)."""
    args = get_args(tp) if _is_union(tp) else (tp,)
    return tuple(w for a in args if get_origin(a) is Literal for w in get_args(a))


def _check_value(key: str, v: Any, tp: Any, comment: str) -> None:
    kind, none_ok = _numeric(tp)
    if kind is None or (v is None and none_ok) or (isinstance(v, str) and v in _words(tp)):
        return
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise _refuse(key, v, f"{'an int' if kind is int else 'a number'}{', or none' if none_ok else ''}", comment)
    if isinstance(v, float) and not math.isfinite(v):
        raise _refuse(key, v, "finite", comment)
    if isinstance(v, int) and not -_INT64 <= v < _INT64:
        raise _refuse(key, v, "within int64", comment)


def _table(cls: type) -> dict[str, Any]:
    """`cls`'s CHECKS merged with its bases' (a task's config adds to RunConfig's, never drops them)."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        out.update(vars(klass).get("CHECKS", {}))
    return out


def _owner(cfg: Any, key: str) -> tuple[Any, str]:
    *path, name = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    return cfg, name


def check(cfg: Any, prefix: str = "") -> Any:
    """`cfg` (a tree of config dataclasses) with every value in range, else `ConfigError` naming the
    first one out of range; returns `cfg` unchanged. `prefix`: the dotted key of `cfg` itself
    ("train." for a TrainConfig checked alone)."""
    if not dataclasses.is_dataclass(cfg):
        return cfg
    hints, comments = _hints(type(cfg)), _comments(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            check(v, f"{prefix}{f.name}.")
        else:
            _check_value(prefix + f.name, v, hints[f.name], comments.get(f.name, ""))
    for key, rules in _table(type(cfg)).items():
        owner, name = _owner(cfg, key)
        v = getattr(owner, name)
        for r in rules if isinstance(rules, tuple) else (rules,):
            if (v is None and r.none_ok) or r.test(v, cfg):
                continue
            must = r.text.format(s=cfg, p=f"--{prefix}")  # a relation says why itself: no field comment
            raise _refuse(prefix + key, v, must, "" if not r.none_ok else _comments(type(owner)).get(name, ""))
    return cfg


def unchecked(cfg: Any, prefix: str = "") -> list[str]:
    """The dotted keys of numeric fields no section's table names (for the tests: every numeric
    setting has a range)."""
    named = {prefix + k for k in _table(type(cfg))}
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out += unchecked(v, f"{prefix}{f.name}.")
        elif _numeric(_hints(type(cfg))[f.name])[0] is not None and prefix + f.name not in named:
            out.append(prefix + f.name)
    return [k for k in out if k not in named]

