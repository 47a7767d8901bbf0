"""Typed run configs: nested dataclasses + `--section.field=value` command-line overrides.

Run scripts define their config as plain (nested) dataclasses and call `cli(RunConfig())`;
trainers/loggers use `flatten` for logging and `save_config`/`load_config` to persist the
exact config next to a run. Values are converted and checked against each field's type
annotation, so a typo or a bad value fails loudly at startup instead of mid-run.

    cfg = cli(RunConfig())            # python run.py --tba.beta_final=0.004 --seed 3
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import io
import json
import os
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from common.contracts.errors import UserError

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_NONES = ("none", "null")


class ConfigError(UserError, ValueError):
    """A bad override or config file: unknown key, bad value, or malformed argument."""


# ----------------------------------------------------------------------------- type helpers

@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    # modules use `from __future__ import annotations`, so field.type is a string: resolve it
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """Human-readable type, e.g. `int | None`, `tuple[int, ...]`, `one of 'a', 'b'`."""
    if tp is type(None):
        return "None"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) in (tuple, list):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in get_args(tp))
        return f"{get_origin(tp).__name__}[{inner}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(s: str, tp: Any) -> Any:
    """Parse the string `s` as type `tp`; raises ValueError/TypeError when it does not fit."""
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):  # Optional[X] / X | None: try the members in declaration order
        if type(None) in args and s.lower() in _NONES:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _convert(s, a)
                except (ValueError, TypeError):
                    pass
        raise ValueError(s)
    if origin is Literal:  # compare as strings, but return the declared (typed) value
        for a in args:
            if str(a) == s:
                return a
        raise ValueError(s)
    if origin in (tuple, list):
        parts = [p.strip() for p in s.split(",") if p.strip()]  # "" -> empty sequence
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed-length tuple[int, str]
            if len(parts) != len(args):
                raise ValueError(s)
            return tuple(_convert(p, a) for p, a in zip(parts, args))
        elem = args[0] if args else str
        return origin(_convert(p, elem) for p in parts)
    if tp is bool:
        if s.lower() not in _BOOLS:
            raise ValueError(s)
        return _BOOLS[s.lower()]
    if tp in (int, float, str):
        return tp(s)  # float("1e-5") and float("3") both work; int("1.5") fails, as it should
    raise TypeError(f"unsupported field type {_type_name(tp)}")


def _keys(cfg: Any, prefix: str = ""):
    """Every dotted key of a config's values (not its sections), depth first."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        yield from _keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]


def _suggest(cfg: Any, parts: list[str], j: int, names: list[str]) -> list[str]:
    """Keys to suggest for `parts` (a dotted key) whose part j is not among `names`: the keys of
    the same name in any section (`--mode` -> `--train.mode`, `--gen.steps` -> `--train.steps`),
    else the closest name there (`--tba.beta_fnal` -> `--tba.beta_final`), else the keys of the
    closest name in any section."""
    keys = list(_keys(cfg))
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    if parts[-1] in by_name:
        return by_name[parts[-1]][:3]
    close = difflib.get_close_matches(parts[j], names, n=1)
    here = ".".join(parts[:j] + close + parts[j + 1:])
    if close and (j == len(parts) - 1 or here in keys):  # a section's name mistyped: only where the rest exists
        return [here]
    return [k for name in difflib.get_close_matches(parts[-1], list(by_name), n=1) for k in by_name[name]][:3]


def _resolve(cfg: Any, key: str) -> tuple[Any, str, Any]:
    """Walk a dotted key to (object holding the field, field name, field type)."""
    obj, parts = cfg, key.split(".")
    for j, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        where = ".".join(parts[:j])
        if part not in names:
            msg = f"unknown key '--{key}'"
            close = _suggest(cfg, parts, j, names)
            if close:
                msg += "; did you mean " + " or ".join(f"'--{k}'" for k in close) + "?"
            level = f"in section '{where}'" if where else "at top level"
            raise ConfigError(f"{msg}\nvalid keys {level}: {', '.join(names)}")
        tp = _hints(type(obj))[part]
        if j == len(parts) - 1:
            if _is_section(tp) or dataclasses.is_dataclass(getattr(obj, part)):
                raise ConfigError(f"'--{key}' is a section, not a value; set its fields "
                                  f"instead, e.g. --{key}.<field>=...")
            return obj, part, tp
        obj = getattr(obj, part)
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"'--{key}': '{'.'.join(parts[:j + 1])}' is a "
                              f"{_type_name(tp)} field, not a section")


