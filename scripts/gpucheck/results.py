"""The results file, rewritten after every point, and the limits on what comes back from $OUT."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
MAX_DEPTH = 2  # folders below $OUT


class Results:
    """A JSON document saved atomically (write a sibling, then rename) on every :meth:`save`.

    A run killed at any moment leaves the last complete version, never a torn file.
    """

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def out_problems(out: Path) -> list[str]:
    """What under ``out`` would not come back: too many files, too large, too deep."""
    files = [p for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")]
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files under {out}, at most {MAX_FILES} come back")
    for p in files:
        if p.stat().st_size >= MAX_FILE_BYTES:
            problems.append(f"{p.relative_to(out)} is {p.stat().st_size} B, over {MAX_FILE_BYTES}")
        if len(p.relative_to(out).parts) - 1 > MAX_DEPTH:
            problems.append(f"{p.relative_to(out)} is more than {MAX_DEPTH} folders deep")
    return problems
