"""NVML's total-energy counter of one or more GPUs read through Zeus (:class:`ZeusCounter`), a
cumulative counter for a run's :class:`~refspec.energy.meters.windowed.WindowedMeter`."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from refspec.energy.meters.counters import CounterRead
from refspec.energy.meters.errors import NoGPUError
from refspec.energy.meters.nvml import NVML_PERIOD_S


def zeus_monitor(gpu_indices: Sequence[int]) -> Any:
    """A ``zeus.monitor.ZeusMonitor`` of ``gpu_indices`` that synchronises CUDA before each read.

    Raises:
        NoGPUError: no CUDA GPU is visible, no ``zeus``, or Zeus cannot monitor the GPUs.
    """
    import torch

    gpus = list(gpu_indices)
    if not torch.cuda.is_available():
        raise NoGPUError("Zeus needs an NVIDIA GPU: torch.cuda.is_available() is False. "
                         "Use make_meter('roofline') for modelled energy or make_meter('time') for time only.")
    try:
        from zeus.monitor import ZeusMonitor
    except ImportError as exc:
        raise NoGPUError(f"reading NVML through Zeus needs the 'zeus' package (pip install 'zeus>=0.12'): {exc}") \
            from None
    try:
        return ZeusMonitor(gpu_indices=gpus, cpu_indices=[], sync_execution_with="torch")
    except Exception as exc:
        if not is_no_gpu_error(exc):
            raise
        raise NoGPUError(f"Zeus cannot monitor GPU {', '.join(map(str, gpus))}: {type(exc).__name__}: {exc}") from exc


class ZeusCounter:
    """NVML's total-energy counter of one or more GPUs read through Zeus, as a cumulative
    counter: one Zeus window stays open, and each read closes it, adds its per-GPU energy to
    the totals and opens the next. Zeus synchronises CUDA at every read, so read only where the
    host has synchronised anyway (a run's bounds, the end of a step).

    Args:
        gpu_indices: CUDA indices of the GPUs, each recorded as ``gpu<i>`` and summed.
        period_s: the counter's update period.
        monitor: ZeusMonitor's window API (tests inject a fake); :func:`zeus_monitor` when None.
        clock: time base of the reads.

    Raises:
        NoGPUError: no CUDA GPU, no ``zeus``, or Zeus cannot monitor the GPUs.
    """

    def __init__(self, gpu_indices: Sequence[int] = (0,), *, period_s: float = NVML_PERIOD_S,
                 monitor: Any | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.gpu_indices = tuple(gpu_indices)
        self.source = f"measured:nvml-total-energy({','.join(f'gpu{i}' for i in self.gpu_indices)})"
        self.period_s = period_s
        self._monitor = monitor if monitor is not None else zeus_monitor(self.gpu_indices)
        self._totals = {f"gpu{i}": 0.0 for i in self.gpu_indices}
        self._clock = clock
        self._key: str | None = None
        self._serial = 0

    def read(self) -> CounterRead:
        """Close the open window into the totals and open the next one."""
        if self._key is not None:
            zm = self._monitor.end_window(self._key)
            for i, joules in zm.gpu_energy.items():
                self._totals[f"gpu{i}"] += float(joules)
        self._serial += 1
        self._key = f"refspec:counter:{self._serial}"
        self._monitor.begin_window(self._key)
        totals = dict(self._totals)
        return CounterRead(energy_j=sum(totals.values()), devices=totals, wall_s=self._clock())

    def close(self) -> None:
        """Nothing to release (Zeus keeps NVML open for the process)."""


def is_no_gpu_error(exc: BaseException) -> bool:
    """Whether ``exc`` from Zeus means "this GPU cannot be monitored here".

    Zeus raises ``ValueError`` for an index without a GPU and its own family of GPU errors
    (``ZeusGPUNotSupportedError``, ``ZeusGPUInitError``, ...; all defined in ``zeus.*``
    modules) when NVML is missing or refuses the device; all of them send the caller to the
    next counter.
    """
    return isinstance(exc, (ValueError, RuntimeError)) or type(exc).__module__.split(".")[0] == "zeus"


__all__ = ["ZeusCounter", "zeus_monitor", "is_no_gpu_error"]
