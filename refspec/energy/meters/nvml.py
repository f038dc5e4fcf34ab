"""NVML's counters read directly through ``pynvml`` (the nvidia-ml-py package), without Zeus.

Two counters per GPU, tried in this order by :func:`nvml_counter`:

* ``measured:nvml-total-energy(gpu<i>)``: NVML's cumulative total-energy counter (mJ since the
  driver loaded; Volta and newer), the counter Zeus reads. It updates every 20-100 ms.
* ``measured:nvml-power-integral(gpu<i>)``: where that counter is refused (old GPUs, some
  virtualised runtimes), the board power sampled by a background thread and integrated by the
  trapezoid rule. The power is NVML's instantaneous field ``NVML_FI_DEV_POWER_INSTANT`` (read
  through ``nvmlDeviceGetFieldValues``); where that is refused, ``nvmlDeviceGetPowerUsage``, a
  one-second average on Ampere and later, with the reason logged and the source saying so
  (``nvml-power-integral-of-average``): trust it for windows of many seconds only.

Both are plain cumulative counters in J: :func:`nvml_counter` gives a run's
:class:`~refspec.energy.meters.windowed.WindowedMeter` one or several GPUs' (each recorded, then
summed). Tests inject a fake ``pynvml`` module and clock and assert exact numbers.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from refspec.energy.meters.counters import Device, DeviceCounter
from refspec.energy.meters.errors import NoGPUError

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

NVML_PERIOD_S = 0.1
"""NVML's total-energy counter updates every 20-100 ms; the slower bound is assumed."""


