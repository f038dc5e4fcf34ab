"""Energy meters: bracket a named window and say what it cost, and where the figure came from.

Every meter implements :class:`refspec.energy.phases.EnergyMeter`: ``begin(name)`` opens a window,
``end(name, work)`` closes the most recent open window of that name and returns a
:class:`~refspec.energy.phases.Measurement`. Windows of different names may nest or overlap; windows of
the same name nest last-in first-out. Each measurement's ``source`` says what it is.

A run's phases (milliseconds) are below any energy counter's resolution, so the meters of a run
over a counter are :class:`~refspec.energy.windowed.WindowedMeter`: phases timed, ``energy_j``
None, the counter read at the run's start and end and over sub-windows of at least ten counter
periods, the reads written as ``counter`` records (:mod:`refspec.energy.counter_log`):

========================  ===================================================================
``WindowedMeter``         over NVML's total-energy counter (``measured:nvml-total-energy(gpu0,gpu1)``,
                          read by Zeus or pynvml; a power integral where NVML refuses it,
                          :mod:`refspec.energy.nvml_meter`), RAPL's package and DRAM counters
                          (``measured:rapl(package-0,dram-0)``, :mod:`refspec.energy.rapl`)
``SimulatedMeter``        ``modelled:simulated-counter(...)``: a counter sampling the roofline's
                          per-phase energy like NVML (:mod:`refspec.energy.simulated`)
========================  ===================================================================

Meters that give every window its energy directly:

========================  ===================================================================
``RooflineMeter``         ``modelled:roofline(<profile>)``: time and energy from the analytic
                          model of the window's work; or ``modelled:roofline(<profile>,wall-time)``
                          when the time is the wall clock and only the energy is modelled
``TimeMeter``             ``none:time-only``: wall time, energy None
``FakeMeter``             ``measured:fake-counter`` (configurable): injected clock and counter,
                          for tests that assert exact numbers
``ZeusMeter``,            ``measured:nvml-total-energy(gpu<i>)``: explicit windows over one GPU's
``CounterMeter``          counter (Zeus; pynvml), for windows long enough to resolve (phase loops,
                          idle power; :func:`measured_gpu_meter`)
========================  ===================================================================

:func:`make_meter` builds one from a ``--meter`` spec (:mod:`refspec.energy.meter_spec`); ``"auto"``
takes a GPU's NVML counter (Zeus, then pynvml), else this CPU's RAPL counter, else the roofline
model (labelled modelled).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from refspec.energy.hardware import HardwareProfile, cpu_profile, get_profile
from refspec.energy.phases import ForwardShape, Measurement
from refspec.energy.roofline import total_cost, work_time_s
from refspec.energy.windows import (DEFAULT_COUNTER_PERIOD_S, MeterError, NoCounterError,  # noqa: F401  (re-exported)
                                    NoGPUError, ShortWindowWarner, Windows)
from refspec.energy.meter_spec import MeterSpecError, parse_meter_spec  # noqa: F401  (re-exported)
from refspec.energy.nvml_meter import CounterMeter, nvml_counter, nvml_meter
from refspec.energy.rapl import POWERCAP_ROOT, rapl_counter
from refspec.energy.simulated import DEFAULT_PERIOD_MS, SimulatedMeter
from refspec.energy.windowed import WindowedMeter
from refspec.energy.zeus_meter import ZeusCounter, ZeusMeter, nvml_energy_counter_available  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Counter = Callable[[], float]

TIME_ONLY = "none:time-only"
FAKE_SOURCE = "measured:fake-counter"


class TimeMeter:
    """Wall time only (``time.perf_counter``), energy None.

    Args:
        sync: called before every clock read, e.g. ``torch.cuda.synchronize`` so queued GPU
            work is inside the window.
        clock: seconds clock (injectable for tests).
    """

    source = TIME_ONLY

    def __init__(self, sync: Callable[[], None] | None = None, clock: Clock = time.perf_counter) -> None:
        self._sync = sync
        self._clock = clock
        self._windows = Windows()

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    def begin(self, name: str) -> None:
        """Open a window named ``name``."""
        self._windows.push(name, self._now())

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window; returns its wall time in s and energy None."""
        t = self._now()
        return Measurement(time_s=t - self._windows.pop(name), energy_j=None, source=self.source)


