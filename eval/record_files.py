"""Records files: ``records.jsonl`` (a Slurm task's ``records/task-<i>.jsonl``) and ``summary.json``.

One :class:`~refspec.eval.record.RunRecord` per line, appended, flushed and fsynced as soon as
its configuration finishes (:func:`append_record`); :func:`read_records` reads them back,
reporting and skipping lines a crash cut short, the last record of a configuration winning.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterable

from refspec.eval.outputs import RECORDS, TASK_RECORDS_DIR, append_line
from refspec.eval.record import RecordError, RunRecord

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedRecords:
    """Records read from a run or sweep directory.

    Attributes:
        records: the last ``status == "ok"`` record of each configuration, in first-seen order.
        corrupt: ``(file, line number, reason)`` of every line that could not be read.
        duplicates: how many records repeated a configuration already seen.
        files: the records files read.
    """

    records: list[RunRecord]
    corrupt: list[tuple[str, int, str]]
    duplicates: int
    files: list[Path]

    @property
    def by_id(self) -> dict[str, RunRecord]:
        return {r.config_id: r for r in self.records}


def records_files(out_dir: Path) -> list[Path]:
    """``DIR/records.jsonl`` and every ``DIR/records/*.jsonl`` that exist."""
    files = [out_dir / RECORDS] if (out_dir / RECORDS).is_file() else []
    task_dir = out_dir / TASK_RECORDS_DIR
    if task_dir.is_dir():
        files += sorted(task_dir.glob("*.jsonl"))
    return files


def _parse(line: str) -> RunRecord | str | None:
    """The record of one line, None for a record that did not finish, or why it cannot be read."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg}); a truncated write?"
    if not isinstance(obj, dict) or not isinstance(obj.get("config_id"), str):
        return "not a configuration record (no config_id)"
    if obj.get("status") != "ok":
        return None
    try:
        return RunRecord.from_json(obj)
    except RecordError as exc:
        return str(exc)


def read_records(files: Iterable[Path], *, strict: bool = False) -> LoadedRecords:
    """Read records files, skipping (and reporting) corrupt lines; the last record of an id wins.

    Args:
        files: records files.
        strict: raise on a line that is JSON but no readable record (another version, a field
            missing) instead of skipping it.

    Raises:
        OSError: a file that exists but cannot be read.
        RecordError: under ``strict``, the first unreadable record.
    """
    by_id: dict[str, RunRecord] = {}
    corrupt: list[tuple[str, int, str]] = []
    duplicates = 0
    file_list = list(files)
    for path in file_list:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            rec = _parse(line)
            if isinstance(rec, str):
                if strict and not rec.startswith(("not JSON", "not a configuration")):
                    raise RecordError(f"{path}:{number}: {rec}")
                corrupt.append((str(path), number, rec))
            elif rec is not None:
                duplicates += rec.config_id in by_id
                by_id.pop(rec.config_id, None)  # re-insert below, keeping the latest
                by_id[rec.config_id] = rec
    for path, number, reason in corrupt:
        log.warning("%s, line %d: skipped (%s)", path, number, reason)
    return LoadedRecords(records=list(by_id.values()), corrupt=corrupt, duplicates=duplicates, files=file_list)


def append_record(path: Path, record: RunRecord) -> None:
    """Append one record as a JSON line, flushed and fsynced (a crash mid-line is repaired later)."""
    append_line(path, json.dumps(record.to_json()))


def summary_json(records: Iterable[RunRecord]) -> list[dict[str, Any]]:
    """``summary.json``'s list: every record's JSON object."""
    return [r.to_json() for r in records]


__all__ = ["LoadedRecords", "records_files", "read_records", "append_record", "summary_json"]
