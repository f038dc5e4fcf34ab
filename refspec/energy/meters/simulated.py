"""A simulated energy counter over a device law of its own, read the way NVML reads a GPU's, so
tests and lectures can show what a counter resolves, what it does not, and whether an
attribution recovers a truth it was not built from.

**The truth.** Power comes from a :class:`~refspec.energy.meters.device_law.DeviceLaw`: each phase
draws towards a level set by what it does (its bytes, FLOPs, query rows and key reads over its
duration, saturating, with an occupancy and a key-read term), relaxing with a lag between
phases; host time between phases draws ``host_w`` above idle; the device warms over the run.
Nothing of it is the roofline profile's energy model, which prices the loops and predictions.
The truth is integrated on the run's own clock: with the CPU profile (``wall_time``) the
measured wall time; with a GPU profile (``model``) each phase's roofline time, with the law's
host gap before each phase and its ``bare_s`` for a phase without forwards.

**The counter.** It updates once a period P of its own clock, which runs ``drift_ppm`` fast
against the run's and starts ``offset_s`` after the trace. Each update adds the mean power over
the first S of its period times P: a part-time sensor (Yang, Adamek and Armour, "Part-time Power
Measurements: nvidia-smi's Lack of Attention", SC24: about 25 ms of every 100 ms on A100/H100),
optionally times ``1 + noise * N(0, 1)`` (seeded). A phase of a few milliseconds reads 0 J or a
whole update's worth; over many periods the sampled means converge on the truth.

**What it records.** Its phases carry ``energy_j`` null (a counter cannot see a phase), the truth
as ``energy_true_j`` and the naive per-phase read (the counter's difference over the phase's own
interval) as ``energy_naive_j``; its counter records carry the cumulative truth as
``energy_true_j``.
"""
from __future__ import annotations

import bisect
import math
import random
import time
from typing import Any, Callable, NamedTuple

from refspec.energy.meters.counters import CounterRead
from refspec.energy.meters.timers import ClockTimer
from refspec.energy.meters.windowed import WindowedMeter
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import work_time_s
from refspec.energy.model.work import ForwardShape
from refspec.energy.meters.device_law import DeviceLaw, default_law

DEFAULT_PERIOD_MS = 100.0
"""NVML's total-energy counter updates every 20-100 ms."""
DEFAULT_SAMPLE_FRACTION = 0.25
"""The part of each period an A100/H100 power sensor samples (Yang, Adamek and Armour, SC24)."""

SIMULATED_PHASE_FIELDS: dict[str, str] = {
    "energy_true_j": "simulated counter only: the phase's true energy under the simulated device's law, J (float)",
    "energy_naive_j": "simulated counter only: the counter's difference over the phase's own interval, the "
                      "per-phase read a counter cannot support, J (float)",
}
"""Fields a simulated counter adds to phase records, name -> description."""


class _Segment(NamedTuple):
    t0: float  # start, s
    t1: float  # end, s (inf for the trace's open tail)
    e0: float  # cumulative energy at t0, J
    p0: float  # power at t0, W
    level: float  # the level it relaxes towards, W
    tau: float  # time constant, s (0: at the level at once)

    def energy(self, t: float) -> float:
        """Cumulative energy at ``t`` inside the segment, J."""
        x = min(t, self.t1) - self.t0
        if self.tau <= 0:
            return self.e0 + self.level * x
        return self.e0 + self.level * x + (self.p0 - self.level) * self.tau * -math.expm1(-x / self.tau)

    def power(self, t: float) -> float:
        x = min(t, self.t1) - self.t0
        return self.level if self.tau <= 0 else self.level + (self.p0 - self.level) * math.exp(-x / self.tau)


