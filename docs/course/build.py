"""Build the course's notebooks from their readable sources: ``python docs/course/build.py``.

Each lecture is written as a Python file in ``docs/course/src/`` whose cells start with a marker line:

* ``# %% [markdown]``: a markdown cell; its lines lose their leading ``# `` (a lone ``#`` is an empty line,
  trailing empty lines are dropped);
* ``# %%``: a code cell; ``# %% key`` tags it ``key``: it prints the lecture's key figures, which
  the tests check against what the library computes.

The notebook of ``src/NN_name.py`` is ``NN_name.ipynb`` beside this script, written without
outputs (students run them). ``--check`` writes nothing and exits 1 when a committed notebook
differs from its source.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}


def _cell(kind: str, lines: list[str], tags: list[str]) -> dict:
    while lines and not lines[-1].strip():
        lines.pop()
    text = "\n".join(lines)
    cell: dict = {"cell_type": kind, "metadata": {"tags": tags} if tags else {}, "source": text}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _markdown_line(line: str) -> str:
    if line in ("#", ""):  # an empty markdown line, or the blank line before the next marker
        return ""
    if not line.startswith("# "):
        raise ValueError(f"a markdown line must start with '# ': {line!r}")
    return line[2:]


def cells(source: str) -> list[dict]:
    """The cells of a lecture source (module docstring)."""
    out: list[dict] = []
    kind, tags, lines = None, [], []
    for line in source.split("\n"):
        if line.startswith("# %%"):
            if kind is not None:
                out.append(_cell(kind, lines, tags))
            rest = line[4:].strip()
            kind = "markdown" if rest == "[markdown]" else "code"
            tags = [] if kind == "markdown" or not rest else rest.split()
            lines = []
            continue
        if kind is None:
            if line.strip():
                raise ValueError(f"text before the first cell marker: {line!r}")
            continue
        lines.append(_markdown_line(line) if kind == "markdown" else line)
    if kind is not None:
        out.append(_cell(kind, lines, tags))
    return out


def notebook(source: str) -> str:
    """The notebook JSON (nbformat 4.5, no outputs) of a lecture source."""
    cs = cells(source)
    for i, c in enumerate(cs):
        c["id"] = f"c{i:02d}"
    nb = {"cells": cs, "metadata": KERNEL, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def targets() -> dict[Path, str]:
    """Each notebook path and the JSON its source builds."""
    return {HERE / (src.stem + ".ipynb"): notebook(src.read_text()) for src in sorted(SOURCES.glob("*.py"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build docs/course/*.ipynb from docs/course/src/*.py.")
    parser.add_argument("--check", action="store_true", help="only say whether the notebooks are current")
    args = parser.parse_args(argv)
    stale = {p: text for p, text in targets().items() if not p.exists() or p.read_text() != text}
    for p, text in stale.items():
        if args.check:
            print(f"{p.name} differs from its source: run python docs/course/build.py")
        else:
            p.write_text(text)
            print(f"wrote {p.relative_to(HERE.parent.parent)}")
    return 1 if args.check and stale else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
