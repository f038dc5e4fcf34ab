"""A simulated energy counter: the roofline's per-phase energy as the truth, read the way NVML
reads a GPU's, so tests and lectures can show what a counter resolves and what it does not.

**The truth.** Every phase draws the roofline profile's modelled energy of its own work
(:meth:`~refspec.energy.hardware.HardwareProfile.energy_j`: static power over its time plus
pJ/FLOP and pJ/byte), spread evenly over the phase. Host time outside any phase (the engine's
bookkeeping between phases, a run's gaps) draws the profile's ``idle_w``. The time base is the
run's own clock: with the CPU profile (``wall_time``) the measured wall time, as the roofline
meter's wall-time mode prices it; with a GPU profile (``model``) the modelled time of each
phase, back to back, with no host time at all.

**The counter.** It changes every ``period_s`` (P). Each update adds the mean power over the
first ``sample_s`` (S) of its period times P: a part-time sensor (Yang, Adamek and Armour,
"Part-time Power Measurements: nvidia-smi's Lack of Attention", SC24, found about 25 ms of
every 100 ms sampled on A100/H100), optionally times ``1 + noise * N(0, 1)`` (seeded). So a
phase of a few milliseconds reads 0 J or a whole update's worth, and work outside the sampled
part of a period is never seen; over many periods the sampled means converge on the truth.

**What it records.** Its phases carry ``energy_j`` null (a counter cannot see a phase), the
truth as ``energy_true_j`` and the naive per-phase read, the counter's difference over the
phase's own interval, as ``energy_naive_j``; its counter records carry the cumulative truth as
``energy_true_j``. The attribution (:mod:`refspec.energy.attribution`) must recover the first
from the counter records; the second shows why a per-phase read cannot.

With a GPU profile the modelled clock is short: a 135M-parameter target's whole run lasts
about 50 ms on a modelled H200, under one counter period, and cannot be resolved (the meter
warns); use a target large enough that its steps span periods, or the CPU profile.
"""
from __future__ import annotations

import bisect
import math
import random
import time
from typing import Any, Callable

from refspec.energy.meters.counters import CounterRead
from refspec.energy.meters.timers import ClockTimer
from refspec.energy.meters.windowed import WindowedMeter
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import total_cost, work_time_s
from refspec.energy.model.work import ForwardShape

DEFAULT_PERIOD_MS = 100.0
"""NVML's total-energy counter updates every 20-100 ms."""
DEFAULT_SAMPLE_FRACTION = 0.25
"""The part of each period an A100/H100 power sensor samples (Yang, Adamek and Armour, SC24)."""

SIMULATED_PHASE_FIELDS: dict[str, str] = {
    "energy_true_j": "simulated counter only: the phase's true (modelled) energy, J (float)",
    "energy_naive_j": "simulated counter only: the counter's difference over the phase's own interval, the "
                      "per-phase read a counter cannot support, J (float)",
}
"""Fields a simulated counter adds to phase records, name -> description."""


class PowerTrace:
    """True power over time, piecewise constant: each phase at its mean power, ``idle_w``
    between and after them. Phases are added in time order.

    Args:
        idle_w: power outside any phase, W.
        origin_s: where the trace starts on its clock, s.
    """

    def __init__(self, idle_w: float, origin_s: float) -> None:
        self.idle_w = idle_w
        self.origin_s = origin_s
        self._t = [origin_s]  # breakpoint times
        self._e = [0.0]  # cumulative energy at each breakpoint, J
        self._p = [idle_w]  # power from each breakpoint to the next, W

    def energy_at(self, t: float) -> float:
        """Cumulative true energy from the origin to ``t``, J (idle beyond the last phase)."""
        i = max(bisect.bisect_right(self._t, t) - 1, 0)
        return self._e[i] + self._p[i] * (t - self._t[i])

    def add(self, t0: float, t1: float, energy_j: float) -> None:
        """A phase from ``t0`` to ``t1`` (s) that drew ``energy_j`` (J)."""
        t0 = max(t0, self._t[-1])  # a phase cannot begin before the previous one ended
        if t1 <= t0:
            assert energy_j == 0.0, f"a phase of {t1 - t0:g} s cannot draw {energy_j:g} J"
            return
        e0 = self.energy_at(t0)
        self._t += [t0, t1]
        self._e += [e0, e0 + energy_j]
        self._p += [energy_j / (t1 - t0), self.idle_w]