class PowerTrace:
    """True power over time under a :class:`~refspec.energy.meters.device_law.DeviceLaw`: phases at
    their levels with lag, host power between them, idle after ``hold_s``. Phases are added in
    time order; beyond the last, the trace continues as host time then idle.

    Args:
        law: the device law.
        origin_s: where the trace starts on its clock, s (the device idle there).
    """

    def __init__(self, law: DeviceLaw, origin_s: float) -> None:
        self.law = law
        self.origin_s = origin_s
        self._segments: list[_Segment] = []
        self._starts: list[float] = []
        self._end = _Segment(origin_s, origin_s, 0.0, law.idle_w, law.idle_w, 0.0)  # the last segment added
        self._idle_from = origin_s  # host time after the last phase turns idle here

    def _tail(self, start: _Segment) -> list[_Segment]:
        """The host-then-idle segments after ``start`` (open-ended)."""
        p, e, t = start.power(start.t1), start.energy(start.t1), start.t1
        host = _Segment(t, self._idle_from, e, p, self.law.host_w, self.law.tau_s(p, self.law.host_w))
        if self._idle_from <= t:
            return [_Segment(t, math.inf, e, p, self.law.idle_w, self.law.tau_s(p, self.law.idle_w))]
        idle_p = host.power(self._idle_from)
        idle = _Segment(self._idle_from, math.inf, host.energy(self._idle_from), idle_p, self.law.idle_w,
                        self.law.tau_s(idle_p, self.law.idle_w))
        return [host, idle]

    def _segment_at(self, t: float) -> _Segment:
        if t >= self._end.t1:
            tail = self._tail(self._end)
            return tail[0] if t < tail[0].t1 or len(tail) == 1 else tail[1]
        i = max(bisect.bisect_right(self._starts, t) - 1, 0)
        return self._segments[i] if self._segments else self._end

    def energy_at(self, t: float) -> float:
        """Cumulative true energy from the origin to ``t``, J."""
        return self._segment_at(t).energy(t) if t > self.origin_s else 0.0

    def power_at(self, t: float) -> float:
        """True power at ``t``, W."""
        return self._segment_at(t).power(t)

    def _append(self, seg: _Segment) -> None:
        if seg.t1 > seg.t0:
            self._segments.append(seg)
            self._starts.append(seg.t0)
        self._end = seg

    def add(self, t0: float, t1: float, level_w: float) -> float:
        """A phase from ``t0`` to ``t1`` (s) drawing towards ``level_w`` (W); returns its true energy, J."""
        t0 = max(t0, self._end.t1)  # a phase cannot begin before the previous one ended
        for seg in self._tail(self._end):  # the host time (and idle) before it, as it was read
            if seg.t0 >= t0:
                break
            self._append(seg._replace(t1=min(seg.t1, t0)))
        p0, e0 = self.power_at(t0), self.energy_at(t0)
        self._append(_Segment(t0, max(t1, t0), e0, p0, level_w, self.law.tau_s(p0, level_w)))
        self._idle_from = self._end.t1 + self.law.hold_s
        return self._end.energy(self._end.t1) - e0


class SimulatedCounter:
    """A cumulative counter over a :class:`PowerTrace`, updated once a period of its own clock
    from the mean power over the first ``sample_s`` of the period.

    Args:
        trace: the truth.
        period_s: update period P on the counter's clock, s.
        sample_s: sampled part S of each period, s (0 < S <= P).
        noise: relative standard deviation of each update's multiplicative noise.
        seed: seed of the noise.
        clock: the trace's clock.
        source: the source string.
        device: device name in reads.
        drift_ppm: how fast the counter's clock runs against the trace's, parts per million.
        offset_s: where the counter's first period starts after the trace's origin, s.
    """

    def __init__(self, trace: PowerTrace, *, period_s: float, sample_s: float, noise: float = 0.0, seed: int = 0,
                 clock: Callable[[], float], source: str, device: str = "simulated", drift_ppm: float = 0.0,
                 offset_s: float = 0.0) -> None:
        if not (period_s > 0 and 0 < sample_s <= period_s):
            raise ValueError(f"need 0 < sample_s <= period_s, got sample_s={sample_s:g}, period_s={period_s:g}")
        if noise < 0 or offset_s < 0 or abs(drift_ppm) >= 1e6:
            raise ValueError(f"need noise >= 0, offset_s >= 0 and |drift_ppm| < 1e6, got {noise:g}, {offset_s:g}, "
                             f"{drift_ppm:g}")
        self.trace = trace
        self.period_s = period_s
        self.sample_s = sample_s
        self.noise = noise
        self.source = source
        self.device = device
        self._scale = 1.0 / (1.0 + drift_ppm * 1e-6)  # trace seconds per counter second
        self._first = trace.origin_s + offset_s
        self._clock = clock
        self._rng = random.Random(seed)
        self._after = [0.0]  # counter value after k updates

    def value_at(self, t: float) -> float:
        """What the counter shows at ``t``: the updates of every period completed by then, J."""
        step = self.period_s * self._scale  # a period on the trace's clock
        k = math.floor((t - self._first) / step + 1e-9)
        while len(self._after) <= k:  # the periods complete in order, so the noise is drawn in order
            a = self._first + (len(self._after) - 1) * step
            sampled = self.trace.energy_at(a + self.sample_s * self._scale) - self.trace.energy_at(a)
            gain = max(0.0, 1.0 + self.noise * self._rng.gauss(0.0, 1.0)) if self.noise else 1.0
            self._after.append(self._after[-1] + sampled / self._scale * (self.period_s / self.sample_s) * gain)
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
    """Phase time from the roofline of the phase's work (a GPU profile's modelled clock); a phase
    without forwards lasts ``bare_s``."""

    def __init__(self, profile: HardwareProfile, bare_s: float = 0.0) -> None:
        self.profile = profile
        self.bare_s = bare_s

    def start(self) -> None:
        return None

    def stop(self, token: None, work: tuple[ForwardShape, ...] = ()) -> float:
        return work_time_s(work, self.profile) if work else self.bare_s


