"""The energy ledger: one JSON line per phase of every step, the only input of the accounting.

A :class:`Ledger` is a :data:`~refspec.energy.ledger.events.PhaseObserver`: the engine calls it with
every :class:`~refspec.energy.ledger.events.PhaseEvent` and it appends one ``phase`` record per event
to a JSONL file; the record kinds and their fields are :mod:`refspec.energy.ledger.format`'s.
Several runs may share a file; every record carries its ``run_id``.

A run holds each (step, phase) at most once (prefills: :func:`~refspec.energy.ledger.format.group_key`):
a second generation written under the same run would be merged into the first by the
accounting, so the ledger refuses it (:class:`RepeatedPhaseError`); :meth:`Ledger.begin_run`
starts the next run in the same file.

Records are flushed after every write, so a crashed run keeps every finished phase; a ledger
opened for appending first ends a line a crash cut short. Reading back is
:mod:`refspec.energy.ledger.read`'s (:func:`~refspec.energy.ledger.read.read_ledger`): it reports
and skips corrupt or truncated lines by line number and refuses a file of another format version.

A run ends with one ``end`` record saying whether it completed or was aborted (an exception or
Ctrl-C inside the ledger's ``with``); a run without one was killed.
:attr:`~refspec.energy.ledger.read.LedgerRecords.unfinished` names both kinds and
:func:`~refspec.energy.ledger.read.finished` drops them, so totals over a file count only completed
runs.
"""
from __future__ import annotations

import io
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

from refspec.config import ModelArgs
from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.ledger.format import LEDGER_VERSION, LedgerError, group_key, model_record, phase_record
from refspec.energy.ledger.read import old_version

logger = logging.getLogger(__name__)


class RepeatedPhaseError(LedgerError):
    """A phase event for a (step, phase) the current run already holds."""


def ensure_line_end(path: str | os.PathLike[str]) -> None:
    """Append a newline when ``path`` ends mid-line (a crash), so the next record starts clean."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
    except FileNotFoundError:
        return
    if last != b"\n":
        with open(path, "ab") as fh:
            fh.write(b"\n")


def _first_version(path: Path) -> Any:
    """The version of the first record of ``path`` (None: no file, empty, or no readable first line)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = fh.readline()
        return json.loads(first).get("version") if first.strip() else None
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None


