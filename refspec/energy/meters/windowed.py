"""The counter meter of a run: phases timed without synchronising, the counter read only over
windows it can resolve.

A phase lasts milliseconds; an energy counter updates every 20-100 ms (NVML) and may sample only
part of each period. :class:`WindowedMeter` therefore never reads its counter per phase. It
times every phase (the host clock on a CPU, CUDA events on a GPU, resolved only when the engine
reads the time after the step's own host sync) and reads the counter

* at the **start** of a run (when its first phase begins),
* at a **sub**-window bound: the end of a ``commit`` or ``prefill`` phase (each holds the
  step's host sync, so at most the drafter's short tail of queued work is in flight, and it
  lands in the next window) once at least ``sub_window_s`` (at least ten counter periods) have
  passed since the previous read,
* at the **end** of a run (:meth:`WindowedMeter.finish_run`, called by
  :class:`~refspec.energy.ledger.counter_records.CounterLedger` when the ledger run ends).

A phase's :class:`~refspec.energy.meters.measurement.Measurement` carries its time, ``energy_j``
None (the counter cannot see it) and the reads taken at its bounds
(:class:`~refspec.energy.meters.counters.CounterMark`); the ledger wrapper
(:mod:`refspec.energy.ledger.counter_records`) turns those into ``counter`` records on the
engine's clock. The split of the window energy among phases is the accounting's
(:mod:`refspec.energy.accounting.attribution`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from refspec.energy.meters.counters import CounterMark, CounterRead, EnergyCounter
from refspec.energy.meters.measurement import Measurement, Windows
from refspec.energy.meters.timers import Timer, default_timer
from refspec.energy.model.work import ForwardShape

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

MIN_PERIODS = 10
"""A sub-window spans at least this many counter periods."""
MIN_SUB_WINDOW_S = 0.1
"""Floor of the default sub-window, for fast counters (RAPL updates every millisecond)."""
SYNC_PHASES = ("commit", "prefill")
"""Phases that end in the step's host sync: the only places a sub-window read is taken."""


def default_sub_window_s(period_s: float) -> float:
    """Ten counter periods, at least :data:`MIN_SUB_WINDOW_S`."""
    return max(MIN_PERIODS * period_s, MIN_SUB_WINDOW_S)


class WindowedMeter:
    """An :class:`~refspec.energy.meters.measurement.EnergyMeter` over a counter that cannot see a phase.

    Args:
        counter: the energy counter (its ``source`` becomes the meter's).
        timer: phase timer; default: CUDA events where CUDA runs, else the host clock.
        sub_window_s: shortest sub-window between two reads, s; default
            :func:`default_sub_window_s`; at least ten counter periods.
        clock: the counter's time base, for spacing the reads (``time.perf_counter``).
        sync_phases: phases whose end may take a sub-window read.

    Raises:
        ValueError: ``sub_window_s`` shorter than ten counter periods.
    """

    def __init__(self, counter: EnergyCounter, *, timer: Timer | None = None, sub_window_s: float | None = None,
                 clock: Clock = time.perf_counter, sync_phases: Sequence[str] = SYNC_PHASES) -> None:
        floor = MIN_PERIODS * counter.period_s
        sub = default_sub_window_s(counter.period_s) if sub_window_s is None else float(sub_window_s)
        if sub < floor or sub <= 0:
            raise ValueError(f"sub_window_s={sub:g} s is shorter than {MIN_PERIODS} periods of the counter "
                             f"({counter.period_s:g} s each): use at least {floor:g} s")
        self.counter = counter
        self.source = counter.source
        self.period_s = counter.period_s
        self.sub_window_s = sub
        self.idle_w: float | None = None
        self.reads = 0
        self._timer = timer if timer is not None else default_timer()
        self._clock = clock
        self._sync_phases = frozenset(sync_phases)
        self._windows = Windows()
        self._start: CounterRead | None = None  # the open run's start read; None: no run open
        self._last_s = 0.0

    @property
    def clock(self) -> Clock:
        """The counter's time base (a loop that must span counter periods is timed on it)."""
        return self._clock

    def _read(self) -> CounterRead:
        read = self.counter.read()
        self.reads += 1
        self._last_s = read.wall_s
        return read

    def begin(self, name: str) -> None:
        """Open a phase: start its timer; the run's first phase reads the counter first."""
        marks: tuple[CounterMark, ...] = ()
        if self._start is None:
            self._start = self._read()
            marks = (CounterMark(self._start, "start", at_end=False),)
        self._windows.push(name, (self._clock(), self._timer.start(), marks))

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` phase: its time (perhaps unresolved yet), energy None, and a
        sub-window read when this phase ends in a host sync and the sub-window has passed."""
        t0, token, marks = self._windows.pop(name)
        elapsed = self._timer.stop(token, work)
        extra = self._observe(name, t0, elapsed, work)
        return Measurement(elapsed, None, self.source, extra=extra, marks=marks + self._sub_read(name))

    def _observe(self, name: str, t0: float, elapsed: float | Callable[[], float],
                 work: tuple[ForwardShape, ...]) -> tuple[tuple[str, Any], ...]:
        """Hook for a simulated counter: the phase began at ``t0`` on the clock and lasted
        ``elapsed``; learn its truth and return extra record fields."""
        return ()

    def _sub_read(self, name: str) -> tuple[CounterMark, ...]:
        if name not in self._sync_phases or self._start is None:
            return ()
        if self._clock() - self._last_s < self.sub_window_s:
            return ()
        return (CounterMark(self._read(), "sub", at_end=True),)

    def finish_run(self) -> CounterRead | None:
        """The run's end read (None when no phase ran since the last); the next phase starts a run."""
        if self._start is None:
            return None
        start, self._start = self._start, None
        read = self._read()
        span = read.wall_s - start.wall_s
        if span < MIN_PERIODS * self.period_s:
            logger.warning("the run lasted %.3g s on %s, under %d counter periods of %.3g s: its energy cannot be "
                           "resolved", span, self.source, MIN_PERIODS, self.period_s)
        return read

    def abandon_run(self) -> None:
        """Forget the open run without reading (it was aborted); the next phase starts a run."""
        self._start = None

    def measure_idle_w(self, seconds: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> float:
        """Idle power over ``seconds`` of sleep in W (at least ten counter periods); stored in ``idle_w``."""
        r0 = self.counter.read()
        sleep(seconds)
        r1 = self.counter.read()
        self.idle_w = (r1.energy_j - r0.energy_j) / (r1.wall_s - r0.wall_s)
        logger.info("idle power: %.1f W over %.2f s (%s)", self.idle_w, r1.wall_s - r0.wall_s, self.source)
        return self.idle_w

    def close(self) -> None:
        """Release the counter."""
        self.counter.close()


__all__ = ["WindowedMeter", "default_sub_window_s", "MIN_PERIODS", "SYNC_PHASES"]