class FakeMeter:
    """A counter meter with an injected clock and cumulative energy counter, for exact tests.

    Window time = clock delta, window energy = counter delta, exactly as the NVML counter is read.
    Windows shorter than ``counter_period_s`` or with zero energy are reported like ZeusMeter does.

    Args:
        clock: returns seconds.
        energy: returns the cumulative energy counter in J.
        source: the measurement source string.
        counter_period_s: counter update period used for the short-window warning (0 disables).
        idle_w: idle power in W the ledger header records for net-of-idle accounting.
    """

    def __init__(self, clock: Clock, energy: Counter, *, source: str = FAKE_SOURCE,
                 counter_period_s: float = 0.0, idle_w: float | None = None) -> None:
        self._clock = clock
        self._energy = energy
        self.source = source
        self.idle_w = idle_w
        self._windows = Windows()
        self.short_windows = ShortWindowWarner(source, counter_period_s)

    def begin(self, name: str) -> None:
        """Open a window: record clock and counter."""
        self._windows.push(name, (self._clock(), self._energy()))

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window; returns clock and counter deltas."""
        t, e = self._clock(), self._energy()
        t0, e0 = self._windows.pop(name)
        m = Measurement(time_s=t - t0, energy_j=e - e0, source=self.source)
        self.short_windows.check(name, m.time_s, m.energy_j)
        return m


TimeSource = Literal["model", "wall_time"]


class RooflineMeter:
    """Modelled energy of each window from the work it did (:mod:`refspec.energy.roofline`).

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
        # the windows and the wall clock are a TimeMeter's; with modelled time no clock is read
        self._timer = TimeMeter(sync, clock) if time_source == "wall_time" else TimeMeter(clock=lambda: 0.0)

    def begin(self, name: str) -> None:
        """Open a window (reads the clock only in wall-time mode)."""
        self._timer.begin(name)

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        """Close the latest ``name`` window and model the energy of ``work``."""
        wall_s = self._timer.end(name).time_s
        cost = total_cost(work)
        time_s = work_time_s(work, self.profile) if self.time_source == "model" else wall_s
        return Measurement(time_s=time_s, energy_j=self.profile.energy_j(cost, time_s), source=self.source)


def _cuda_sync() -> Callable[[], None] | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.synchronize if torch.cuda.is_available() else None


def _profile_for_this_gpu(gpu_index: int) -> HardwareProfile | None:
    import torch

    name = torch.cuda.get_device_name(gpu_index).lower()
    for key in ("h200", "h100"):
        if key in name:
            return get_profile(key)
    return None


