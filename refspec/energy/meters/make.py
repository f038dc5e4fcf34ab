"""A meter from its ``--meter`` spec: :func:`make_meter`.

The spec's grammar is :mod:`refspec.energy.meters.spec`'s. Counter kinds (``zeus``, ``nvml``,
``rapl``, ``simulated``) give a :class:`~refspec.energy.meters.windowed.WindowedMeter` (phases
timed, the counter read only over windows it resolves); ``roofline``, ``time`` and ``fake`` give
the meters of :mod:`refspec.energy.meters.direct`. ``"auto"`` takes a GPU's NVML counter (Zeus,
then pynvml), else this CPU's RAPL counter, else the roofline model (labelled modelled).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from refspec.energy.meters.counters import DeviceCounter
from refspec.energy.meters.direct import FAKE_SOURCE, FakeMeter, RooflineMeter, TimeMeter, TimeSource
from refspec.energy.meters.errors import NoCounterError, NoGPUError
from refspec.energy.meters.measurement import EnergyMeter
from refspec.energy.meters.nvml import nvml_counter
from refspec.energy.meters.rapl import POWERCAP_ROOT, rapl_counter
from refspec.energy.meters.spec import parse_meter_spec
from refspec.energy.meters.windowed import WindowedMeter
from refspec.energy.meters.zeus import ZeusCounter
from refspec.energy.model.hardware import HardwareProfile, cpu_profile, get_profile
from refspec.energy.meters.device_law import default_law, law_with
from refspec.energy.meters.simulated import DEFAULT_PERIOD_MS, SimulatedMeter

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Counter = Callable[[], float]


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
               energy: Counter | None = None, powercap_root: str | Path = POWERCAP_ROOT, source: str | None = None,
               idle_w: float | None = None) -> EnergyMeter:
    """Build an energy meter from a ``--meter`` spec (:mod:`refspec.energy.meters.spec`).

    Args:
        kind: the spec, ``KIND[:PROFILE][:key=value]...``: ``zeus`` / ``nvml`` (NVML's counter of
            the GPU, or of ``gpus=0,1`` summed), ``rapl`` (CPU package and DRAM), ``simulated:PROFILE``
            (a simulated counter over a device law's truth), ``roofline[:PROFILE]`` (modelled),
            ``time`` (time only), ``auto`` (a GPU's NVML counter, else this CPU's RAPL, else the
            roofline: a GPU's data-sheet profile, or this CPU's benchmarked one in wall-time
            mode), or ``fake`` (API only: needs ``clock`` and ``energy``). Counter meters are
            :class:`~refspec.energy.meters.windowed.WindowedMeter`: they time phases and read the
            counter only over windows it resolves.
        gpu_index: GPU to meter when the spec names none.
        profile: roofline profile name or object; overrides the spec's.
        time_source: roofline time source; default ``"wall_time"`` for a benchmarked (CPU)
            profile, the machine that runs, and ``"model"`` for a data-sheet (GPU) profile.
        dtype_bytes: element size the CPU profile is benchmarked for.
        clock: clock for ``fake`` (and optionally ``time``).
        energy: cumulative energy counter in J for ``fake``.
        powercap_root: where RAPL's powercap tree is (a fake tree in tests).
        source: the source ``fake`` reports (default ``measured:fake-counter``).
        idle_w: the idle power in W ``fake`` reports.

    Returns:
        A meter; the counter kinds' is a :class:`~refspec.energy.meters.windowed.WindowedMeter`.

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
        return FakeMeter(clock, energy, source=source or FAKE_SOURCE, idle_w=idle_w)
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
                              clock=clock or time.perf_counter, law=law_with(default_law(prof), opts),
                              drift_ppm=opts.get("drift_ppm", 0.0),
                              offset_s=opts["offset_ms"] / 1e3 if "offset_ms" in opts else None)
    raise AssertionError(f"meter kind {spec.kind!r} parsed but not built")


def _roofline_profile(profile: str | HardwareProfile | None, gpu_index: int, dtype_bytes: int) -> HardwareProfile:
    """The profile asked for, else this GPU's data-sheet profile, else this CPU's benchmarked one."""
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is not None:
        return get_profile(profile, dtype_bytes)
    gpu = _profile_for_this_gpu(gpu_index) if _cuda_sync() is not None else None
    return gpu if gpu is not None else cpu_profile(dtype_bytes)


def measured_gpu_counter(gpu_indices: Sequence[int] = (0,), *,
                         pynvml_module: Any | None = None) -> ZeusCounter | DeviceCounter:
    """The cumulative counter of a run's :class:`~refspec.energy.meters.windowed.WindowedMeter` over
    ``gpu_indices``: Zeus, else pynvml (the total-energy counter, else the power integral).

    Args:
        gpu_indices: the GPUs, recorded apart and summed.
        pynvml_module: a ``pynvml`` to read instead of trying Zeus (tests inject a fake).

    Raises:
        NoGPUError: neither can be built; the message gives each one's reason.
    """
    reasons = []
    if pynvml_module is None:
        try:
            return ZeusCounter(gpu_indices)
        except NoGPUError as exc:
            reasons.append(f"zeus: {exc}")
        except Exception as exc:  # a broken zeus install must not cost the counter pynvml can read
            logger.warning("zeus failed unexpectedly (%s: %s); trying pynvml", type(exc).__name__, exc)
            reasons.append(f"zeus: {type(exc).__name__}: {exc}")
    try:
        return nvml_counter(gpu_indices, pynvml_module=pynvml_module)
    except NoGPUError as exc:
        reasons.append(f"pynvml: {exc}")
    raise NoGPUError(f"no measured energy counter for GPU {','.join(map(str, gpu_indices))}: {'; '.join(reasons)}")


def _auto_meter(gpus: Sequence[int], time_source: TimeSource | None, dtype_bytes: int, sub_window_s: float | None,
                powercap_root: str | Path) -> EnergyMeter:
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


__all__ = ["make_meter", "measured_gpu_counter"]
