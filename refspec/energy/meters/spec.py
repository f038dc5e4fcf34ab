"""The ``--meter`` spec string, parsed without building anything (the CLI checks it before torch loads).

Grammar: ``KIND[:PROFILE][:key=value]...``. Kinds and their options:

==============  ==============================================================================
``auto``        a measured counter where one can be read (NVML on a GPU, RAPL on a CPU), else
                the roofline model (labelled modelled)
``zeus``        NVML's total-energy counter through Zeus; ``gpus=0,1`` sums several GPUs
``nvml``        NVML through pynvml (the counter, else the instantaneous-power integral); ``gpus=``
``rapl``        CPU package and DRAM counters (powercap); ``domains=package,dram``, ``root=PATH``
``roofline``    modelled energy; ``roofline:PROFILE`` (h100, h200) models the time too, while
                ``cpu`` (this CPU's benchmarked profile) prices the measured wall time
``time``        time only, no energy
``simulated``   ``simulated:PROFILE[:period_ms=P][:sample_ms=S][:noise=X][:seed=N]``: a simulated
                device's power law as truth, read through a simulated counter
                (:mod:`refspec.energy.meters.simulated`); the law's parameters and the counter clock's
                ``drift_ppm`` and ``offset_ms`` are keys too (:data:`SIMULATED_LAW`)
==============  ==============================================================================

Every counter kind (zeus, nvml, rapl, simulated, and auto when it finds one) also takes
``sub_window_s=W``: the shortest sub-window between counter reads (at least ten periods).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

PROFILES = ("cpu", "h100", "h100-sxm", "h200", "h200-sxm")
KINDS = ("auto", "zeus", "nvml", "rapl", "roofline", "time", "simulated")
COUNTER_OPTIONS = ("sub_window_s",)
SIMULATED_LAW = ("idle_w", "host_w", "active_w", "tdp_w", "flop_w", "flop_knee_tflops", "byte_w", "byte_knee_gbps",
                 "busy", "rows_knee", "keys_gain", "rise_ms", "lag_ms", "hold_ms", "warm_w", "warm_s", "gap_us",
                 "bare_us", "drift_ppm", "offset_ms")
"""Keys of a simulated device's law and counter clock (:mod:`refspec.energy.meters.device_law`), each >= 0."""
OPTIONS: dict[str, tuple[str, ...]] = {
    "auto": ("gpus",) + COUNTER_OPTIONS,
    "zeus": ("gpus",) + COUNTER_OPTIONS,
    "nvml": ("gpus",) + COUNTER_OPTIONS,
    "rapl": ("domains", "root") + COUNTER_OPTIONS,
    "roofline": (),
    "time": (),
    "simulated": ("period_ms", "sample_ms", "noise", "seed") + SIMULATED_LAW + COUNTER_OPTIONS,
}
TAKES_PROFILE = ("roofline", "simulated")
_UNIT_HIGH = {"_ms": 60_000.0, "_s": 3600.0, "_us": 1e6, "_w": 1e5, "_ppm": 1e5, "_tflops": 1e6, "_gbps": 1e6}
HIGH: dict[str, float] = {**{k: h for k in SIMULATED_LAW for u, h in _UNIT_HIGH.items() if k.endswith(u)},
                          "busy": 1.0, "rows_knee": 1e6, "keys_gain": 1e3, "period_ms": 60_000.0,
                          "sample_ms": 60_000.0, "noise": 1.0, "sub_window_s": 3600.0, "seed": 2**63 - 1}
"""Largest accepted option values: a longer period never resolves a run, more noise than 100 % is no counter."""
LOW_MS = 1e-4
"""Shortest ``period_ms``/``sample_ms`` (0.1 us): a simulated counter keeps one entry per period of the run."""


class MeterSpecError(ValueError):
    """A ``--meter`` spec that cannot be parsed; the message says what is wrong and what fits."""