def make_meter(kind: str = "auto", *, gpu_index: int = 0, profile: str | HardwareProfile | None = None,
               time_source: TimeSource | None = None, dtype_bytes: int = 2, clock: Clock | None = None,
               energy: Counter | None = None, powercap_root: str | Path = POWERCAP_ROOT, **fake_kwargs: Any) -> Any:
    """Build an energy meter from a ``--meter`` spec (:mod:`refspec.energy.meter_spec`).

    Args:
        kind: the spec, ``KIND[:PROFILE][:key=value]...``: ``zeus`` / ``nvml`` (NVML's counter of
            the GPU, or of ``gpus=0,1`` summed), ``rapl`` (CPU package and DRAM), ``simulated:PROFILE``
            (a simulated counter over the roofline's truth), ``roofline[:PROFILE]`` (modelled),
            ``time`` (time only), ``auto`` (a GPU's NVML counter, else this CPU's RAPL, else the
            roofline: a GPU's data-sheet profile, or this CPU's benchmarked one in wall-time
            mode), or ``fake`` (API only: needs ``clock`` and ``energy``). Counter meters are
            :class:`~refspec.energy.windowed.WindowedMeter`: they time phases and read the counter
            only over windows it resolves.
        gpu_index: GPU to meter when the spec names none.
        profile: roofline profile name or object; overrides the spec's.
        time_source: roofline time source; default ``"wall_time"`` for a benchmarked (CPU)
            profile, the machine that runs, and ``"model"`` for a data-sheet (GPU) profile.
        dtype_bytes: element size the CPU profile is benchmarked for.
        clock: clock for ``fake`` (and optionally ``time``).
        energy: cumulative energy counter in J for ``fake``.
        powercap_root: where RAPL's powercap tree is (a fake tree in tests).
        **fake_kwargs: passed to :class:`FakeMeter` (``source``, ``counter_period_s``, ``idle_w``).

    Returns:
        An object implementing :class:`refspec.energy.phases.EnergyMeter`.

    Raises:
        MeterSpecError: a spec that does not parse (a ValueError).
        NoCounterError: ``zeus``/``nvml`` without a usable GPU (:class:`NoGPUError`), ``rapl``
            without a readable RAPL counter.
        ValueError: an unknown profile, ``fake`` without clock and counter, or a sub-window
            shorter than ten counter periods.
    """
    if kind == "fake":
        if clock is None or energy is None:
            raise ValueError("make_meter('fake') needs clock= and energy= callables")
        return FakeMeter(clock, energy, **fake_kwargs)
    spec = parse_meter_spec(kind)
    opts = spec.options
    gpus = opts.get("gpus", (gpu_index,))
    sub = opts.get("sub_window_s")
    if spec.kind == "time":
        return TimeMeter(sync=_cuda_sync(), clock=clock or time.perf_counter)
    if spec.kind == "zeus":
        return WindowedMeter(ZeusCounter(gpus), sub_window_s=sub)
    if spec.kind == "nvml":
        return WindowedMeter(nvml_counter(gpus), sub_window_s=sub)
    if spec.kind == "rapl":
        return WindowedMeter(rapl_counter(opts.get("domains"), root=opts.get("root", powercap_root)), sub_window_s=sub)
    if spec.kind == "auto":
        return _auto_meter(gpus, time_source, dtype_bytes, sub, opts.get("root", powercap_root))
    prof = _roofline_profile(profile if profile is not None else spec.profile, gpu_index, dtype_bytes)
    time_source = time_source or ("wall_time" if prof.benchmarked else "model")
    if spec.kind == "roofline":
        return RooflineMeter(prof, time_source=time_source, sync=_cuda_sync(), clock=clock or time.perf_counter)
    if spec.kind == "simulated":
        period_s = opts.get("period_ms", DEFAULT_PERIOD_MS) / 1e3
        sample_s = opts["sample_ms"] / 1e3 if "sample_ms" in opts else None
        return SimulatedMeter(prof, time_source=time_source, period_s=period_s, sample_s=sample_s,
                              noise=opts.get("noise", 0.0), seed=opts.get("seed", 0), sub_window_s=sub,
                              clock=clock or time.perf_counter)
    raise AssertionError(f"meter kind {spec.kind!r} parsed but not built")


def _roofline_profile(profile: str | HardwareProfile | None, gpu_index: int, dtype_bytes: int) -> HardwareProfile:
    """The profile asked for, else this GPU's data-sheet profile, else this CPU's benchmarked one."""
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is not None:
        return get_profile(profile, dtype_bytes)
    gpu = _profile_for_this_gpu(gpu_index) if _cuda_sync() is not None else None
    return gpu if gpu is not None else cpu_profile(dtype_bytes)


