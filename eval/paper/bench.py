"""What every point of the paper command shares: device, meter, the counter's period, rooflines.

On a GPU the meter is the run's energy counter (NVML's total-energy counter, through Zeus where
it is installed, else pynvml; its instantaneous-power integral where the counter is refused),
read only over windows it resolves (:class:`~refspec.energy.meters.windowed.WindowedMeter`). Its update
period is measured at start by polling it (:func:`measure_period`), and every window of the run
is sized in those periods (:class:`~refspec.eval.paper.grid.Windows`). Where no counter can be
read, energy is the roofline's and every output says MODELLED (``--require-measured-energy``
exits 3 instead). Clocks are only ever read.

On a CPU the same path runs against a simulated counter (:mod:`refspec.energy.meters.simulated`): the
H100 or H200 profile's modelled energy of each phase as the truth, sampled part-time the way
NVML samples, on the modelled clock. The figures are MODELLED and labelled so.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import torch

from refspec.eval.paper.grid import Windows

log = logging.getLogger("refspec.eval.paper")

EXIT_MODELLED_ONLY = 3
ASSUMED_PERIOD_S = 0.1
"""NVML's counter period assumed before it is measured (it updates every 20-100 ms)."""
SIMULATED_PERIOD_S = 0.01
"""The CPU's simulated counter updates ten times as often as a slow NVML counter, so its windows
(sized in periods) take a tenth of the modelled time: the rehearsal stays minutes long."""
SIMULATED_SAMPLE_FRACTION = 0.25
SIMULATED_NOISE = 0.02
GPU_PLAN_PROFILE = {"peak_flops": 780e12, "bandwidth_Bps": 4.3e12}
"""An H200 as measured there (bf16 GEMM 770-798 TFLOP/s, copy 4.3 TB/s): the GPU plan's profile."""


class ModelledEnergyOnly(RuntimeError):
    """``--require-measured-energy`` was given and no energy counter can be read."""


@dataclasses.dataclass
class Bench:
    """The run's device, meter and rooflines.

    Attributes:
        device: where targets run.
        dtype: their weights' dtype.
        meter: the energy meter (a counter meter: ``counter``, ``period_s``, ``finish_run``).
        windows: the window lengths the counter can bear.
        profile: the roofline the predictions use (measured ceilings on a GPU; the simulated
            profile on a CPU).
        measured: energy comes from a hardware counter.
        note: one line on where the energy comes from.
        period_note: how the counter's period was found.
        idle_w: idle power, W (measured on a GPU; the profile's when modelled).
        ceilings: copy and GEMM ceilings measured here (GPU only).
        sm_clock: a passive SM-clock reader (MHz), None off NVML.
    """

    device: torch.device
    dtype: torch.dtype
    meter: Any
    windows: Windows
    profile: Any
    measured: bool
    note: str
    period_note: str
    idle_w: float | None
    ceilings: dict[str, Any] | None = None
    sm_clock: Callable[[], float] | None = None

    @property
    def source(self) -> str:
        return str(self.meter.source)


def measure_period(counter: Any, *, seconds: float = 1.5, sleep_s: float = 0.001,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float | None, int]:
    """The counter's update period: poll it for ``seconds``, median gap between value changes.

    Returns:
        (period in s or None when fewer than three changes were seen, changes seen).
    """
    changes: list[float] = []
    last = counter.read().energy_j
    t0 = clock()
    while clock() - t0 < seconds:
        time.sleep(sleep_s)
        r = counter.read()
        if r.energy_j != last:
            changes.append(r.wall_s)
            last = r.energy_j
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    return (statistics.median(gaps) if len(gaps) >= 2 else None), len(changes)


def _gpu_meter(args: Any) -> tuple[Any, float, str] | str:
    """A counter meter over GPU 0 with its measured period, or why there is none."""
    from refspec.energy.meters.errors import NoGPUError
    from refspec.energy.meters.make import measured_gpu_counter
    from refspec.energy.meters.windowed import WindowedMeter

    try:
        counter = measured_gpu_counter((0,))
    except NoGPUError as exc:
        return str(exc)
    period, changes = measure_period(counter)
    note = f"measured: {changes} updates in 1.5 s"
    if period is None:
        period, note = counter.period_s, f"assumed ({changes} updates seen in 1.5 s)"
    counter.period_s = period
    windows = Windows.for_period(period, args.min_window_s)
    meter = WindowedMeter(counter, sub_window_s=windows.sub_window_s)
    meter.measure_idle_w(max(2.0, 20 * period))
    return meter, period, note