class PowerIntegral:
    """A cumulative energy counter in J made from power samples (trapezoid rule).

    Every :meth:`energy` call takes a fresh sample, so a window's end is exact to its last
    reading; the background thread (:meth:`start`) keeps samples dense in between.

    Args:
        power_w: returns the instantaneous board power in W.
        clock: seconds clock.
        period_s: sampling period of the background thread.
    """

    def __init__(self, power_w: Callable[[], float], *, clock: Clock = time.perf_counter,
                 period_s: float = 0.02) -> None:
        self._power_w = power_w
        self._clock = clock
        self.period_s = period_s
        self._lock = threading.Lock()
        self._last: tuple[float, float] | None = None
        self._joules = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Read power once and add the trapezoid since the previous sample."""
        with self._lock:
            p, t = self._power_w(), self._clock()
            if self._last is not None:
                t0, p0 = self._last
                self._joules += 0.5 * (p0 + p) * (t - t0)
            self._last = (t, p)
            self.samples += 1

    def energy(self) -> float:
        """Energy integrated since the first sample, in J (takes a sample first)."""
        self.sample()
        with self._lock:
            return self._joules

    def start(self) -> None:
        """Start the daemon sampling thread."""
        def loop() -> None:
            while not self._stop.wait(self.period_s):
                try:
                    self.sample()
                except Exception as exc:  # a failed read must not kill the run; end() reads again
                    logger.debug("power sample failed: %r", exc)

        self.sample()
        self._thread = threading.Thread(target=loop, name="refspec-power-integral", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the sampling thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None


def import_pynvml() -> Any:
    """The ``pynvml`` module (nvidia-ml-py), or NoGPUError saying how to get it."""
    try:
        import pynvml
    except ImportError as exc:
        raise NoGPUError(f"reading NVML needs the 'pynvml' module (pip install nvidia-ml-py): {exc}") from None
    return pynvml


def _nvml_error(nv: Any) -> type[BaseException]:
    return getattr(nv, "NVMLError", RuntimeError)


class _FieldRefused(RuntimeError):
    """NVML answered a field-value query with an error for that field."""


_FIELD_VALUE = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by NVML_VALUE_TYPE_*


def _instant_power_w(nv: Any, handle: Any) -> float:
    """Board power now in W from ``NVML_FI_DEV_POWER_INSTANT`` (mW) through ``nvmlDeviceGetFieldValues``."""
    value = nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
    if value.nvmlReturn != getattr(nv, "NVML_SUCCESS", 0):
        raise _FieldRefused(f"NVML_FI_DEV_POWER_INSTANT returned NVML error {value.nvmlReturn}")
    return float(getattr(value.value, _FIELD_VALUE[value.valueType])) / 1000.0


def power_reader(nv: Any, handle: Any, gpu_index: int) -> tuple[Callable[[], float], str]:
    """The best power reading of a GPU in W and its kind: the instantaneous field
    (``power-instant``), else ``nvmlDeviceGetPowerUsage`` (``power-average``: a one-second
    average on Ampere and later, except GA100), the reason logged.

    Raises:
        NVMLError (the module's): neither can be read.
    """
    err = _nvml_error(nv)
    if not hasattr(nv, "NVML_FI_DEV_POWER_INSTANT") or not hasattr(nv, "nvmlDeviceGetFieldValues"):
        reason = "this pynvml has no NVML_FI_DEV_POWER_INSTANT field (a newer nvidia-ml-py has it)"
    else:
        try:
            _instant_power_w(nv, handle)
            return (lambda: _instant_power_w(nv, handle)), "power-instant"
        except (err, _FieldRefused, IndexError, AttributeError) as exc:
            reason = f"NVML refused the instantaneous power field ({exc})"
    nv.nvmlDeviceGetPowerUsage(handle)
    logger.warning("gpu%d: %s; integrating nvmlDeviceGetPowerUsage instead, a one-second average on Ampere and "
                   "later: trust windows of many seconds only", gpu_index, reason)
    return (lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0), "power-average"


def _gpu_energy(nv: Any, handle: Any, gpu_index: int, *, clock: Clock, power_period_s: float,
                start_thread: bool) -> tuple[str, Callable[[], float], Callable[[], None] | None]:
    """``(kind, cumulative J, stop)`` of one GPU: NVML's total-energy counter, else the integral
    of its power. Raises NoGPUError when neither can be read."""
    err = _nvml_error(nv)
    try:
        nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        return "nvml-total-energy", (lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0), None
    except err as exc:
        refused = exc
    logger.warning("NVML refused the total-energy counter of gpu%d (%s): integrating power samples instead",
                   gpu_index, refused)
    try:
        power, kind = power_reader(nv, handle, gpu_index)
    except err as exc:
        raise NoGPUError(f"NVML on GPU {gpu_index} refused both the total-energy counter ({refused}) and the "
                         f"power reading ({exc}): no energy can be measured") from exc
    integral = PowerIntegral(power, clock=clock, period_s=power_period_s)
    if start_thread:
        integral.start()
    suffix = "" if kind == "power-instant" else "-of-average"
    return f"nvml-power-integral{suffix}", integral.energy, integral.stop


def _open_nvml(nv: Any, gpu_indices: Sequence[int]) -> list[Any]:
    try:
        nv.nvmlInit()
    except _nvml_error(nv) as exc:
        raise NoGPUError(f"NVML cannot open GPU {gpu_indices[0]}: {exc}") from exc
    handles = []
    for i in gpu_indices:
        try:
            handles.append(nv.nvmlDeviceGetHandleByIndex(i))
        except _nvml_error(nv) as exc:
            getattr(nv, "nvmlShutdown", lambda: None)()
            raise NoGPUError(f"NVML cannot open GPU {i}: {exc}") from exc
    return handles


def nvml_counter(gpu_indices: Sequence[int] = (0,), *, pynvml_module: Any | None = None,
                 clock: Clock = time.perf_counter, power_period_s: float = 0.02,
                 start_thread: bool = True) -> DeviceCounter:
    """A cumulative counter over one or more GPUs read through ``pynvml``, each device its
    total-energy counter (else its power integral), recorded apart and summed.

    Raises:
        NoGPUError: no ``pynvml``, NVML does not start, no GPU of ``gpu_indices``, or one of them
            supports neither the energy counter nor the power reading; the message gives each
            reason.
    """
    nv = pynvml_module if pynvml_module is not None else import_pynvml()
    handles = _open_nvml(nv, list(gpu_indices))
    devices, stops = [], []
    try:
        for i, handle in zip(gpu_indices, handles):
            kind, energy, stop = _gpu_energy(nv, handle, i, clock=clock, power_period_s=power_period_s,
                                             start_thread=start_thread)
            devices.append(Device(f"gpu{i}", kind, energy))
            stops += [stop] if stop is not None else []
    except NoGPUError:
        for stop in stops:
            stop()
        getattr(nv, "nvmlShutdown", lambda: None)()
        raise

    def close() -> None:
        for stop in stops:
            stop()
        getattr(nv, "nvmlShutdown", lambda: None)()

    return DeviceCounter(devices, period_s=NVML_PERIOD_S, clock=clock, close=close)


def sm_clock_reader(gpu_index: int = 0, *, pynvml_module: Any | None = None) -> Callable[[], float] | None:
    """A passive reader of GPU ``gpu_index``'s current SM clock in MHz, or None where NVML cannot
    read it. It only reads: clocks are never locked or reset here (see
    :mod:`refspec.energy.meters.dvfs` for sweeps on one's own GPU)."""
    try:
        nv = pynvml_module if pynvml_module is not None else import_pynvml()
    except NoGPUError as exc:
        logger.info("no SM clock reading on gpu%d: %s", gpu_index, exc)
        return None
    sm = getattr(nv, "NVML_CLOCK_SM", 1)
    try:
        nv.nvmlInit()
        handle = nv.nvmlDeviceGetHandleByIndex(gpu_index)
        nv.nvmlDeviceGetClockInfo(handle, sm)
    except _nvml_error(nv) as exc:
        logger.info("no SM clock reading on gpu%d: %s", gpu_index, exc)
        return None
    return lambda: float(nv.nvmlDeviceGetClockInfo(handle, sm))


__all__ = ["NVML_PERIOD_S", "PowerIntegral", "import_pynvml", "power_reader", "nvml_counter", "sm_clock_reader"]
