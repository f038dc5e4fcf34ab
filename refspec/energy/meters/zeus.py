"""NVML's total-energy counter read through Zeus: a window meter of one GPU (:class:`ZeusMeter`)
and a cumulative counter of one or more (:class:`ZeusCounter`) for a run's
:class:`~refspec.energy.windowed.WindowedMeter`."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from refspec.energy.counters import CounterRead
from refspec.energy.phases import ForwardShape, Measurement
from refspec.energy.windows import DEFAULT_COUNTER_PERIOD_S, NoGPUError, ShortWindowWarner, Windows

logger = logging.getLogger("refspec.energy.meters")


class ZeusMeter:
    """NVML total-energy counter of one GPU, read through ``zeus.monitor.ZeusMonitor``.

    Each window is a Zeus window with a unique key (``refspec:<name>:<serial>``), so windows may
    nest and overlap. Zeus synchronises CUDA before each read. The energy is the sum of the
    window's ``gpu_energy`` over the monitored GPU. A window shorter than the counter's update
    period (20-100 ms) or reading 0 J is logged (once per name at WARNING, then DEBUG) and
    counted in ``short_windows.counts``.

    Args:
        gpu_index: CUDA index of the GPU to meter.
        counter_period_s: the counter period assumed for the short-window warning.
        monitor: an object with ZeusMonitor's ``begin_window(key)`` / ``end_window(key)``;
            built lazily from ``zeus`` when None (tests inject a fake).

    Raises:
        NoGPUError: no CUDA GPU is visible, or Zeus cannot monitor it.
    """

    def __init__(self, gpu_index: int = 0, *, counter_period_s: float = DEFAULT_COUNTER_PERIOD_S,
                 monitor: Any | None = None) -> None:
        self.gpu_index = gpu_index
        self.source = f"measured:nvml-total-energy(gpu{gpu_index})"
        self.idle_w: float | None = None
        self._monitor = monitor if monitor is not None else self._build_monitor(gpu_index)
        self._windows = Windows()
        self._serial = 0
        self.short_windows = ShortWindowWarner(self.source, counter_period_s)

    @staticmethod
    def _build_monitor(gpu_index: int | Sequence[int]) -> Any:
        import torch

        gpus = [gpu_index] if isinstance(gpu_index, int) else list(gpu_index)

        if not torch.cuda.is_available():
            raise NoGPUError("ZeusMeter needs an NVIDIA GPU: torch.cuda.is_available() is False. "
                             "Use make_meter('roofline') for modelled energy or make_meter('time') for time only.")
        try:
            from zeus.monitor import ZeusMonitor
        except ImportError as exc:
            raise NoGPUError(f"ZeusMeter needs the 'zeus' package (pip install 'zeus>=0.12'): {exc}") from None
        try:
            return ZeusMonitor(gpu_indices=gpus, cpu_indices=[], sync_execution_with="torch")
        except Exception as exc:
            if not is_no_gpu_error(exc):
                raise
            raise NoGPUError(f"Zeus cannot monitor GPU {', '.join(map(str, gpus))}: {type(exc).__name__}: {exc}") \
                from exc

    def begin(self, name: str) -> None:
        """Open a Zeus window for ``name``."""
        self._serial += 1
        key = f"refspec:{name}:{self._serial}"
        self._monitor.begin_window(key)
        self._windows.push(name, key)

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window; returns Zeus's time and the GPU's energy in J."""
        key = self._windows.pop(name)
        zm = self._monitor.end_window(key)
        energy = float(sum(zm.gpu_energy.values()))
        m = Measurement(time_s=float(zm.time), energy_j=energy, source=self.source)
        self.short_windows.check(name, m.time_s, energy)
        return m

    def measure_idle_w(self, seconds: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> float:
        """Measure idle power over ``seconds`` of sleep (GPU idle), store it in ``idle_w``, in W.

        Use at least 10 counter periods (the default 5 s is 50).
        """
        self.begin("idle")
        sleep(seconds)
        m = self.end("idle")
        self.idle_w = (m.energy_j or 0.0) / m.time_s
        logger.info("idle power of gpu%d: %.1f W over %.2f s (%s)", self.gpu_index, self.idle_w, m.time_s, self.source)
        return self.idle_w


class ZeusCounter:
    """NVML's total-energy counter of one or more GPUs read through Zeus, as a cumulative
    counter: one Zeus window stays open, and each read closes it, adds its per-GPU energy to
    the totals and opens the next. Zeus synchronises CUDA at every read, so read only where the
    host has synchronised anyway (a run's bounds, the end of a step).

    Args:
        gpu_indices: CUDA indices of the GPUs, each recorded as ``gpu<i>`` and summed.
        period_s: the counter's update period.
        monitor: ZeusMonitor's window API (tests inject a fake); built from ``zeus`` when None.
        clock: time base of the reads.

    Raises:
        NoGPUError: no CUDA GPU, no ``zeus``, or Zeus cannot monitor the GPUs.
    """

    def __init__(self, gpu_indices: Sequence[int] = (0,), *, period_s: float = DEFAULT_COUNTER_PERIOD_S,
                 monitor: Any | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.gpu_indices = tuple(gpu_indices)
        self.source = f"measured:nvml-total-energy({','.join(f'gpu{i}' for i in self.gpu_indices)})"
        self.period_s = period_s
        self._monitor = monitor if monitor is not None else ZeusMeter._build_monitor(self.gpu_indices)
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
    next meter.
    """
    return isinstance(exc, (ValueError, RuntimeError)) or type(exc).__module__.split(".")[0] == "zeus"


def nvml_energy_counter_available(gpu_index: int = 0) -> bool:
    """Whether CUDA is up and NVML's total-energy counter is readable on ``gpu_index``."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from zeus.device import get_gpus

        return bool(get_gpus().supports_get_total_energy_consumption(gpu_index))
    except Exception as exc:  # zeus raises a family of init errors; any of them means "no counter"
        logger.debug("no NVML energy counter on gpu%d: %r", gpu_index, exc)
        return False
