"""The energy ledger: one JSON line per phase of every step, the only input of the accounting.

A :class:`Ledger` is a :data:`~refspec.energy.phases.PhaseObserver`: the engine calls it with every
:class:`~refspec.energy.phases.PhaseEvent`, and it appends one ``"phase"`` record per event to a JSONL
file. A run starts with one ``"run"`` header record (configuration id, labels, meter source,
idle power). Several runs may share a file; every record carries its ``run_id``.

Counts (drafted, accepted, emitted, verified) may sit on one phase record of a step or be
repeated on several: :mod:`refspec.energy.accounting` takes each count's maximum across the records of
one step. The first token of each row, produced by the prompt forward, belongs on the prefill
record (step -1).

A run holds each (step, phase) at most once: a second generation written under the same run
would be merged into the first by the accounting, so the ledger refuses it
(:class:`RepeatedPhaseError`); :meth:`Ledger.begin_run` starts the next run in the same file.

Records are flushed to disk after every write, so a crashed run keeps every finished phase; a
ledger opened for appending first ends a line a crash cut short, and :func:`read_ledger`
reports (and skips) corrupt or truncated lines by line number.

A run ends with one ``"end"`` record saying whether it completed or was aborted (an exception or
Ctrl-C inside the ledger's ``with``); a run whose header promises an end (``ends``) and has none
was killed. :attr:`LedgerRecords.unfinished` names both kinds, and :func:`finished` drops them,
so totals over a whole file count only runs that completed.
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

from refspec.energy.phases import PhaseEvent
from refspec.energy.roofline import total_cost

logger = logging.getLogger(__name__)

LEDGER_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions :func:`read_ledger` accepts: 1 lacks the serving keys (``slot_requests``,
``arrivals_s``, ``queued``, ``clock_s``) and reads as an old static ledger."""

RUN_SCHEMA: dict[str, str] = {
    "kind": '"run": the header of one run',
    "version": "ledger format version (int)",
    "run_id": "configuration / run id every phase record of the run repeats (str)",
    "created_unix_s": "wall-clock creation time, seconds since the epoch (float)",
    "meter_source": "the meter's source string, e.g. measured:nvml-total-energy(gpu0) (str or null)",
    "idle_w": "idle power in W for net-of-idle accounting: measured on GPU, the profile's value when "
              "modelled (float or null)",
    "labels": "free-form configuration: model, drafter, k, batch, corpus, dtype, clocks ... (object)",
    "ends": "true when the run will be closed by an end record; without one it did not finish (bool)",
}
"""Fields of the run header record, name -> description."""

END_SCHEMA: dict[str, str] = {
    "kind": '"end": the last record of one run',
    "version": "ledger format version (int)",
    "run_id": "the run that ended (str)",
    "status": "complete | aborted (str)",
    "reason": "why an aborted run stopped, e.g. KeyboardInterrupt (str or null)",
    "created_unix_s": "wall-clock time of the end, seconds since the epoch (float)",
}
"""Fields of a run's end record, name -> description."""