class SimulatedCounter:
    """A cumulative counter over a :class:`PowerTrace`, updated every ``period_s`` from the mean
    power over the first ``sample_s`` of each period.

    Args:
        trace: the truth.
        period_s: update period P, s.
        sample_s: sampled part S of each period, s (0 < S <= P).
        noise: relative standard deviation of each update's multiplicative noise.
        seed: seed of the noise.
        clock: the trace's clock.
        source: the source string.
        device: device name in reads.
    """

    def __init__(self, trace: PowerTrace, *, period_s: float, sample_s: float, noise: float = 0.0, seed: int = 0,
                 clock: Callable[[], float], source: str, device: str = "simulated") -> None:
        if not (period_s > 0 and 0 < sample_s <= period_s):
            raise ValueError(f"need 0 < sample_s <= period_s, got sample_s={sample_s:g}, period_s={period_s:g}")
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise:g}")
        self.trace = trace
        self.period_s = period_s
        self.sample_s = sample_s
        self.noise = noise
        self.source = source
        self.device = device
        self._clock = clock
        self._rng = random.Random(seed)
        self._after = [0.0]  # counter value after k updates

    def value_at(self, t: float) -> float:
        """What the counter shows at ``t``: the updates of every period completed by then, J."""
        k = math.floor((t - self.trace.origin_s) / self.period_s + 1e-9)
        while len(self._after) <= k:  # the periods complete in order, so the noise is drawn in order
            a = self.trace.origin_s + (len(self._after) - 1) * self.period_s
            sampled = self.trace.energy_at(a + self.sample_s) - self.trace.energy_at(a)
            gain = max(0.0, 1.0 + self.noise * self._rng.gauss(0.0, 1.0)) if self.noise else 1.0
            self._after.append(self._after[-1] + sampled * (self.period_s / self.sample_s) * gain)
        return self._after[max(k, 0)]

    def read(self) -> CounterRead:
        """The counter now, with the cumulative truth beside it."""
        t = self._clock()
        value = self.value_at(t)
        return CounterRead(energy_j=value, devices={self.device: value}, wall_s=t, true_j=self.trace.energy_at(t))

    def close(self) -> None:
        """Nothing to release."""


class ModelledClock:
    """The modelled clock of a GPU profile: advanced only by the modelled time of each phase."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class ModelledTimer:
    """Phase time from the roofline of the phase's work (a GPU profile's modelled clock)."""

    def __init__(self, profile: HardwareProfile) -> None:
        self.profile = profile

    def start(self) -> None:
        return None

    def stop(self, token: None, work: tuple[ForwardShape, ...] = ()) -> float:
        return work_time_s(work, self.profile)


class SimulatedMeter(WindowedMeter):
    """A :class:`~refspec.energy.windowed.WindowedMeter` over a :class:`SimulatedCounter` whose
    truth is the profile's modelled energy of each phase (see the module docstring).

    Args:
        profile: the roofline profile of the truth.
        time_source: ``"wall_time"`` (the CPU profile: phases last what the clock says) or
            ``"model"`` (a GPU profile: phases last their modelled time).
        period_s: counter period P, s.
        sample_s: sampled part S of each period, s; default a quarter of P
            (:data:`DEFAULT_SAMPLE_FRACTION`).
        noise: relative noise of each update.
        seed: seed of the noise.
        sub_window_s: shortest sub-window between counter reads (at least ten periods).
        clock: the wall clock in ``wall_time`` mode (injectable for tests).
    """

    def __init__(self, profile: HardwareProfile, *, time_source: str = "model",
                 period_s: float = DEFAULT_PERIOD_MS / 1e3, sample_s: float | None = None, noise: float = 0.0,
                 seed: int = 0, sub_window_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if time_source not in ("model", "wall_time"):
            raise ValueError(f"time_source must be 'model' or 'wall_time', got {time_source!r}")
        sample_s = DEFAULT_SAMPLE_FRACTION * period_s if sample_s is None else sample_s
        modelled = ModelledClock() if time_source == "model" else None
        run_clock: Callable[[], float] = modelled if modelled is not None else clock
        timer = ModelledTimer(profile) if modelled is not None else ClockTimer(clock)
        options = f"P={period_s * 1e3:g}ms,S={sample_s * 1e3:g}ms" + (f",noise={noise:g},seed={seed}" if noise else "")
        wall = "" if modelled is not None else ",wall-time"
        counter = SimulatedCounter(PowerTrace(profile.idle_w, run_clock()), period_s=period_s, sample_s=sample_s,
                                   noise=noise, seed=seed, clock=run_clock, device=profile.name,
                                   source=f"modelled:simulated-counter({profile.name}{wall},{options})")
        super().__init__(counter, timer=timer, sub_window_s=sub_window_s, clock=run_clock)
        self.profile = profile
        self.time_source = time_source
        self.idle_w = profile.idle_w
        self._modelled = modelled

    def _observe(self, name: str, t0: float, elapsed: Any,
                 work: tuple[ForwardShape, ...]) -> tuple[tuple[str, Any], ...]:
        """Add the phase's true energy to the trace; return it and the naive per-phase read."""
        dt = float(elapsed)
        true_j = self.profile.energy_j(total_cost(work), dt)
        counter: SimulatedCounter = self.counter  # type: ignore[assignment]
        before = counter.value_at(t0)
        counter.trace.add(t0, t0 + dt, true_j)
        if self._modelled is not None:
            self._modelled.now_s = t0 + dt
        return (("energy_true_j", true_j), ("energy_naive_j", counter.value_at(t0 + dt) - before))

    def measure_idle_w(self, seconds: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> float:
        """The profile's idle power: the truth the counter would measure (no sleep needed)."""
        return self.profile.idle_w


__all__ = ["SimulatedMeter", "SimulatedCounter", "PowerTrace", "ModelledClock", "ModelledTimer",
           "SIMULATED_PHASE_FIELDS", "DEFAULT_PERIOD_MS", "DEFAULT_SAMPLE_FRACTION"]
