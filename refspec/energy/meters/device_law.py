"""The simulated device's own power law: what a phase draws, from what it does.

A simulated counter (:mod:`refspec.energy.meters.simulated`) must not share the model that prices
loops and predictions, or attribution checked against it recovers its own assumptions. The
roofline (:mod:`refspec.energy.model.hardware`) prices energy as static power x time plus
picojoules per FLOP and per byte, linear in the work. This law has another form, with terms
the roofline lacks:

**Level** of a phase that ran forwards of F FLOPs and M bytes, ``f = F / t`` and ``m = M / t``
over its working time ``t = t_n + busy x (dt - t_n)``, where ``dt`` is the phase's duration and
``t_n = max(F / flop_knee, M / byte_knee)`` the law's own time of the work (``busy`` 1: the device
works the whole phase, as a GPU's timed kernels do; 0: the phase's time beyond its nominal time
is spent waiting on other processes at the same level, as a time-shared CPU's is, so its power
does not depend on the load)::

    level = active_w + warm(t) + occupancy x (1 + keys_gain x kv) x (flop_w x sat(f / flop_knee)
                                                                      + byte_w x sat(m / byte_knee))

capped at ``tdp_w``, with ``sat(x) = 1 - exp(-x)`` (power saturates as a rate nears the
device's limit), ``occupancy`` the bytes-weighted mean of ``q / (q + rows_knee)`` over the
phase's forwards (q the query rows a forward computes: a forward of few rows leaves units
idle), and ``kv`` the share of its bytes that are KV-cache reads (attention's scattered reads
draw more per byte than streamed weights). A phase without forwards (a commit, an n-gram
lookup) draws ``active_w + warm(t)``.

**Host time** between phases draws ``host_w`` (above ``idle_w``: clocks stay up) for ``hold_s``
after a phase, then ``idle_w``.

**Lag.** Power does not jump to a level: it rises towards a higher one with time constant
``rise_s`` and falls towards a lower one with ``lag_s`` (clocks go up at once and come down
slowly), so a short phase after a long, hungry one draws that one's power.

**Warm-up.** ``warm(t) = warm_w x (1 - exp(-t / warm_s))``, t since the trace began: a device
drawing more as it heats over a run.

On a modelled clock (a GPU profile's) a phase's time is the roofline's, which has no host time:
the law adds ``gap_s`` of host time before every phase and gives a phase without forwards
``bare_s``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.work import ForwardShape
from refspec.energy.model.roofline import forward_cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceLaw:
    """Parameters of the simulated device (module docstring). Powers in W, rates per second,
    times in s.

    Attributes:
        idle_w: the device at rest.
        host_w: between phases, within ``hold_s`` of the last one.
        active_w: a phase's base power (clocks up, launches), before its work.
        tdp_w: the cap of a level.
        flop_w / flop_knee: the FLOP term's saturated power and its knee, FLOP/s.
        byte_w / byte_knee: the memory term's saturated power and its knee, B/s.
        busy: how much of a phase's time beyond its nominal time counts as working time (0 to 1).
        rows_knee: query rows of a forward at which its occupancy is one half.
        keys_gain: extra dynamic power per unit share of KV-cache reads in the bytes.
        rise_s / lag_s: time constants towards a higher / a lower level.
        hold_s: host time at ``host_w`` before the device drops to ``idle_w``.
        warm_w / warm_s: the warm-up's extra power and time constant.
        gap_s / bare_s: modelled clock only: host time before each phase, and the time of a phase
            without forwards.
    """

    idle_w: float
    host_w: float
    active_w: float
    tdp_w: float
    flop_w: float
    flop_knee: float
    byte_w: float
    byte_knee: float
    busy: float = 1.0
    rows_knee: float = 4.0
    keys_gain: float = 0.3
    rise_s: float = 0.0
    lag_s: float = 0.0
    hold_s: float = 0.5
    warm_w: float = 0.0
    warm_s: float = 60.0
    gap_s: float = 0.0
    bare_s: float = 0.0

    def __post_init__(self) -> None:
        bad = [f.name for f in dataclasses.fields(self) if not math.isfinite(getattr(self, f.name))
               or getattr(self, f.name) < 0]
        if bad:
            raise ValueError(f"device law parameters must be finite and >= 0: {', '.join(bad)}")
        if self.flop_knee <= 0 or self.byte_knee <= 0 or self.warm_s <= 0 or self.busy > 1:
            raise ValueError("flop_knee, byte_knee and warm_s must be > 0, busy at most 1")
        if not self.idle_w <= self.host_w <= self.tdp_w or self.active_w > self.tdp_w:
            raise ValueError(f"need idle_w <= host_w <= tdp_w and active_w <= tdp_w, got idle {self.idle_w:g}, "
                             f"host {self.host_w:g}, active {self.active_w:g}, tdp {self.tdp_w:g} W")

    def warm(self, age_s: float) -> float:
        """Extra power ``age_s`` seconds into the trace, W."""
        return self.warm_w * (1.0 - math.exp(-max(age_s, 0.0) / self.warm_s))

    def level_w(self, work: Sequence[ForwardShape], dt: float, age_s: float = 0.0) -> float:
        """The level a phase of ``work`` lasting ``dt`` seconds draws towards, W."""
        base = self.active_w + self.warm(age_s)
        if not work or dt <= 0:
            return min(base, self.tdp_w)
        costs = [forward_cost(s) for s in work]
        moved = sum(c.bytes for c in costs)
        flops = sum(c.flops for c in costs)
        rows = [s.query_tokens if s.query_tokens is not None else s.rows * s.tokens_per_row for s in work]
        weights = [c.bytes for c in costs] if moved else [1.0] * len(costs)
        occupancy = sum(w * q / (q + self.rows_knee) for w, q in zip(weights, rows)) / sum(weights)
        kv = sum(c.kv_read_bytes for c in costs) / moved if moved else 0.0
        nominal = max(flops / self.flop_knee, moved / self.byte_knee)
        t = nominal + self.busy * (dt - nominal)  # working time, s
        if t <= 0:
            return min(base, self.tdp_w)
        dynamic = (self.flop_w * (1.0 - math.exp(-flops / t / self.flop_knee))
                   + self.byte_w * (1.0 - math.exp(-moved / t / self.byte_knee)))
        return min(base + occupancy * (1.0 + self.keys_gain * kv) * dynamic, self.tdp_w)

    def tau_s(self, start_w: float, level_w: float) -> float:
        """Time constant of a relaxation from ``start_w`` towards ``level_w``."""
        return self.rise_s if level_w > start_w else self.lag_s


def gpu_law(profile: HardwareProfile) -> DeviceLaw:
    """A law resembling an H100/H200 SXM board: idle at the profile's idle power, 700 W cap, memory
    power saturating near the board's bandwidth, clocks rising in 0.05 ms and falling over 0.25 ms."""
    return DeviceLaw(idle_w=profile.idle_w, host_w=120.0, active_w=160.0, tdp_w=700.0, flop_w=420.0, flop_knee=5e14,
                     byte_w=330.0, byte_knee=0.45 * profile.bandwidth_Bps, rows_knee=4.0, keys_gain=0.3,
                     rise_s=0.05e-3, lag_s=0.25e-3, hold_s=0.5, warm_w=25.0, warm_s=60.0, gap_s=20e-6, bare_s=0.2e-3)


