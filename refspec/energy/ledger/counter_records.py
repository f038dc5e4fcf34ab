"""Counter reads into the ledger: the ``counter`` records of a run metered by a counter.

A :class:`~refspec.energy.meters.windowed.WindowedMeter` reads its counter at a run's start, at
sub-window bounds and at its end; the reads taken at a phase's bounds ride on that phase's
measurement. :class:`CounterLedger` wraps the run's :class:`~refspec.energy.ledger.writer.Ledger`: the
engine calls it as its observer, it writes the phase record through the ledger and, beside it,
one ``counter`` record per read, placed on the engine clock (the start of the phase it precedes,
the end of the phase it follows); when the ledger run ends it takes the end read. Wrap the
ledger with :func:`counter_ledger`, which leaves it bare for a meter that reads no counter::

    with counter_ledger(meter, Ledger(path, ...)) as ledger:
        Engine(model, drafter, meter=meter, observers=[ledger]).serve(requests, batch=8)

The engine is not changed: it still sees one observer and one meter.
"""
from __future__ import annotations

from typing import Any, Mapping

from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.meters.counters import CounterRead

COUNTER_SCHEMA: dict[str, str] = {
    "kind": '"counter": one read of the run\'s energy counter',
    "version": "ledger format version (int)",
    "run_id": "run this read belongs to (str)",
    "reason": "start (before the run's first phase) | sub (a sub-window bound: the end of a commit or prefill "
              "once at least ten counter periods have passed since the previous read) | end (after the run's "
              "last phase) (str)",
    "clock_s": "engine clock of the read, s: the clock_s of the phase it precedes, or clock_s + time_s of the "
               "phase it follows (float)",
    "wall_s": "time of the read on the counter's time base, s: time.perf_counter, or the modelled clock under a "
              "simulated GPU profile; wall_s differences minus the phases' time_s are host time outside any "
              "phase (float)",
    "energy_j": "cumulative counter energy in J, summed over devices; only differences between reads of one run "
                "mean anything (float)",
    "devices": "cumulative J per device, e.g. {\"package-0\": J, \"dram-0\": J} or {\"gpu0\": J, \"gpu1\": J} "
               "(object)",
    "source": "the counter read, e.g. measured:rapl(package-0,dram-0) (str)",
    "period_s": "the counter's update period, s (float)",
    "energy_true_j": "simulated counters only: cumulative true energy in J, what the counter samples (float)",
}
"""Fields of a counter record, name -> description (``energy_true_j`` only from a simulated counter)."""


def counter_fields(read: CounterRead, *, reason: str, clock_s: float, source: str, period_s: float) -> dict[str, Any]:
    """The fields of one counter record (the ledger adds kind, version and run id)."""
    fields: dict[str, Any] = {"reason": reason, "clock_s": clock_s, "wall_s": read.wall_s, "energy_j": read.energy_j,
                              "devices": dict(read.devices), "source": source, "period_s": period_s}
    if read.true_j is not None:
        fields["energy_true_j"] = read.true_j
    return fields


class CounterLedger:
    """A ledger that also records a counter meter's reads (an engine observer, as the ledger is).

    Everything but the run boundaries and phase events passes through to the wrapped ledger
    (``run_id``, ``run_ids``, ``start_offset``, ``path`` ...).

    Args:
        ledger: the :class:`~refspec.energy.ledger.writer.Ledger` (anything with ``__call__``,
            ``write_counter``, ``begin_run``, ``end_run`` and ``close``).
        meter: the :class:`~refspec.energy.meters.windowed.WindowedMeter` the engine meters with.
    """

    def __init__(self, ledger: Any, meter: Any) -> None:
        self.ledger = ledger
        self.meter = meter
        self._end_clock_s = 0.0
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    def _write(self, read: CounterRead, reason: str, clock_s: float) -> None:
        self.ledger.write_counter(counter_fields(read, reason=reason, clock_s=clock_s, source=self.meter.source,
                                                 period_s=self.meter.period_s))

    def __call__(self, event: PhaseEvent) -> None:
        """Write the reads before the phase, its record, then the reads after it."""
        m = event.measurement
        marks = getattr(m, "marks", ())
        for mark in marks:
            if not mark.at_end:
                self._write(mark.read, mark.reason, event.clock_s)
        self.ledger(event)
        end = event.clock_s + m.time_s
        self._end_clock_s = max(self._end_clock_s, end)
        for mark in marks:
            if mark.at_end:
                self._write(mark.read, mark.reason, end)

    def _finish(self, status: str) -> None:
        """The open run's end read, written unless the run was aborted (a failing counter must not
        hide the error that aborted it)."""
        if status == "complete":
            read = self.meter.finish_run()
            if read is not None:
                self._write(read, "end", self._end_clock_s)
        else:
            self.meter.abandon_run()
        self._end_clock_s = 0.0  # the engine clock restarts with every serve

    def begin_run(self, run_id: str, *, labels: Mapping[str, Any] | None = None) -> None:
        """End the open run (its end read), then start the next one in the ledger."""
        self._finish("complete")
        self.ledger.begin_run(run_id, labels=labels)

    def end_run(self, status: str = "complete", reason: str | None = None) -> None:
        """End the open run: its end read (when complete), then the ledger's end record."""
        self._finish(status)
        self.ledger.end_run(status, reason)

    def close(self, status: str = "complete", reason: str | None = None) -> None:
        """End the open run as :meth:`end_run` does and close the ledger."""
        if not self._closed:
            self._closed = True
            self._finish(status)
        self.ledger.close(status, reason)

    def __enter__(self) -> "CounterLedger":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close("aborted" if exc_type is not None else "complete", exc_type.__name__ if exc_type else None)


def counter_ledger(meter: Any, ledger: Any) -> Any:
    """``ledger`` wrapped in a :class:`CounterLedger` when ``meter`` reads a counter over windows
    (it has ``finish_run``), else ``ledger`` itself."""
    return CounterLedger(ledger, meter) if callable(getattr(meter, "finish_run", None)) else ledger


__all__ = ["COUNTER_SCHEMA", "CounterLedger", "counter_fields", "counter_ledger"]