@dataclasses.dataclass(frozen=True)
class MeterSpec:
    """A parsed meter spec.

    Attributes:
        kind: one of :data:`KINDS`.
        profile: the roofline profile of ``roofline``/``simulated`` (None: the default).
        options: typed options (``gpus``: tuple of int, ``domains``: tuple of str, ``root``:
            str, ``period_ms``/``sample_ms``/``noise``/``sub_window_s``: float, ``seed``: int).
    """

    kind: str
    profile: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _number(key: str, text: str, *, low: float, integer: bool = False, strict: bool = False) -> float | int:
    try:
        value: float | int = int(text) if integer else float(text)
    except ValueError:
        raise MeterSpecError(f"{key}={text!r} is not {'an integer' if integer else 'a number'}") from None
    high = HIGH.get(key, float("inf"))
    if value != value or value in (float("inf"), float("-inf")) or value < low or (strict and value == low) \
            or value > high:
        raise MeterSpecError(f"{key}={text} must be {'>' if strict else '>='} {low:g} and <= {high:g}")
    return value


def _value(key: str, text: str) -> Any:
    if key == "gpus":
        try:
            gpus = tuple(int(x) for x in text.split(",") if x != "")
        except ValueError:
            raise MeterSpecError(f"gpus={text!r}: give GPU indices, e.g. gpus=0,1") from None
        if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
            raise MeterSpecError(f"gpus={text!r}: give distinct GPU indices >= 0, e.g. gpus=0,1")
        return gpus
    if key == "domains":
        names = tuple(x for x in text.split(",") if x)
        if not names:
            raise MeterSpecError("domains= is empty; e.g. domains=package,dram")
        return names
    if key == "root":
        return text
    if key == "seed":
        return _number(key, text, low=0, integer=True)
    if key == "noise" or key in SIMULATED_LAW:
        return _number(key, text, low=0.0)
    value = _number(key, text, low=0.0, strict=True)  # period_ms, sample_ms, sub_window_s
    if key != "sub_window_s" and value < LOW_MS:
        raise MeterSpecError(f"{key}={text} is below {LOW_MS:g} ms; no counter updates that often")
    return value


def parse_meter_spec(spec: str) -> MeterSpec:
    """Parse ``KIND[:PROFILE][:key=value]...`` (see the module docstring).

    Raises:
        MeterSpecError: unknown kind, profile or option, a malformed or out-of-range value, or
            ``sample_ms`` above ``period_ms``.
    """
    kind, *parts = spec.strip().split(":") if spec else [""]
    kind = kind.lower()
    if kind not in KINDS:
        raise MeterSpecError(f"unknown meter {kind!r}; use {', '.join(KINDS)} (e.g. roofline:h200, "
                             f"simulated:cpu:period_ms=100:sample_ms=25)")
    profile: str | None = None
    options: dict[str, Any] = {}
    for i, part in enumerate(parts):
        key, eq, text = part.partition("=")
        if not eq:
            known = part.lower() in PROFILES
            if i or kind not in TAKES_PROFILE or not known:
                where = f"{kind} takes no profile" if kind not in TAKES_PROFILE else \
                    f"a profile is one of {', '.join(PROFILES)} and comes right after {kind}"
                raise MeterSpecError(f"{part!r}: {where}")
            profile = part.lower()
            continue
        if key not in OPTIONS[kind]:
            takes = ", ".join(OPTIONS[kind]) or "no options"
            raise MeterSpecError(f"option {key!r} does not go with {kind}; it takes {takes}")
        if key in options:
            raise MeterSpecError(f"option {key!r} given twice")
        options[key] = _value(key, text)
    if kind == "simulated":
        period = options.get("period_ms", 100.0)
        if options.get("sample_ms", period) > period:
            raise MeterSpecError(f"sample_ms={options['sample_ms']:g} exceeds period_ms={period:g}: the sensor samples "
                                 f"part of each period")
    return MeterSpec(kind=kind, profile=profile, options=options)


__all__ = ["MeterSpec", "MeterSpecError", "parse_meter_spec", "KINDS", "PROFILES", "OPTIONS", "SIMULATED_LAW"]
