"""Fakes shared by the meter and counter tests."""
from __future__ import annotations


class World:
    """A fake clock (s) and cumulative energy counter (J) that tests advance by hand."""

    def __init__(self) -> None:
        self.t, self.e = 100.0, 5000.0

    def clock(self) -> float:
        return self.t

    def energy(self) -> float:
        return self.e

    def advance(self, dt: float, de: float) -> None:
        self.t += dt
        self.e += de
