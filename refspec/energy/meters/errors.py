"""The meters' errors: a window misused, and a counter this machine cannot read."""
from __future__ import annotations


class MeterError(RuntimeError):
    """A window was misused: ended without being begun."""


class NoCounterError(RuntimeError):
    """No energy counter of the kind asked for can be read on this machine (the message says why)."""


class NoGPUError(NoCounterError):
    """An operation needs an NVIDIA GPU (with NVML) and none is visible."""


__all__ = ["MeterError", "NoCounterError", "NoGPUError"]
