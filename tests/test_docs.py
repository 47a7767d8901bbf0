"""The README and docs/ name only code that exists: every repository path they quote, every
`common.x.y` module, and every `path.py: name` / `module.name` pointer resolves in the tree. Docs
drift when files move; this catches it on the next test run."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

from tests.layout import current, modules_of, table

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "data" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = "common|tba|areal|bench|tests|notebooks|data|docs"


def _dotted_problem(name: str) -> str | None:
    """Why `common.x.y` (a module, or a module's attribute) does not resolve, or None. `tba.beta` and
    the like are config keys, not modules: a dotted name is checked once its first two parts
    name a module or package."""
    parts = name.split(".")
    if parts[0] != "common" and not _exists(parts[:2]):
        return None
    k = max((k for k in range(1, len(parts) + 1) if _exists(parts[:k])), default=0)
    if k == len(parts):
        return None
    f = _file(parts[:k])
    if k == len(parts) - 1 and f is not None and re.search(rf"\b{parts[-1]}\b", f.read_text()):
        return None
    return f"module {name}"


def _file(parts: list[str]) -> Path | None:
    for f in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if f.exists():
            return f
    return None


def _exists(parts: list[str]) -> bool:
    return _file(parts) is not None


def _problems(text: str) -> list[str]:
    out = []
    for m in re.finditer(rf"(?<![\w/.-])((?:{TOP})/[\w/.*-]*\w)", text):
        p = m.group(1)
        if not list(ROOT.glob(p)) and not list(ROOT.glob(p + "*")):  # a quoted prefix of dated files counts
            out.append(f"path {p}")
    for m in re.finditer(r"(?<![\w/.])((?:common|tba|areal)(?:\.\w+)+)", text):
        if (why := _dotted_problem(m.group(1))) is not None:
            out.append(why)
    for p, name in re.findall(rf"`((?:{TOP})/[\w/]+\.py): (\w+)", text):
        if (ROOT / p).exists() and not re.search(rf"\b{name}\b", (ROOT / p).read_text()):
            out.append(f"{name} not in {p}")
    return out


def test_the_docs_name_only_code_that_exists():
    bad = {str(d.relative_to(ROOT)): p for d in DOCS if (p := _problems(d.read_text()))}
    assert not bad, bad


def test_a_moved_file_is_reported():
    """The check itself: a pointer at a file or name that is not there is caught."""
    assert _problems("see `common/runtime/ranks.py` and `common/contracts/ops.py: token_logp`") == ["path common/runtime/ranks.py"]
    assert _problems("`common.runtime.replay.plot_replays`, `common/contracts/ops.py: no_such_fn`") == [
        "module common.runtime.replay.plot_replays", "no_such_fn not in common/contracts/ops.py"]
    assert _problems("`common.replay.plot_replays`, `common.contracts.plots`, `tba.beta = 1`") == []


def _task_commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, flags) of every task command in a markdown's code blocks: `python run_x.py ...`,
    `torchrun ... run_x.py ...` and `run_x.main([...])`; `--help` / `--print-config` / `--print-memory` dropped (they
    exit), and `--judge=` (run_code.py's scoring entry, not a config key), so is what follows a `#` comment."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    scripts = "|".join(p.stem for p in ROOT.glob("run_*.py"))
    out = []
    for line in (ln for b in blocks for ln in b.splitlines()):
        line = line.split("  #")[0]
        if (m := re.search(rf"\b({scripts})\.py((?:\s+--[^\s]+)*)", line)):
            out.append((m.group(1), m.group(2).split()))
        elif (m := re.search(rf"\b({scripts})\.main\(\[([^\]]*)\]", line)):
            out.append((m.group(1), re.findall(r"\"(--[^\"]+)\"", m.group(2))))
    return [(s, [f for f in flags if f not in ("--help", "--print-config") and not f.startswith(("--print-memory", "--judge="))])
            for s, flags in out]


def test_every_task_command_in_the_docs_parses():
    """Each flag a README or docs/ code block passes to a task script exists: the script's
    `make_config` (unknown keys are errors) takes the command's flags as they are written."""
    seen = 0
    for d in DOCS:
        for script, flags in _task_commands(d.read_text()):
            try:
                importlib.import_module(script).make_config(flags)
            except SystemExit as e:
                raise AssertionError(f"{d.relative_to(ROOT)}: {script}.py {' '.join(flags)}: exits ({e})") from None
            except Exception as e:
                raise AssertionError(f"{d.relative_to(ROOT)}: {script}.py {' '.join(flags)}: {e}") from None
            seen += 1
    assert seen >= 10  # the README alone has more: the parser found the commands


def test_the_layout_table_lists_what_the_tree_holds():
    """docs/internals.md's table of rooms and modules is tests/layout.py's, sizes aside: a module
    moved or added without `python tests/layout.py --write` fails here."""
    assert modules_of(current()) == modules_of(table())
