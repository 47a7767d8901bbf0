"""docs/internals.md's layout table, made from the tree: one row per room (a folder of common/, tba/,
areal/, the task scripts), what its __init__.py docstring says it holds (its first sentence), its
modules and their lines. tests/test_docs.py checks that the table in the docs lists what the tree
holds; after moving or adding a module, regenerate it:

    python tests/layout.py --write
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "internals.md"
BEGIN, END = "<!-- layout: made by tests/layout.py -->", "<!-- layout: end -->"
ROOMS = ["common", "common/contracts", "common/engine/model", "common/engine/checkpoints", "common/engine/kv",
         "common/engine/sampler", "common/engine/machine", "common/plan", "common/rewards", "common/runtime",
         "common/runtime/shared", "common/runtime/files", "common/runtime/ranks", "common/runtime/nodes", "tba",
         "areal", "."]


def _what(folder: Path) -> str:
    if folder == ROOT:
        return "the task scripts: each its task's data, prompt, reward, evaluation and presets"
    init = folder / "__init__.py"
    text = init.read_text() if init.exists() else ""
    m = re.search(r'"""(.*?)(?:\.\s|\."""|""")', text, re.S)
    return " ".join(m.group(1).split()) if m else ""


def rooms() -> list[tuple[str, str, list[tuple[str, int]]]]:
    """(folder, what it holds, [(module file, lines)]) of every room, in the order above."""
    out = []
    for r in ROOMS:
        folder = ROOT / r
        files = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
        if r == ".":
            files = [p for p in files if p.name.startswith("run_")]
        out.append((r, _what(folder), [(p.name, len(p.read_text().splitlines())) for p in files]))
    return out


def table() -> str:
    rows = ["| room | lines | modules | what it holds |", "|---|---|---|---|"]
    for r, what, files in rooms():
        name = "`run_*.py`" if r == "." else f"`{r}/`"
        mods = ", ".join(f"`{f}` {n}" for f, n in files)
        rows.append(f"| {name} | {sum(n for _, n in files):,} | {mods} | {what} |")
    return "\n".join([BEGIN, *rows, END])


def current() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN):text.index(END) + len(END)]


def modules_of(block: str) -> list[tuple[str, list[str]]]:
    """(room, its modules) as a layout block lists them (sizes aside)."""
    out = []
    for line in block.splitlines()[3:-1]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out.append((cells[0], re.findall(r"`([\w.]+\.py)`", cells[2])))
    return out


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        DOC.write_text(DOC.read_text().replace(current(), table()))
    print(table())
