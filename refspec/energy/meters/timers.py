"""Phase timers: how a meter times a window.

A timer's ``start()`` returns a token; ``stop(token, work)`` returns the window's time in s, or a
callable that returns it once the device has finished (CUDA events, resolved after the step's
own host sync). :class:`ClockTimer` reads a host clock, synchronising first when given a
``sync`` (``torch.cuda.synchronize`` puts queued GPU work inside the window; a windowed counter
meter times without it); :class:`CudaEventTimer` records a pair of CUDA events and waits for
nothing inside the phase.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from refspec.energy.model.work import ForwardShape

Clock = Callable[[], float]


class Timer(Protocol):
    """Times one window: ``stop(start())`` is its time in s, or a resolver of it."""

    def start(self) -> Any: ...

    def stop(self, token: Any, work: tuple[ForwardShape, ...] = ()) -> float | Callable[[], float]: ...


class ClockTimer:
    """Phase time from a host clock: right on a CPU, where a phase's work is done when its Python
    returns, and on a GPU when ``sync`` waits for the queued work first.

    Args:
        clock: seconds clock (injectable for tests).
        sync: called before every clock read (``torch.cuda.synchronize``); None: no sync.
    """

    def __init__(self, clock: Clock = time.perf_counter, *, sync: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self._sync = sync

    def now(self) -> float:
        """The clock, after ``sync``."""
        if self._sync is not None:
            self._sync()
        return self._clock()

    def start(self) -> float:
        return self.now()

    def stop(self, token: float, work: tuple[ForwardShape, ...] = ()) -> float:
        return self.now() - token


class CudaEventTimer:
    """Phase time from a pair of CUDA events on the current stream: recording them does not
    synchronise; the elapsed time is read lazily, after the step's own host sync has completed
    them (reading earlier waits for the end event)."""

    def __init__(self) -> None:
        import torch

        self._event = lambda: torch.cuda.Event(enable_timing=True)

    def start(self) -> Any:
        ev = self._event()
        ev.record()
        return ev

    def stop(self, token: Any, work: tuple[ForwardShape, ...] = ()) -> Callable[[], float]:
        end = self._event()
        end.record()

        def resolve() -> float:
            end.synchronize()  # returns at once after the step's sync
            return token.elapsed_time(end) / 1e3  # ms -> s

        return resolve


def default_timer() -> ClockTimer | CudaEventTimer:
    """CUDA events where CUDA runs, else the host clock (no sync)."""
    try:
        import torch
    except ImportError:
        return ClockTimer()
    return CudaEventTimer() if torch.cuda.is_available() else ClockTimer()


__all__ = ["Timer", "ClockTimer", "CudaEventTimer", "default_timer"]