def _simulated_meter(args: Any) -> Any:
    """The CPU's simulated counter over the ``--profile`` roofline, on the modelled clock."""
    from refspec.energy.model.hardware import get_profile
    from refspec.energy.meters.simulated import SimulatedMeter

    p = SIMULATED_PERIOD_S
    return SimulatedMeter(get_profile(args.profile), time_source="model", period_s=p,
                          sample_s=SIMULATED_SAMPLE_FRACTION * p, noise=SIMULATED_NOISE, seed=args.seed,
                          sub_window_s=10 * p)


def build_bench(args: Any) -> Bench:
    """The device and meter of the run (on a GPU: ceilings, idle power and counter period too).

    Raises:
        ModelledEnergyOnly: ``--require-measured-energy`` and no counter can be read.
    """
    if args.device == "cpu":
        meter = _simulated_meter(args)
        windows = Windows.for_period(meter.period_s, 0.0)
        return Bench(device=torch.device("cpu"), dtype=torch.float32, meter=meter, windows=windows,
                     profile=meter.profile, measured=False, idle_w=meter.idle_w,
                     note=f"MODELLED: {meter.source} (toy forwards priced at the real shapes)",
                     period_note=f"simulated ({SIMULATED_PERIOD_S * 1e3:g} ms)")
    return _gpu_bench(args)


def _gpu_bench(args: Any) -> Bench:
    from refspec.energy.meters.direct import RooflineMeter
    from refspec.energy.meters.nvml import sm_clock_reader
    from refspec.eval.paper.ceilings import GPU_SHAPES, measure_ceilings, profile_with_ceilings

    device, dtype = torch.device("cuda"), torch.bfloat16
    found = _gpu_meter(args)
    if isinstance(found, str) and args.require_measured_energy:
        raise ModelledEnergyOnly(f"--require-measured-energy: only modelled energy is available ({found})")
    ceilings = measure_ceilings(device, dtype, GPU_SHAPES)
    profile = profile_with_ceilings(datasheet_profile(), ceilings)
    if isinstance(found, str):
        meter = RooflineMeter(profile, time_source="wall_time", sync=torch.cuda.synchronize)
        windows = Windows.for_period(ASSUMED_PERIOD_S, args.min_window_s)
        return Bench(device=device, dtype=dtype, meter=meter, windows=windows, profile=profile, measured=False,
                     note=f"MODELLED by {meter.source} ({found})", period_note="no counter", idle_w=profile.idle_w,
                     ceilings=ceilings, sm_clock=sm_clock_reader(0))
    meter, period, note = found
    return Bench(device=device, dtype=dtype, meter=meter, windows=Windows.for_period(period, args.min_window_s),
                 profile=profile, measured=True, note=f"measured: {meter.source}", period_note=note,
                 idle_w=meter.idle_w, ceilings=ceilings, sm_clock=sm_clock_reader(0))


def datasheet_profile() -> Any:
    """This GPU's data-sheet profile (H200 where the name is not known)."""
    from refspec.energy.model.hardware import get_profile

    name = torch.cuda.get_device_name(0).lower()
    return get_profile("h100" if "h100" in name else "h200")


def gpu_plan_profile() -> Any:
    """The H200 as measured on the lent machine: what a plan made anywhere assumes."""
    from refspec.energy.model.hardware import get_profile

    return dataclasses.replace(get_profile("h200"), name="h200@4.3TB/s,780TFLOP/s", **GPU_PLAN_PROFILE)


__all__ = ["Bench", "build_bench", "measure_period", "ModelledEnergyOnly", "EXIT_MODELLED_ONLY", "gpu_plan_profile",
           "ASSUMED_PERIOD_S", "SIMULATED_PERIOD_S"]