class SimulatedMeter(WindowedMeter):
    """A :class:`~refspec.energy.meters.windowed.WindowedMeter` over a :class:`SimulatedCounter` whose
    truth is a :class:`~refspec.energy.meters.device_law.DeviceLaw` (see the module docstring).

    Args:
        profile: the roofline profile of the modelled clock (``model``) and of the default law.
        time_source: ``"wall_time"`` (phases last what the clock says) or ``"model"`` (phases
            last their roofline time, plus the law's host time).
        period_s: counter period P, s.
        sample_s: sampled part S of each period, s; default a quarter of P
            (:data:`DEFAULT_SAMPLE_FRACTION`).
        noise: relative noise of each update.
        seed: seed of the noise and of the default offset.
        sub_window_s: shortest sub-window between counter reads (at least ten periods).
        clock: the wall clock in ``wall_time`` mode (injectable for tests).
        law: the device law; default :func:`~refspec.energy.meters.device_law.default_law` of ``profile``.
        drift_ppm: the counter clock's rate error, parts per million.
        offset_s: start of the counter's first period after the trace's origin, s; default drawn
            from ``seed`` within one period.
    """

    def __init__(self, profile: HardwareProfile, *, time_source: str = "model",
                 period_s: float = DEFAULT_PERIOD_MS / 1e3, sample_s: float | None = None, noise: float = 0.0,
                 seed: int = 0, sub_window_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
                 law: DeviceLaw | None = None, drift_ppm: float = 0.0, offset_s: float | None = None) -> None:
        if time_source not in ("model", "wall_time"):
            raise ValueError(f"time_source must be 'model' or 'wall_time', got {time_source!r}")
        law = default_law(profile) if law is None else law
        sample_s = DEFAULT_SAMPLE_FRACTION * period_s if sample_s is None else sample_s
        offset_s = random.Random(f"offset-{seed}").uniform(0.0, period_s) if offset_s is None else offset_s
        modelled = ModelledClock() if time_source == "model" else None
        run_clock: Callable[[], float] = modelled if modelled is not None else clock
        timer = ModelledTimer(profile, law.bare_s) if modelled is not None else ClockTimer(clock)
        options = f"P={period_s * 1e3:g}ms,S={sample_s * 1e3:g}ms" + (f",noise={noise:g},seed={seed}" if noise else "")
        wall = "" if modelled is not None else ",wall-time"
        source = f"modelled:simulated-counter({profile.name}{wall},{options})"
        counter = SimulatedCounter(PowerTrace(law, run_clock()), period_s=period_s, sample_s=sample_s, noise=noise,
                                   seed=seed, clock=run_clock, device=profile.name, drift_ppm=drift_ppm,
                                   offset_s=offset_s, source=source)
        super().__init__(counter, timer=timer, sub_window_s=sub_window_s, clock=run_clock)
        self.profile = profile
        self.law = law
        self.time_source = time_source
        self.idle_w = law.idle_w
        self._modelled = modelled

    def begin(self, name: str) -> None:
        """Open a phase; on the modelled clock the law's host gap passes first."""
        if self._modelled is not None:
            self._modelled.now_s += self.law.gap_s
        super().begin(name)

    def _observe(self, name: str, t0: float, elapsed: Any,
                 work: tuple[ForwardShape, ...]) -> tuple[tuple[str, Any], ...]:
        """Add the phase to the trace at the law's level; return its truth and the naive per-phase read."""
        dt = float(elapsed)
        counter: SimulatedCounter = self.counter  # type: ignore[assignment]
        before = counter.value_at(t0)
        true_j = counter.trace.add(t0, t0 + dt, self.law.level_w(work, dt, t0 - counter.trace.origin_s))
        if self._modelled is not None:
            self._modelled.now_s = t0 + dt
        return (("energy_true_j", true_j), ("energy_naive_j", counter.value_at(t0 + dt) - before))

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass with nothing running: a sleep on the wall clock, the modelled clock
        moved on otherwise (the device draws host power, then idle, over it)."""
        if self._modelled is not None:
            self._modelled.now_s += seconds
        else:
            time.sleep(seconds)

    def measure_idle_w(self, seconds: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> float:
        """The law's idle power: what the counter reads after a long rest (no sleep needed)."""
        return self.law.idle_w


__all__ = ["SimulatedMeter", "SimulatedCounter", "PowerTrace", "ModelledClock", "ModelledTimer",
           "SIMULATED_PHASE_FIELDS", "DEFAULT_PERIOD_MS", "DEFAULT_SAMPLE_FRACTION"]