class Ledger:
    """Writes one JSONL record per :class:`~refspec.energy.ledger.events.PhaseEvent` (a PhaseObserver).

    Args:
        path: JSONL file to write; parent directories are created.
        run_id: id of the first run; a random one when None.
        labels: configuration written into the first run's header (model, drafter, k, batch, ...).
        meter_source: the meter's ``source``, for the header.
        idle_w: idle power in W for net-of-idle accounting (header).
        mode: ``"w"`` to start a new file, ``"a"`` to append another run.

    Attributes:
        run_id: the current run.
        run_ids: every run this object started, in order.
        start_offset: byte offset in ``path`` where this object's first record begins
            (``read_ledger(path, offset=start_offset)`` reads back only what it wrote).

    Raises:
        LedgerError: ``mode="a"`` onto a file of another format version.

    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], *, run_id: str | None = None,
                 labels: Mapping[str, Any] | None = None, meter_source: str | None = None,
                 idle_w: float | None = None, mode: str = "w") -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if mode == "a":
            if (version := _first_version(self.path)) not in (None, LEDGER_VERSION):
                raise old_version([version], self.path)
            ensure_line_end(self.path)
        self.start_offset = self.path.stat().st_size if mode == "a" and self.path.exists() else 0
        self._fh: io.TextIOBase | None = open(self.path, mode, encoding="utf-8")
        self._meter_source = meter_source
        self._idle_w = idle_w
        self.records_written = 0
        self.run_ids: list[str] = []
        self._open_run: str | None = None
        self._seen: set[tuple[int, str, tuple[int, ...]]] = set()
        self._models: list[ModelArgs] = []
        self.begin_run(run_id or uuid.uuid4().hex[:12], labels=labels)

    def begin_run(self, run_id: str, *, labels: Mapping[str, Any] | None = None) -> None:
        """Start the next run in this file (same meter source and idle power): its header, then its phases.

        Raises:
            LedgerError: ``run_id`` was already used by this ledger, or the ledger is closed.
        """
        if run_id in self.run_ids:
            raise LedgerError(f"run {run_id!r} was already written to {self.path}; give each run its own id")
        self.end_run()
        self._write({"kind": "run", "version": LEDGER_VERSION, "run_id": run_id, "created_unix_s": time.time(),
                     "meter_source": self._meter_source, "idle_w": self._idle_w, "labels": dict(labels or {})})
        self.run_id = run_id
        self.run_ids.append(run_id)
        self._open_run = run_id
        self._seen = set()
        self._models = []

    def end_run(self, status: str = "complete", reason: str | None = None) -> None:
        """Close the current run with an end record (idempotent; :meth:`begin_run` and :meth:`close` call it)."""
        if self._open_run is None or self._fh is None:
            return
        if status not in ("complete", "aborted"):
            raise ValueError(f"status must be 'complete' or 'aborted', got {status!r}")
        self._write({"kind": "end", "version": LEDGER_VERSION, "run_id": self._open_run, "status": status,
                     "reason": reason, "created_unix_s": time.time()})
        self._open_run = None

    def _write(self, record: Mapping[str, Any]) -> None:
        if self._fh is None:
            raise LedgerError(f"ledger {self.path} is closed")
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()  # at least once per step: every record, so a crash loses nothing finished

    def _model_id(self, args: ModelArgs) -> int:
        """The run's id of ``args``, declaring it in a model record the first time it runs."""
        for i, known in enumerate(self._models):
            if known is args or known == args:
                return i
        self._write(model_record(args, len(self._models), self.run_id))
        self._models.append(args)
        return len(self._models) - 1

    def __call__(self, event: PhaseEvent) -> None:
        """Append the record of ``event`` to the current run.

        Raises:
            RepeatedPhaseError: the run already holds the event's :func:`group_key`.
            LedgerError: the ledger is closed.
        """
        key = group_key(event.step, event.phase, event.slot_requests)
        if key in self._seen:
            raise RepeatedPhaseError(
                f"ledger run {self.run_id!r} already holds step {event.step} phase {event.phase!r}: a second "
                f"generation under one run would be merged into the first; call begin_run(new_id) before it")
        self._write(phase_record(event, self.run_id, self._model_id))
        self._seen.add(key)
        self.records_written += 1

    def write_counter(self, fields: Mapping[str, Any]) -> None:
        """Append one ``counter`` record, a read of the run's energy counter, to the current run
        (fields: :data:`refspec.energy.ledger.counter_records.COUNTER_SCHEMA`)."""
        self._write({"kind": "counter", "version": LEDGER_VERSION, "run_id": self.run_id, **fields})

    def write_loop(self, phase: str, loop: Any, source: str) -> None:
        """Append one ``loop`` record (:data:`~refspec.energy.ledger.format.LOOP_SCHEMA`): ``phase``
        run alone, ``loop`` its :class:`~refspec.energy.accounting.attribution.Loop` (energy, time, iterations)."""
        self._write({"kind": "loop", "version": LEDGER_VERSION, "run_id": self.run_id, "phase": phase,
                     "energy_j": loop.energy_j, "time_s": loop.time_s, "iterations": loop.iterations,
                     "rows": getattr(loop, "rows", None), "source": source,
                     **({"phase_time_s": dict(loop.phase_time_s)} if getattr(loop, "phase_time_s", None) else {})})

    def close(self, status: str = "complete", reason: str | None = None) -> None:
        """End the current run with ``status``, flush and close the file (idempotent)."""
        if self._fh is not None:
            try:
                self.end_run(status, reason)
            finally:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # an exception or Ctrl-C inside the block: the run did not finish and must not be counted
        self.close("aborted" if exc_type is not None else "complete", exc_type.__name__ if exc_type else None)


def mark_aborted(path: str | os.PathLike[str], run_ids: Iterable[str], reason: str | None = None) -> None:
    """Append an ``aborted`` end record for each of ``run_ids`` (the last end record of a run wins).

    For runs that completed but whose result was never kept (interrupted between the run and
    its record), so totals over the file leave them out like any other unfinished run.
    """
    ensure_line_end(path)
    with open(path, "a", encoding="utf-8") as fh:
        for run_id in run_ids:
            fh.write(json.dumps({"kind": "end", "version": LEDGER_VERSION, "run_id": run_id, "status": "aborted",
                                 "reason": reason, "created_unix_s": time.time()}) + "\n")


__all__ = ["Ledger", "RepeatedPhaseError", "ensure_line_end", "mark_aborted"]
