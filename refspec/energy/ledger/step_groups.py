"""The phase records of one ledger run grouped into steps: what the accounting modules read.

A step groups the records of one decode step (draft, verify, commit, other). Each prefill is
a group of its own: the first fill (step -1) and, in a continuous-batching run, each refill (its
``step`` is the decode step after which it ran), so a refill's first tokens never merge with the
counts of the decode step that carries the same index. The key of a group is the ledger's own
(:func:`refspec.energy.ledger.format.group_key`), so writer and readers share one rule.

Counts are the maximum over a group's records (a count may be written on one record or
repeated on several); times add (phases do not overlap).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Mapping, Sequence

from refspec.energy.ledger.format import group_key

COUNTS = ("drafted", "accepted", "emitted", "verified")

Record = Mapping[str, Any]


class AccountingError(ValueError):
    """Ledger records that cannot be accounted as asked."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One group of one run: its records, counts (maxima over the records) and time (their sum).

    Attributes:
        index: the records' ``step`` (-1 for the first prefill).
        prefill: a prefill group (the first fill or a refill after decode step ``index``).
        slot_requests: request id per slot (-1 empty), from the commit record when there is one.
        arrivals_s: a prefill's arrival time per slot (-1.0 elsewhere); empty otherwise.
        queued: requests not yet admitted after the group (the largest its records say).
        end_s: engine clock at the group's end (the commit's end when there is one).
    """

    index: int
    prefill: bool
    records: tuple[Record, ...]
    counts: dict[str, int]
    rows_active: int
    has_verify: bool
    time_s: float
    emitted_per_row: tuple[int, ...]
    slot_requests: tuple[int, ...]
    arrivals_s: tuple[float, ...]
    queued: int
    end_s: float

    @property
    def decode(self) -> bool:
        """A decode step (not a prefill group)."""
        return not self.prefill and self.index >= 0

    @property
    def rejected(self) -> int:
        if not self.counts["verified"]:
            return 0
        return max(self.counts["verified"] - self.counts["accepted"] - self.rows_active, 0)

    def emitted(self, row: int) -> int:
        """Tokens the group emitted in ``row`` (0 past the recorded width)."""
        return self.emitted_per_row[row] if row < len(self.emitted_per_row) else 0

    @property
    def energy_j(self) -> float | None:
        """The group's energy, or None when a record holds none."""
        es = [r.get("energy_j") for r in self.records]
        return None if any(e is None for e in es) else sum(float(e) for e in es)


def _end(r: Record) -> float:
    return float(r["clock_s"]) + float(r["time_s"])


def _serving_keys(recs: Sequence[Record]) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """Slot requests, arrivals and end clock of a group: the commit's when it has one, else the last record's."""
    commit = [r for r in recs if r["phase"] == "commit"]
    main = commit[-1] if commit else max(recs, key=_end)
    slots = tuple(int(x) for x in main["slot_requests"])
    arrivals = tuple(float(x) for x in (next((r["arrivals_s"] for r in recs if r.get("arrivals_s")), ())))
    return slots, arrivals, _end(main)


def _step(index: int, prefill: bool, recs: Sequence[Record]) -> Step:
    counts = {f: max(int(r.get(f, 0) or 0) for r in recs) for f in COUNTS}
    verify = [r for r in recs if r["phase"] == "verify"]
    rows = [list(r.get("emitted_per_row") or ()) for r in recs]
    width = max((len(x) for x in rows), default=0)
    slots, arrivals, end = _serving_keys(recs)
    return Step(index=index, prefill=prefill, records=tuple(recs), counts=counts,
                rows_active=max(int(r["rows_active"]) for r in (verify or recs)),
                has_verify=bool(verify) or counts["verified"] > 0,
                time_s=sum(float(r["time_s"]) for r in recs),
                emitted_per_row=tuple(max((x[i] for x in rows if i < len(x)), default=0) for i in range(width)),
                slot_requests=slots, arrivals_s=arrivals,
                queued=max(int(r.get("queued", 0) or 0) for r in recs), end_s=end)


def group_steps(run_id: str | None, phases: Sequence[Record]) -> list[Step]:
    """The groups of one run's phase records, in order of first appearance.

    Raises:
        AccountingError: a (step, phase) pair appears twice (two generations under one run id);
            prefills at one step may repeat when they prefilled different requests.
    """
    by_key: dict[tuple[int, bool, tuple[int, ...]], list[Record]] = defaultdict(list)
    seen: set[tuple[int, str, tuple[int, ...]]] = set()
    for r in phases:
        key = step, phase, slots = group_key(int(r["step"]), str(r["phase"]), r["slot_requests"])
        if key in seen:
            raise AccountingError(f"run {run_id!r} holds step {step} phase {phase!r} twice: two generations "
                                  f"were written under one run id; give each its own run")
        seen.add(key)
        by_key[(step, phase == "prefill", slots)].append(r)
    return [_step(s, prefill, recs) for (s, prefill, _), recs in by_key.items()]


def decode_steps(steps: Sequence[Step]) -> list[Step]:
    """The decode steps of ``steps`` in step order."""
    return sorted((st for st in steps if st.decode), key=lambda st: st.index)


__all__ = ["AccountingError", "COUNTS", "Record", "Step", "group_steps", "decode_steps"]
