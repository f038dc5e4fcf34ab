"""Meters that give every window its figures directly: time only, a fake counter, the roofline.

========================  ===================================================================
:class:`TimeMeter`        ``none:time-only``: wall time, energy None
:class:`FakeMeter`        ``measured:fake-counter`` (configurable): injected clock and counter,
                          read at every window's bounds, for tests that assert exact numbers
:class:`RooflineMeter`    ``modelled:roofline(<profile>)``: time and energy from the analytic
                          model of the window's work; ``modelled:roofline(<profile>,wall-time)``
                          when the time is the wall clock and only the energy is modelled
========================  ===================================================================

A hardware counter cannot see a millisecond phase, so a run metered by one goes through
:class:`~refspec.energy.meters.windowed.WindowedMeter` instead.
"""
from __future__ import annotations

import time
from typing import Callable, Literal

from refspec.energy.meters.measurement import Measurement, Windows
from refspec.energy.meters.timers import ClockTimer
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import total_cost, work_time_s
from refspec.energy.model.work import ForwardShape

Clock = Callable[[], float]
Counter = Callable[[], float]

TIME_ONLY = "none:time-only"
FAKE_SOURCE = "measured:fake-counter"
TimeSource = Literal["model", "wall_time"]


class TimeMeter:
    """Wall time only, energy None.

    Args:
        sync: called before every clock read, e.g. ``torch.cuda.synchronize`` so queued GPU
            work is inside the window.
        clock: seconds clock (injectable for tests).
    """

    source = TIME_ONLY

    def __init__(self, sync: Callable[[], None] | None = None, clock: Clock = time.perf_counter) -> None:
        self.idle_w: float | None = None
        self._timer = ClockTimer(clock, sync=sync)
        self._windows = Windows()

    def begin(self, name: str) -> None:
        """Open a window named ``name``."""
        self._windows.push(name, self._timer.start())

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window; returns its wall time in s and energy None."""
        return Measurement(self._timer.stop(self._windows.pop(name)), None, self.source)


class FakeMeter:
    """A counter meter with an injected clock and cumulative energy counter, for exact tests.

    Window time = clock delta, window energy = counter delta, both read at the window's bounds.

    Args:
        clock: returns seconds.
        energy: returns the cumulative energy counter in J.
        source: the measurement source string.
        idle_w: idle power in W the ledger header records for net-of-idle accounting.
    """

    def __init__(self, clock: Clock, energy: Counter, *, source: str = FAKE_SOURCE,
                 idle_w: float | None = None) -> None:
        self._clock = clock
        self._energy = energy
        self.source = source
        self.idle_w = idle_w
        self._windows = Windows()

    def begin(self, name: str) -> None:
        """Open a window: record clock and counter."""
        self._windows.push(name, (self._clock(), self._energy()))

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window; returns clock and counter deltas."""
        t, e = self._clock(), self._energy()
        t0, e0 = self._windows.pop(name)
        return Measurement(t - t0, e - e0, self.source)


class RooflineMeter:
    """Modelled energy of each window from the work it did (:mod:`refspec.energy.model.roofline`).

    Two time sources, chosen at construction:

    * ``"model"``: time = sum over the window's forwards of max(FLOPs / peak, bytes / bandwidth)
      + per-forward overhead; energy = static W x that time + pJ/FLOP x FLOPs + pJ/B x bytes.
      Nothing is measured: the figures say what the profile's hardware would take, whatever
      machine ran the code. A window without forwards (commit) costs 0 s and 0 J. Source
      ``modelled:roofline(<profile>)``.
    * ``"wall_time"``: time = wall clock between begin and end (after ``sync``); energy = static W
      x that time + the same dynamic terms. Use it when the profile describes the machine
      that runs (the CPU profile): the static power then integrates over real time, including
      Python and commit overhead the roofline ignores. Source
      ``modelled:roofline(<profile>,wall-time)``: the energy is still modelled.

    Args:
        profile: hardware profile.
        time_source: ``"model"`` or ``"wall_time"``.
        sync: called before each clock read in wall-time mode.
        clock: seconds clock (injectable for tests).
    """

    def __init__(self, profile: HardwareProfile, *, time_source: TimeSource = "model",
                 sync: Callable[[], None] | None = None, clock: Clock = time.perf_counter) -> None:
        if time_source not in ("model", "wall_time"):
            raise ValueError(f"time_source must be 'model' or 'wall_time', got {time_source!r}")
        self.profile = profile
        self.time_source = time_source
        self.idle_w: float | None = profile.idle_w
        suffix = "" if time_source == "model" else ",wall-time"
        self.source = f"modelled:roofline({profile.name}{suffix})"
        self._timer = ClockTimer(clock, sync=sync) if time_source == "wall_time" else None  # modelled time reads none
        self._windows = Windows()

    def begin(self, name: str) -> None:
        """Open a window (reads the clock only in wall-time mode)."""
        self._windows.push(name, self._timer.start() if self._timer is not None else None)

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window and model the energy of ``work``."""
        token = self._windows.pop(name)
        time_s = work_time_s(work, self.profile) if self._timer is None else self._timer.stop(token)
        return Measurement(time_s, self.profile.energy_j(total_cost(work), time_s), self.source)


__all__ = ["TimeMeter", "FakeMeter", "RooflineMeter", "TIME_ONLY", "FAKE_SOURCE", "TimeSource"]
