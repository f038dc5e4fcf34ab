"""Window bookkeeping shared by the meters: open windows by name, the short-window warning,
and the meters' errors."""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

logger = logging.getLogger("refspec.energy.meters")

DEFAULT_COUNTER_PERIOD_S = 0.1  # NVML's total-energy counter updates every 20-100 ms


class MeterError(RuntimeError):
    """A window was misused: ended without being begun, or a meter cannot be built."""


class NoCounterError(RuntimeError):
    """No energy counter of the kind asked for can be read on this machine (the message says why)."""


class NoGPUError(NoCounterError):
    """An operation needs an NVIDIA GPU (with NVML) and none is visible."""


class Windows:
    """Open windows by name, each a stack of begin-states (same-name windows nest LIFO)."""

    def __init__(self) -> None:
        self._open: dict[str, list[Any]] = defaultdict(list)

    def push(self, name: str, state: Any) -> None:
        self._open[name].append(state)

    def pop(self, name: str) -> Any:
        stack = self._open.get(name)
        if not stack:
            raise MeterError(f"end({name!r}) without a matching begin({name!r}); open windows: {self.names()}")
        state = stack.pop()
        if not stack:
            del self._open[name]
        return state

    def names(self) -> list[str]:
        return sorted(self._open)


class ShortWindowWarner:
    """Warns once per window name when a counter window is too short or reads zero energy.

    Later occurrences are logged at DEBUG and counted in ``counts`` so a report can say how many
    windows were below the counter's resolution.
    """

    def __init__(self, source: str, period_s: float) -> None:
        self.source = source
        self.period_s = period_s
        self.counts: dict[str, int] = defaultdict(int)

    def check(self, name: str, time_s: float, energy_j: float) -> None:
        problems = []
        if energy_j == 0.0:
            problems.append("read 0 J")
        if time_s < self.period_s:
            problems.append(f"lasted {time_s * 1e3:.3g} ms, shorter than the counter period "
                            f"(~{self.period_s * 1e3:g} ms)")
        if not problems:
            return
        self.counts[name] += 1
        level = logging.WARNING if self.counts[name] == 1 else logging.DEBUG
        logger.log(level, "window %r %s on %s: its energy is unreliable; attribute phase energy with "
                   "refspec.energy.attribution (phase-isolated loops or NNLS over long windows)",
                   name, " and ".join(problems), self.source)
