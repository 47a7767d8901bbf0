"""What the notebook builders share: cells collected in order, written as a deterministic nbformat
v4 file (so a test can check a committed notebook against its builder). Imported by
notebooks/build_*.py, which run in no other process."""
from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path


class Notebook:
    def __init__(self, path: Path):
        self.path = Path(path)  # where `write` and the command line put the .ipynb by default
        self.cells: list[tuple[str, list[str], str]] = []  # (kind "md" | "code", tags, source)

    def md(self, src: str) -> None:
        self.cells.append(("md", [], src))

    def code(self, src: str, tags: list[str] | None = None) -> None:
        self.cells.append(("code", list(tags or []), src))

    def build(self) -> dict:
        """The notebook as an nbformat v4 dict (deterministic)."""
        cells = []
        for i, (kind, tags, src) in enumerate(self.cells):
            cell = {"cell_type": "markdown" if kind == "md" else "code", "id": f"cell-{i:02d}",
                    "metadata": {"tags": tags} if tags else {}, "source": _lines(src)}
            if kind == "code":
                cell.update(outputs=[], execution_count=None)
            cells.append(cell)
        return {"cells": cells,
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                             "language_info": {"name": "python"}},
                "nbformat": 4, "nbformat_minor": 5}

    def write(self, path=None) -> Path:
        path = Path(path or self.path)
        path.write_text(json.dumps(self.build(), indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        return path

    def main(self, doc: str) -> None:
        """The builder's command line: write the notebook (to --out) and print where."""
        ap = argparse.ArgumentParser(description=doc.splitlines()[0])
        ap.add_argument("--out", default=str(self.path), help="where to write the .ipynb")
        print(self.write(ap.parse_args().out))


def _lines(src: str) -> list[str]:
    text = textwrap.dedent(src).strip("\n")
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]