SCHEMA: dict[str, str] = {
    "kind": '"phase": one phase of one step',
    "version": "ledger format version (int)",
    "run_id": "run this record belongs to (str)",
    "step": "decode step index; a prefill's is the decode step after which it ran, -1 for the first fill (int)",
    "phase": "prefill | draft | verify | commit | other (str)",
    "batch": "rows in the batch, the static shape B (int)",
    "rows_active": "rows still generating when the phase ran (int)",
    "drafted": "draft tokens proposed to active rows in the step (int)",
    "accepted": "draft tokens accepted in the step, summed over rows (int)",
    "emitted": "tokens emitted to users in the step (accepted + bonus/recovered, after EOS and budget "
               "truncation), summed over rows (int)",
    "verified": "target positions computed for active rows, active rows x (K+1) for chains (int)",
    "time_s": "wall (or modelled) time of the phase, s (float)",
    "energy_j": "energy of the phase, J, or null for time-only meters (float or null)",
    "source": "where energy_j came from: measured:<counter> | modelled:roofline(<profile>) | none:time-only",
    "forwards": "model forwards the phase ran (int)",
    "flops": "modelled FLOPs of the phase's forwards, refspec.energy.roofline.forward_cost (float)",
    "bytes": "modelled main-memory bytes of the phase's forwards (float)",
    "weight_bytes": "modelled weight bytes read (float)",
    "kv_read_bytes": "modelled KV-cache bytes read (float)",
    "kv_write_bytes": "modelled KV-cache bytes written (float)",
    "activation_bytes": "modelled compulsory activation bytes (float)",
    "emitted_per_row": "tokens emitted per row in the step, length batch (list of int)",
    "slot_requests": "request id in each slot during the phase, -1 empty, length batch; on a prefill the ids "
                     "being prefilled, -1 elsewhere; absent in version 1 (list of int)",
    "arrivals_s": "prefill only: arrival time of each prefilled request (closed loop: its admission), -1.0 "
                  "elsewhere, length batch; absent in version 1 (list of float)",
    "queued": "requests of the stream not yet admitted after the phase; absent in version 1 (int)",
    "clock_s": "engine clock at the phase's start, s; absent in version 1 (float)",
    "experts_touched": "distinct experts the phase's mixture-of-experts forwards routed to, summed over forwards "
                       "and MoE layers; null without an MoE forward; absent in older ledgers (int or null)",
}
"""Fields of a phase record, name -> description (units in the descriptions)."""

_REQUIRED = ("step", "phase", "batch", "rows_active", "time_s", "source")


class LedgerError(ValueError):
    """A ledger file that cannot be read or written as asked."""


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


def _experts_touched(work) -> int | None:
    """Distinct experts the phase's MoE forwards routed to, summed (None: no MoE forward)."""
    counts = [w.experts_touched for w in work if w.experts_touched is not None]
    return sum(counts) if counts else None


def phase_record(event: PhaseEvent, run_id: str) -> dict[str, Any]:
    """The JSON-ready phase record of ``event`` (see :data:`SCHEMA`)."""
    cost = total_cost(event.work)
    m = event.measurement
    return {
        "kind": "phase", "version": LEDGER_VERSION, "run_id": run_id,
        "step": event.step, "phase": event.phase, "batch": event.batch, "rows_active": event.rows_active,
        "drafted": event.drafted, "accepted": event.accepted, "emitted": event.emitted, "verified": event.verified,
        "time_s": m.time_s, "energy_j": m.energy_j, "source": m.source,
        "forwards": len(event.work), "flops": cost.flops, "bytes": cost.bytes,
        "weight_bytes": cost.weight_bytes, "kv_read_bytes": cost.kv_read_bytes,
        "kv_write_bytes": cost.kv_write_bytes, "activation_bytes": cost.activation_bytes,
        "emitted_per_row": list(event.emitted_per_row),
        "slot_requests": list(event.slot_requests), "arrivals_s": list(event.arrivals_s),
        "queued": event.queued, "clock_s": event.clock_s,
        "experts_touched": _experts_touched(event.work),
        **dict(m.extra),
    }