def _zeus_else_pynvml(zeus: Callable[[], Any], pynvml: Callable[[], Any], what: str, *, try_zeus: bool) -> Any:
    """``zeus()``, else ``pynvml()``; NoGPUError naming each one's reason when neither builds."""
    reasons = []
    if try_zeus:
        try:
            return zeus()
        except NoGPUError as exc:
            reasons.append(f"zeus: {exc}")
        except Exception as exc:  # a broken zeus install must not cost the counter pynvml can read
            logger.warning("zeus failed unexpectedly (%s: %s); trying pynvml", type(exc).__name__, exc)
            reasons.append(f"zeus: {type(exc).__name__}: {exc}")
    try:
        return pynvml()
    except NoGPUError as exc:
        reasons.append(f"pynvml: {exc}")
    raise NoGPUError(f"no measured energy {what}: {'; '.join(reasons)}")


def measured_gpu_meter(gpu_index: int = 0, *, sync: Callable[[], None] | None = None,
                       pynvml_module: Any | None = None) -> Any:
    """A window meter of GPU ``gpu_index`` for explicit long windows (phase loops, idle power):
    Zeus (NVML's counter), else pynvml's total-energy counter, else pynvml's power integral.

    Raises:
        NoGPUError: none can be built; the message gives each one's reason.
    """
    return _zeus_else_pynvml(lambda: ZeusMeter(gpu_index),
                             lambda: nvml_meter(gpu_index, sync=sync, pynvml_module=pynvml_module),
                             f"meter for GPU {gpu_index}", try_zeus=pynvml_module is None)


def measured_gpu_counter(gpu_indices: Sequence[int] = (0,), *, pynvml_module: Any | None = None) -> Any:
    """The cumulative counter of a run's :class:`~refspec.energy.windowed.WindowedMeter` over
    ``gpu_indices``: Zeus, else pynvml (the total-energy counter, else the power integral).

    Raises:
        NoGPUError: neither can be built; the message gives each one's reason.
    """
    return _zeus_else_pynvml(lambda: ZeusCounter(gpu_indices),
                             lambda: nvml_counter(gpu_indices, pynvml_module=pynvml_module),
                             f"counter for GPU {','.join(map(str, gpu_indices))}", try_zeus=pynvml_module is None)


def _auto_meter(gpus: Sequence[int], time_source: TimeSource | None, dtype_bytes: int, sub_window_s: float | None,
                powercap_root: str | Path) -> Any:
    """A GPU's measured counter; a GPU none can read: its roofline profile or time only; no GPU:
    this CPU's RAPL counter, else its benchmarked roofline profile (modelled)."""
    sync = _cuda_sync()
    if sync is None:
        try:
            return WindowedMeter(rapl_counter(root=powercap_root), sub_window_s=sub_window_s)
        except NoCounterError as exc:
            logger.info("no RAPL counter, so CPU energy is modelled: %s", exc)
        return RooflineMeter(cpu_profile(dtype_bytes), time_source=time_source or "wall_time")
    try:
        return WindowedMeter(measured_gpu_counter(gpus), sub_window_s=sub_window_s)
    except NoGPUError as exc:
        logger.warning("%s", exc)
    prof = _profile_for_this_gpu(gpus[0])
    if prof is None:
        logger.warning("GPU %d has no NVML energy counter and no known profile: metering time only", gpus[0])
        return TimeMeter(sync=sync)
    logger.warning("GPU %d has no NVML energy counter: energy is modelled with %s", gpus[0], prof.name)
    return RooflineMeter(prof, time_source=time_source or "wall_time", sync=sync)


__all__: Sequence[str] = ("TimeMeter", "FakeMeter", "ZeusMeter", "CounterMeter", "RooflineMeter", "WindowedMeter",
                          "SimulatedMeter", "make_meter", "measured_gpu_meter", "measured_gpu_counter", "MeterError",
                          "NoGPUError", "NoCounterError", "nvml_energy_counter_available")
