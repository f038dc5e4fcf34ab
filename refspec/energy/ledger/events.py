"""Phase events: what the engine reports for every phase of every step.

The engine brackets every phase of every step with a :class:`MeteredPhase`: the meter's window
(:class:`~refspec.energy.meters.measurement.EnergyMeter`) and a
:class:`~refspec.energy.model.work.WorkRecorder` that collects the shapes of the forwards run
inside it. Closing the phase hands exactly that work to ``meter.end`` and to the
:class:`PhaseEvent` the engine gives its observers (the ledger is one,
:mod:`refspec.energy.ledger.writer`).

Phases: ``prefill`` (prompt forward of target and drafter), ``draft`` (the drafter proposes),
``verify`` (one target forward over the K+1 positions of each row), ``commit`` (acceptance,
bookkeeping, drafter state update) and ``other`` (anything else a caller wants to bracket).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from refspec.energy.meters.measurement import EnergyMeter, Measurement
from refspec.energy.model.work import ForwardShape, WorkRecorder

PHASES = ("prefill", "draft", "verify", "commit", "other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseEvent:
    """What one phase of one step did and cost (one ledger record).

    Attributes:
        step: decode step index; a prefill's is the decode step after which it ran (-1 for the
            first fill).
        phase: one of :data:`PHASES`.
        batch: rows in the batch (static shape).
        rows_active: rows still generating when the phase ran.
        drafted: draft tokens proposed to active rows in this step (K per active row).
        accepted: draft tokens accepted in this step, summed over rows.
        emitted: tokens emitted to users in this step (accepted + bonus/recovered, after
            EOS and budget truncation), summed over rows.
        verified: target positions computed for active rows (active rows x (K+1)).
        work: forwards that ran in the phase, for the analytic model.
        measurement: time and energy of the phase.
        emitted_per_row: tokens emitted per row in this step (for TPOT), length ``batch``.
        slot_requests: request id in each slot during the phase (-1 empty), length ``batch``;
            on a prefill, the ids being prefilled in their slots and -1 elsewhere (empty when
            the caller tracks no requests).
        arrivals_s: prefill only, length ``batch``: arrival time of each prefilled request
            (closed loop: its admission time), -1.0 elsewhere.
        queued: requests of the stream not yet admitted, after this phase.
        clock_s: engine clock at the phase's start (s).
        k: drafts asked of the drafter this step (the speculation policy's choice; 0 on a
            prefill and in plain decoding).
        row_lengths: per slot, length ``batch``: the keys of its own sequence the slot's
            queries attend in this phase (a prefill: its prompt length; a decode step: its
            committed length plus the step's positions), 0 for an empty or finished slot;
            what per-row work is charged by (empty when the caller tracks none).
        accepted_per_row: commit only, length ``batch``: drafts each slot accepted in the step,
            -1 where no request was generating (per-request acceptance read from the ledger).
    """

    step: int
    phase: str
    batch: int
    rows_active: int
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    verified: int = 0
    work: tuple[ForwardShape, ...] = ()
    measurement: Measurement
    emitted_per_row: tuple[int, ...] = ()
    slot_requests: tuple[int, ...] = ()
    arrivals_s: tuple[float, ...] = ()
    queued: int = 0
    clock_s: float = 0.0
    k: int = 0
    row_lengths: tuple[int, ...] = ()
    accepted_per_row: tuple[int, ...] = ()


PhaseObserver = Callable[[PhaseEvent], None]


class MeteredPhase:
    """One metered phase: ``with MeteredPhase(meter, "verify") as phase: ...`` opens the meter
    window and a :class:`WorkRecorder`; on exit the recorded work goes to ``meter.end``.

    Attributes:
        name: the phase name.
        work: forwards recorded inside the phase (set on exit).
        measurement: what the meter returned (set on exit).
    """

    def __init__(self, meter: EnergyMeter, name: str) -> None:
        self.meter, self.name = meter, name
        self._recorder = WorkRecorder()
        self.work: tuple[ForwardShape, ...] = ()
        self.measurement: Measurement | None = None

    def __enter__(self) -> "MeteredPhase":
        self.meter.begin(self.name)
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recorder.__exit__(*exc)
        self.work = self._recorder.work
        self.measurement = self.meter.end(self.name, self.work)  # also on error: no window stays open