def cpu_law(profile: HardwareProfile) -> DeviceLaw:
    """A law resembling two cores of a server CPU package, its knees at this CPU's benchmarked
    peak and bandwidth, idle at the profile's idle power; time-shared (``busy`` 0), so a phase's
    power does not follow the machine's load."""
    idle = profile.idle_w
    return DeviceLaw(idle_w=idle, host_w=idle + 3.0, active_w=idle + 6.0, tdp_w=idle + 60.0, flop_w=12.0,
                     flop_knee=profile.peak_flops, byte_w=9.0, byte_knee=profile.bandwidth_Bps, busy=0.0,
                     rows_knee=4.0, keys_gain=0.3, rise_s=1e-3, lag_s=20e-3, hold_s=0.5, warm_w=1.5, warm_s=60.0)


def default_law(profile: HardwareProfile) -> DeviceLaw:
    """The law of a profile: a benchmarked (CPU) profile's, else a GPU board's."""
    return cpu_law(profile) if profile.benchmarked else gpu_law(profile)


SPEC_KEYS: dict[str, tuple[str, float]] = {
    "idle_w": ("idle_w", 1.0), "host_w": ("host_w", 1.0), "active_w": ("active_w", 1.0), "tdp_w": ("tdp_w", 1.0),
    "flop_w": ("flop_w", 1.0), "flop_knee_tflops": ("flop_knee", 1e12), "byte_w": ("byte_w", 1.0),
    "byte_knee_gbps": ("byte_knee", 1e9), "busy": ("busy", 1.0), "rows_knee": ("rows_knee", 1.0),
    "keys_gain": ("keys_gain", 1.0),
    "rise_ms": ("rise_s", 1e-3), "lag_ms": ("lag_s", 1e-3), "hold_ms": ("hold_s", 1e-3), "warm_w": ("warm_w", 1.0),
    "warm_s": ("warm_s", 1.0), "gap_us": ("gap_s", 1e-6), "bare_us": ("bare_s", 1e-6),
}
"""``--meter simulated:...`` keys of the law: key -> (field, unit in SI)."""


def law_with(law: DeviceLaw, options: Mapping[str, Any]) -> DeviceLaw:
    """``law`` with the :data:`SPEC_KEYS` among ``options`` applied (other keys are ignored).

    Raises:
        ValueError: a parameter out of range (the message names it).
    """
    changes = {field: float(options[key]) * unit for key, (field, unit) in SPEC_KEYS.items() if key in options}
    return dataclasses.replace(law, **changes) if changes else law


__all__ = ["DeviceLaw", "gpu_law", "cpu_law", "default_law", "law_with", "SPEC_KEYS"]
