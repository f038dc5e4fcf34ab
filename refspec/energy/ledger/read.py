"""Reading a ledger back: its records, the lines that could not be read, the runs that did not finish.

:func:`read_ledger` skips and reports (by line number) corrupt or truncated lines, and refuses a
file of another format version whole, with one message: no conversion is attempted. A run
whose ``end`` record says ``aborted``, or that has none (killed), did not finish;
:func:`finished` drops such runs so that totals over a file count only completed ones.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from refspec.energy.ledger.format import LEDGER_VERSION, LedgerError, problem

logger = logging.getLogger(__name__)


def old_version(versions: Iterable[Any], path: Path) -> LedgerError:
    """The one error for a file of another format version."""
    found = sorted({repr(v) for v in versions})
    return LedgerError(f"{path} holds ledger format version {', '.join(found)}; this refspec reads and appends only "
                       f"version {LEDGER_VERSION} and converts none: write a new ledger (re-run) or read it with "
                       f"the refspec that wrote it")


class LedgerRecords(list):
    """The records of a ledger file (a list of dicts) plus the lines that could not be read.

    Attributes:
        corrupt: ``(line_number, reason)`` for every skipped line, 1-based.
        path: the file read.
    """

    def __init__(self, records: Iterable[dict[str, Any]], corrupt: list[tuple[int, str]], path: Path) -> None:
        super().__init__(records)
        self.corrupt = corrupt
        self.path = path

    @property
    def unfinished(self) -> dict[str, str]:
        """Runs that did not complete, run id -> ``aborted`` (end record says so) or ``killed`` (no end record)."""
        return unfinished_runs(self)


def unfinished_runs(records: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Run id -> ``aborted`` or ``killed`` for every run of ``records`` that did not complete
    (the last end record of a run decides, see :func:`refspec.energy.ledger.writer.mark_aborted`)."""
    started: list[str] = []
    ends: dict[str, str] = {}
    for r in records:
        if r.get("kind") == "run":
            started.append(str(r["run_id"]))
        elif r.get("kind") == "end":
            ends[str(r["run_id"])] = str(r.get("status"))
    out = {rid: "killed" for rid in started if rid not in ends}
    out.update({rid: "aborted" for rid, status in ends.items() if status != "complete"})
    return out


def unfinished_in(path: str | os.PathLike[str]) -> dict[str, str]:
    """:func:`unfinished_runs` of a ledger file, parsing only its run headers and end records (fast on big files)."""
    marks = ('"kind": "run"', '"kind": "end"')
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = [ln for ln in fh if any(m in ln for m in marks)]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # read_ledger reports corrupt lines; here only the marks matter
    return unfinished_runs(records)


def finished(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``records`` without those of unfinished runs: what totals over a whole ledger may sum."""
    records = list(records)
    drop = unfinished_runs(records)
    return [r for r in records if r.get("run_id") not in drop]


def read_ledger(path: str | os.PathLike[str], *, strict: bool = False, offset: int = 0) -> LedgerRecords:
    """Read a ledger, skipping and reporting lines that are not valid records.

    Args:
        path: JSONL ledger file.
        strict: raise :class:`LedgerError` instead of skipping corrupt lines.
        offset: byte offset to start at (a :attr:`Ledger.start_offset`); line numbers count from there.

    Returns:
        The records in file order (``LedgerRecords``, a list of dicts) with ``.corrupt`` listing
        ``(line_number, reason)`` of every skipped line; a warning names those lines.

    Raises:
        LedgerError: the file is missing, holds records of another format version, or
            ``strict`` and a line is corrupt.
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise LedgerError(f"no ledger at {p}") from None
    records: list[dict[str, Any]] = []
    corrupt: list[tuple[int, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 may appear in labels
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            corrupt.append((number, f"invalid JSON ({exc.msg} at column {exc.colno})"))
            continue
        why = problem(record)
        if why:
            corrupt.append((number, why))
        else:
            records.append(record)
    if any(r.get("version") != LEDGER_VERSION for r in records):
        raise old_version((r.get("version") for r in records if r.get("version") != LEDGER_VERSION), p)
    if corrupt:
        detail = "; ".join(f"line {n}: {why}" for n, why in corrupt[:10])
        more = f" (and {len(corrupt) - 10} more)" if len(corrupt) > 10 else ""
        if strict:
            raise LedgerError(f"{p}: {len(corrupt)} corrupt line(s): {detail}{more}")
        logger.warning("%s: skipped %d corrupt line(s): %s%s", p, len(corrupt), detail, more)
    return LedgerRecords(records, corrupt, p)


__all__ = ["LedgerRecords", "old_version", "unfinished_runs", "unfinished_in", "finished", "read_ledger"]
