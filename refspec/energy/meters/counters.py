"""Energy counters: cumulative joules of one or more devices, read only when a window needs them.

A counter is what the hardware offers: NVML's total-energy counter of a GPU (mJ since the
driver loaded), RAPL's package and DRAM counters of a CPU (uJ, wrapping), or a simulation of
one (:mod:`refspec.energy.meters.simulated`). It cannot see a phase of a few milliseconds: it updates
every ``period_s`` (20-100 ms on NVML) and may sample only part of each period. So
:class:`~refspec.energy.meters.windowed.WindowedMeter` reads it at a run's start and end and at
the bounds of sub-windows of at least ten periods, and never per phase; a read taken at a
phase's bound rides on that phase's measurement as a :class:`CounterMark`.

Every counter here returns a :class:`CounterRead`: the sum over its devices and each device's
own figure, so several GPUs (a tensor-parallel target) or a CPU's package and DRAM are recorded
apart and summed. Only differences between reads of one counter mean anything.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Protocol, Sequence

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class CounterRead:
    """One read of a cumulative energy counter.

    Attributes:
        energy_j: cumulative energy in J, summed over the devices.
        devices: cumulative energy in J per device name (``gpu0``, ``package-0``, ``dram-0``).
        wall_s: time of the read on the counter's own time base: ``time.perf_counter`` for a
            hardware counter; a simulated counter's clock otherwise.
        true_j: a simulated counter only: the cumulative true energy in J it samples.
    """

    energy_j: float
    devices: Mapping[str, float]
    wall_s: float
    true_j: float | None = None


@dataclasses.dataclass(frozen=True)
class CounterMark:
    """A counter read taken at a bound of one phase.

    Attributes:
        read: what the counter said.
        reason: ``start`` (before the run's first phase) or ``sub`` (a sub-window bound).
        at_end: taken when the phase ended (True) or before it began (False).
    """

    read: CounterRead
    reason: str
    at_end: bool


class EnergyCounter(Protocol):
    """A cumulative energy counter of one or more devices.

    Attributes:
        source: what is read, e.g. ``measured:nvml-total-energy(gpu0,gpu1)`` or
            ``measured:rapl(package-0,dram-0)``.
        period_s: how often the counter's value changes, in s (its resolution in time).
    """

    source: str
    period_s: float

    def read(self) -> CounterRead: ...

    def close(self) -> None: ...


class Unwrap:
    """Monotonic total of a raw counter that wraps to 0 after ``max_raw`` (RAPL's ``energy_uj``).

    Each call takes the newest raw value and returns the total since the first call, in raw
    units. A wrap shows as a raw value below the previous one and adds ``max_raw``; two reads
    more than one whole range apart (RAPL's package range is minutes to hours of full power)
    cannot be told apart from one wrap, so read at least that often.
    """

    def __init__(self, max_raw: float) -> None:
        if max_raw <= 0:
            raise ValueError(f"max_raw must be > 0, got {max_raw}")
        self.max_raw = max_raw
        self.wraps = 0
        self._last: float | None = None
        self._total = 0.0

    def __call__(self, raw: float) -> float:
        if self._last is not None:
            delta = raw - self._last
            if delta < 0:  # the counter passed max_raw and restarted at 0
                delta += self.max_raw
                self.wraps += 1
            self._total += delta
        self._last = raw
        return self._total


@dataclasses.dataclass(frozen=True)
class Device:
    """One device of a :class:`DeviceCounter`.

    Attributes:
        name: device name in records (``gpu0``, ``package-0``).
        kind: what is read, grouping devices in the source (``nvml-total-energy``, ``rapl``).
        read_j: returns the device's cumulative energy in J.
    """

    name: str
    kind: str
    read_j: Callable[[], float]


def source_of(devices: Sequence[Device], prefix: str = "measured") -> str:
    """``measured:kind(name,name)+kind(name)``: every device named under the counter it reads."""
    groups: dict[str, list[str]] = {}
    for d in devices:
        groups.setdefault(d.kind, []).append(d.name)
    return f"{prefix}:" + "+".join(f"{kind}({','.join(names)})" for kind, names in groups.items())


class DeviceCounter:
    """Several devices' cumulative counters read together and summed.

    Args:
        devices: the devices, read in this order at every read.
        period_s: the slowest device's update period in s.
        source: defaults to :func:`source_of` the devices.
        clock: time base of the reads (``time.perf_counter``; injectable for tests).
        close: called once by :meth:`close` (stop a sampling thread, shut NVML down).
    """

    def __init__(self, devices: Sequence[Device], *, period_s: float, source: str | None = None,
                 clock: Clock = time.perf_counter, close: Callable[[], None] | None = None) -> None:
        if not devices:
            raise ValueError("a DeviceCounter needs at least one device")
        names = [d.name for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        self.devices = tuple(devices)
        self.period_s = period_s
        self.source = source or source_of(devices)
        self._clock = clock
        self._close = close

    def read(self) -> CounterRead:
        """Every device's cumulative J, their sum, and the time of the read."""
        values = {d.name: float(d.read_j()) for d in self.devices}
        return CounterRead(energy_j=sum(values.values()), devices=values, wall_s=self._clock())

    def close(self) -> None:
        """Release the devices (idempotent)."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


def combine(counters: Sequence[DeviceCounter]) -> DeviceCounter:
    """One counter over the devices of several (e.g. every GPU and the CPU's package and DRAM)."""
    closers = [c.close for c in counters]

    def close() -> None:
        for c in closers:
            c()

    return DeviceCounter([d for c in counters for d in c.devices], period_s=max(c.period_s for c in counters),
                         clock=counters[0]._clock, close=close)


def callable_counter(energy: Callable[[], float], *, source: str, period_s: float = 0.0,
                     clock: Clock = time.perf_counter, device: str = "fake") -> DeviceCounter:
    """A one-device counter over an injected cumulative-J callable (tests, teaching)."""
    return DeviceCounter([Device(device, "fake", energy)], period_s=period_s, source=source, clock=clock)


__all__ = ["CounterRead", "CounterMark", "EnergyCounter", "Unwrap", "Device", "DeviceCounter", "source_of", "combine",
           "callable_counter"]
