"""The meter API: what a metered window returns, and the protocol every meter implements.

A meter brackets named windows: ``begin(name)`` opens one, ``end(name, work)`` closes the most
recent open window of that name and returns a :class:`Measurement`. Windows of different names
may nest or overlap; windows of the same name nest last-in first-out (:class:`Windows` keeps
them). A measurement's ``source`` says what its energy figure is: ``measured:<counter>`` (a
hardware counter read over the window), ``modelled:<model>`` (the roofline, a simulated counter)
or ``none:time-only``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Protocol, Sequence

from refspec.energy.meters.counters import CounterMark
from refspec.energy.meters.errors import MeterError
from refspec.energy.model.work import ForwardShape


class Measurement:
    """Time and energy of one metered window, and where the energy figure came from.

    Args:
        time_s: the window's time in s; or a callable returning it, called once when
            :attr:`time_s` is first read (a pair of CUDA events completes only after the step's
            own host sync, so the engine reads the time after it).
        energy_j: the window's energy in J; None for a time-only meter and for a counter that
            cannot see the window (its reads ride on ``marks``).
        source: ``measured:<counter>``, ``modelled:<model>`` or ``none:time-only``.
        extra: further ``(field, value)`` pairs of the window the ledger copies into the phase
            record (a simulated counter's ``energy_true_j``).
        marks: the counter reads taken at the window's bounds (a windowed counter meter's).
    """

    __slots__ = ("_time", "energy_j", "source", "extra", "marks")

    def __init__(self, time_s: float | Callable[[], float], energy_j: float | None, source: str,
                 extra: Sequence[tuple[str, Any]] = (), marks: Sequence[CounterMark] = ()) -> None:
        object.__setattr__(self, "_time", time_s)
        object.__setattr__(self, "energy_j", energy_j)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "extra", tuple(extra))
        object.__setattr__(self, "marks", tuple(marks))

    @property
    def time_s(self) -> float:
        """The window's time in s (resolved on first read when the meter gave a callable)."""
        t = self._time
        if callable(t):
            t = float(t())
            object.__setattr__(self, "_time", t)
        return t

    @property
    def measured(self) -> bool:
        """Whether the energy figure was read from a hardware counter."""
        return self.source.startswith("measured")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Measurement is immutable (cannot set {name!r})")

    def _key(self) -> tuple[Any, ...]:
        return self.time_s, self.energy_j, self.source, self.extra, self.marks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Measurement) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles carry the resolved time
        return Measurement, self._key()

    def __repr__(self) -> str:
        return (f"Measurement(time_s={self.time_s!r}, energy_j={self.energy_j!r}, source={self.source!r}, "
                f"extra={self.extra!r}, marks={self.marks!r})")


class EnergyMeter(Protocol):
    """Brackets named windows; ``end`` returns what the window cost.

    Attributes:
        source: the source of every measurement it returns.
        idle_w: idle power in W for net-of-idle figures (measured, or the profile's when
            modelled); None when unknown.
    """

    source: str
    idle_w: float | None

    def begin(self, name: str) -> None: ...

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement: ...


class Windows:
    """Open windows by name, each a stack of begin-states (same-name windows nest LIFO)."""

    def __init__(self) -> None:
        self._open: dict[str, list[Any]] = defaultdict(list)

    def push(self, name: str, state: Any) -> None:
        self._open[name].append(state)

    def pop(self, name: str) -> Any:
        """The begin-state of the latest open ``name`` window.

        Raises:
            MeterError: no ``name`` window is open.
        """
        stack = self._open.get(name)
        if not stack:
            raise MeterError(f"end({name!r}) without a matching begin({name!r}); open windows: {self.names()}")
        state = stack.pop()
        if not stack:
            del self._open[name]
        return state

    def names(self) -> list[str]:
        return sorted(self._open)


__all__ = ["Measurement", "EnergyMeter", "Windows"]