def parse_overrides(cfg: Any, argv: list[str]) -> Any:
    """Return a deep copy of `cfg` with `--a.b=v` / `--a.b v` / bare `--flag` overrides applied."""
    new, i = copy.deepcopy(cfg), 0
    while i < len(argv):
        tok, i = argv[i], i + 1
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected positional argument {tok!r}; use --key=value")
        key, eq, value = tok[2:].partition("=")
        obj, name, tp = _resolve(new, key)
        if not eq:  # two-token form, or a bare boolean flag
            nxt = argv[i] if i < len(argv) else None
            is_bool = tp is bool or (_is_union(tp) and bool in get_args(tp))
            if is_bool and (nxt is None or nxt.lower() not in _BOOLS):
                value = "true"
            elif nxt is not None and not nxt.startswith("--"):  # "-1e-5" is a value, not a key
                value, i = nxt, i + 1
            else:
                raise ConfigError(f"'--{key}' needs a value ({_type_name(tp)})")
        try:
            setattr(obj, name, _convert(value, tp))
        except (ValueError, TypeError) as e:
            why = f" ({e})" if isinstance(e, TypeError) else ""
            raise ConfigError(f"bad value for '--{key}': expected {_type_name(tp)}, "
                              f"got {value!r}{why}") from None
    return new


@functools.lru_cache(maxsize=None)
def _comments(cls: type) -> dict[str, str]:
    """Field name -> trailing `# comment` on its line in the class source ({} if no source)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # base classes first, so subclasses win
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
            # tokenize, not a regex: a '#' inside a string default is not a comment
            by_line = {t.start[0]: t.string.lstrip("#").strip()
                       for t in tokenize.generate_tokens(io.StringIO(src).readline)
                       if t.type == tokenize.COMMENT}
            body = ast.parse(src).body[0].body
        except (OSError, TypeError, SyntaxError, tokenize.TokenError, IndexError, AttributeError):
            continue
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.end_lineno in by_line:
                    out[node.target.id] = by_line[node.end_lineno]
    return out


def _leaves(cfg: Any, prefix: str = ""):
    """Yield (dotted key, value, type, comment) for every non-section field, depth first."""
    hints, comments = _hints(type(cfg)), _comments(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, value, hints[f.name], comments.get(f.name, "")


def flatten(cfg: Any) -> dict[str, Any]:
    """{"tba.beta_final": 0.004, ...}: one dotted key per leaf field (for logging, --help)."""
    return {k: v for k, v, _, _ in _leaves(cfg)}


def format_help(cfg: Any, description: str | None = None) -> str:
    rows = [(f"--{k}", _type_name(tp), repr(v), c) for k, v, tp, c in _leaves(cfg)]
    w = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    lines = [f"usage: {Path(sys.argv[0]).name} [--key=value | --key value | --flag] ..."]
    if description:
        lines += ["", description]
    lines += ["", "options (key, type, default):"]
    for key, tp, default, comment in rows:
        line = f"  {key:<{w[0]}}  {tp:<{w[1]}}  {default:<{w[2]}}"
        lines.append((line + f"  # {comment}") if comment else line.rstrip())
    return "\n".join(lines)


def cli(cfg: Any, argv: list[str] | None = None, description: str | None = None) -> Any:
    """Entry point for run scripts: apply overrides from argv (default sys.argv[1:])."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(cfg, description))
        sys.exit(0)
    try:
        return parse_overrides(cfg, argv)
    except ConfigError as e:
        print(f"error: {e}\n(run with --help to list all keys)", file=sys.stderr)
        sys.exit(2)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write cfg as JSON; temp file + rename so a crash never leaves a half-written config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    os.replace(tmp, path)


def _from_json(value: Any, tp: Any, key: str) -> Any:
    if _is_section(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' is a section ({tp.__name__}); expected an object, "
                              f"got {value!r}")
        return _build(tp, value, key + ".")
    if _is_union(tp):  # Optional[X]: None stays None, else decode as the first non-None member
        if value is None:
            return None
        return _from_json(value, next(a for a in get_args(tp) if a is not type(None)), key)
    if get_origin(tp) in (tuple, list) and isinstance(value, (list, tuple)):
        return get_origin(tp)(value)  # JSON has no tuples: restore them from the annotation
    return value


def _build(cls: type, d: dict[str, Any], prefix: str = "") -> Any:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ConfigError(f"unknown key(s) in config: {', '.join(prefix + k for k in unknown)}"
                          f"\nvalid keys for {cls.__name__}: {', '.join(names)}")
    hints = _hints(cls)
    return cls(**{k: _from_json(v, hints[k], prefix + k) for k, v in d.items()})


def load_config(cls: type, path_or_dict: str | os.PathLike | dict[str, Any]) -> Any:
    """Rebuild a `cls` instance from a JSON file or dict; missing keys keep their defaults."""
    d = path_or_dict
    if not isinstance(d, dict):
        d = json.loads(Path(d).read_text())
    return _build(cls, d)