class Ledger:
    """Writes one JSONL record per :class:`~refspec.energy.phases.PhaseEvent` (a PhaseObserver).

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
            ensure_line_end(self.path)
        self.start_offset = self.path.stat().st_size if mode == "a" and self.path.exists() else 0
        self._fh: io.TextIOBase | None = open(self.path, mode, encoding="utf-8")
        self._meter_source = meter_source
        self._idle_w = idle_w
        self.records_written = 0
        self.run_ids: list[str] = []
        self._open_run: str | None = None
        self._seen: set[tuple[int, str, tuple[int, ...]]] = set()
        self.begin_run(run_id or uuid.uuid4().hex[:12], labels=labels)

    def begin_run(self, run_id: str, *, labels: Mapping[str, Any] | None = None) -> None:
        """Start the next run in this file (same meter source and idle power): its header, then its phases.

        Raises:
            LedgerError: ``run_id`` was already used by this ledger, or the ledger is closed.
        """
        if run_id in self.run_ids:
            raise LedgerError(f"run {run_id!r} was already written to {self.path}; give each run its own id")
        self.end_run()
        self._write({"kind": "run", "version": LEDGER_VERSION, "run_id": run_id,
                     "created_unix_s": time.time(), "meter_source": self._meter_source, "idle_w": self._idle_w,
                     "labels": dict(labels or {}), "ends": True})
        self.run_id = run_id
        self.run_ids.append(run_id)
        self._open_run = run_id
        self._seen = set()

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

    def __call__(self, event: PhaseEvent) -> None:
        """Append the record of ``event`` to the current run.

        Raises:
            RepeatedPhaseError: the run already holds ``(event.step, event.phase)``.
            LedgerError: the ledger is closed.
        """
        # a refill's prefill runs after a decode step; two at one step (the first refill's
        # requests all finished at once) differ in the requests they prefilled
        key = (event.step, event.phase, event.slot_requests if event.phase == "prefill" else ())
        if key in self._seen:
            raise RepeatedPhaseError(
                f"ledger run {self.run_id!r} already holds step {event.step} phase {event.phase!r}: a second "
                f"generation under one run would be merged into the first; call begin_run(new_id) before it")
        self._write(phase_record(event, self.run_id))
        self._seen.add(key)
        self.records_written += 1

    def write_counter(self, fields: Mapping[str, Any]) -> None:
        """Append one ``"counter"`` record, a read of the run's energy counter, to the current run
        (fields: :data:`refspec.energy.counter_log.COUNTER_SCHEMA`)."""
        self._write({"kind": "counter", "version": LEDGER_VERSION, "run_id": self.run_id, **fields})

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
    """Run id -> ``aborted`` or ``killed`` for every run of ``records`` that did not complete.

    Runs written before end records existed (headers without ``ends``) count as complete; the
    last end record of a run decides (see :func:`mark_aborted`).
    """
    promised: list[str] = []
    ends: dict[str, str] = {}
    for r in records:
        if r.get("kind") == "run" and r.get("ends"):
            promised.append(str(r["run_id"]))
        elif r.get("kind") == "end":
            ends[str(r["run_id"])] = str(r.get("status"))
    out = {rid: "killed" for rid in promised if rid not in ends}
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


def _problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    if record.get("version") not in READABLE_VERSIONS:
        return f"unsupported version {record.get('version')!r} (this reader knows {list(READABLE_VERSIONS)})"
    kind = record.get("kind")
    if kind == "run":
        return None if "run_id" in record else "run header without run_id"
    if kind == "end":
        return None if "run_id" in record and "status" in record else "end record without run_id or status"
    if kind == "counter":
        return None if "run_id" in record and "energy_j" in record else "counter record without run_id or energy_j"
    if kind != "phase":
        return f"unknown kind {kind!r}"
    missing = [f for f in _REQUIRED if f not in record]
    return f"missing fields {missing}" if missing else None


def read_ledger(path: str | os.PathLike[str], *, strict: bool = False, offset: int = 0) -> LedgerRecords:
    """Read a ledger, skipping and reporting lines that are not valid records.

    Args:
        path: JSONL ledger file.
        strict: raise :class:`LedgerError` instead of skipping corrupt lines.
        offset: byte offset to start at (a :attr:`Ledger.start_offset`); line numbers count
            from there.

    Returns:
        The records in file order (``LedgerRecords``, a list of dicts) with ``.corrupt`` listing
        ``(line_number, reason)`` of every skipped line; a warning names those lines.

    Raises:
        LedgerError: the file is missing, or ``strict`` and a line is corrupt.
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
        problem = _problem(record)
        if problem:
            corrupt.append((number, problem))
        else:
            records.append(record)
    if corrupt:
        detail = "; ".join(f"line {n}: {why}" for n, why in corrupt[:10])
        more = f" (and {len(corrupt) - 10} more)" if len(corrupt) > 10 else ""
        if strict:
            raise LedgerError(f"{p}: {len(corrupt)} corrupt line(s): {detail}{more}")
        logger.warning("%s: skipped %d corrupt line(s): %s%s", p, len(corrupt), detail, more)
    return LedgerRecords(records, corrupt, p)


__all__ = ["Ledger", "LedgerRecords", "LedgerError", "RepeatedPhaseError", "ensure_line_end", "SCHEMA", "RUN_SCHEMA",
           "END_SCHEMA", "LEDGER_VERSION", "READABLE_VERSIONS", "read_ledger", "phase_record", "unfinished_runs", "unfinished_in", "finished",
           "mark_aborted"]
