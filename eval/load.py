"""How busy the host was while a configuration served, and whether a verdict can rest on its time.

On a CPU a configuration's J/token is a power times its wall time, so a verdict (drafter
against baseline) is the ratio of two wall times: other jobs on the cores change it. A
:class:`LoadProbe` started before serving and stopped after it gives the record's ``host``
section: the 1-minute load average at both ends, the process's CPU time over the wall time,
and (:func:`host_section`) the measured decode step time over the roofline's modelled one.
:func:`verdict_reliability` says whether a comparison's verdict can be trusted: not when the
two ran under different load, nor when either got less than :data:`MIN_CPU_SHARE` of the
cores its threads asked for, nor when a measured step took more than
:data:`MAX_TIME_OVER_MODEL` times the model's (``docs/fields.md`` explains the thresholds).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from refspec.eval.record import Host, RunRecord

MAX_LOAD_GAP_PER_CPU = 0.5
"""Largest difference in mean 1-minute load average per CPU between a comparison and its baseline."""
MAX_TIME_OVER_MODEL = 10.0
"""Largest measured / modelled decode step time of a CPU verdict (a quiet machine shows 2.3-6.2x)."""
MIN_CPU_SHARE = 0.75
"""Least CPU time over wall time, per thread the run asked for (at most one per CPU), of a CPU verdict."""
WHAT_TO_DO = ("unreliable verdicts: rerun on a quiet machine (nothing else on the cores), or pass --meter "
              "roofline:h200 (any GPU profile) for a load-independent modelled figure")


@dataclasses.dataclass(frozen=True)
class LoadProbe:
    """The host's load, the process's CPU time and the wall clock when serving started."""

    load_start: float | None
    cpu_s: float
    wall_s: float

    @classmethod
    def start(cls) -> "LoadProbe":
        return cls(load_start=_load_average(), cpu_s=time.process_time(), wall_s=time.perf_counter())

    def stop(self) -> Host:
        """The ``host`` section over the time since :meth:`start` (step times: :func:`host_section`)."""
        import torch  # here, not at the top: reading and reporting records needs no torch
        wall = time.perf_counter() - self.wall_s
        cpu = time.process_time() - self.cpu_s
        return Host(load_start=self.load_start, load_end=_load_average(), cpus=os.cpu_count(),
                    threads=torch.get_num_threads(), cpu_s=cpu, wall_s=wall, cpu_per_wall=cpu / wall if wall > 0 else None)


def _load_average() -> float | None:
    """The 1-minute load average (runnable threads, this process's included), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def measured_step_s(r: RunRecord) -> float | None:
    """Mean wall time of a decode step: the steady-state window's, else the run's decode steps' (s)."""
    w = r.window
    if w is not None and w.steps and w.time_s:
        return w.time_s / w.steps
    c = r.counts
    if c.steps and r.run.time_s is not None:
        return (r.run.time_s - (c.prefill_time_s or 0.0)) / c.steps
    return None


def modelled_step_s(r: RunRecord) -> float | None:
    """The roofline's modelled steady-state step time (s), None without a prediction."""
    roof = r.roofline or {}
    if roof.get("step_time_s") is not None:
        return roof["step_time_s"]
    if roof.get("tpot_s") is not None and roof.get("tokens_per_row") is not None:
        return roof["tpot_s"] * roof["tokens_per_row"]
    return None


def host_section(host: Host, record: RunRecord) -> Host:
    """``host`` with the measured and modelled step times of ``record`` and their ratio."""
    measured, modelled = measured_step_s(record), modelled_step_s(record)
    ratio = measured / modelled if measured is not None and modelled else None
    return dataclasses.replace(host, step_time_s=measured, model_step_time_s=modelled, time_vs_model=ratio)


def mean_load(h: Host) -> float | None:
    """Mean of the start and end load averages per CPU, None when not recorded."""
    loads = [x for x in (h.load_start, h.load_end) if x is not None]
    return sum(loads) / len(loads) / (h.cpus or 1) if loads else None


def cpu_share(h: Host) -> float | None:
    """CPU time over wall time per thread that had a core to itself (threads beyond the CPUs share
    them anyway): an OpenMP team spins while it waits, so a run alone on the cores keeps near 1."""
    if h.cpu_per_wall is None or not h.threads:
        return None
    return h.cpu_per_wall / min(h.threads, h.cpus or h.threads)


def _host_of(figures: Any) -> Host:
    """The ``host`` section of a record or of a record's ``baseline`` figures."""
    if isinstance(figures, RunRecord):
        return figures.host
    return Host(**{f.name: (figures or {}).get(Host.PREFIX + f.name) for f in dataclasses.fields(Host)})


def verdict_reliability(record: RunRecord, baseline: Any) -> tuple[bool | None, str | None]:
    """Whether ``record``'s verdict against ``baseline`` (a record or its ``baseline`` figures) can be trusted.

    Only wall-clock CPU runs are judged (a modelled time does not depend on load): unreliable when
    the two ran at mean loads per CPU more than :data:`MAX_LOAD_GAP_PER_CPU` apart, when either
    got less than :data:`MIN_CPU_SHARE` of a core per thread (:func:`cpu_share`), or when either's
    measured step took more than :data:`MAX_TIME_OVER_MODEL` times the model's.

    Returns:
        ``(True, None)``, ``(False, reason)``, or ``(None, None)`` when nothing was recorded to judge by.
    """
    if record.time_source == "modelled" or record.device != "cpu":
        return True, None
    mine, theirs = record.host, _host_of(baseline)
    reasons = []
    a, b = mean_load(mine), mean_load(theirs)
    if a is not None and b is not None and abs(a - b) > MAX_LOAD_GAP_PER_CPU:
        reasons.append(f"it and its baseline ran under different load ({a:.2f} vs {b:.2f} load average per CPU)")
    for who, h in (("it", mine), ("its baseline", theirs)):
        share = cpu_share(h)
        if share is not None and share < MIN_CPU_SHARE:
            reasons.append(f"{who} got {h.cpu_per_wall:.2f} CPUs for its {h.threads} threads ({share:.0%} of a core "
                           f"each, under {MIN_CPU_SHARE:.0%}: other jobs shared the cores)")
        if h.time_vs_model is not None and h.time_vs_model > MAX_TIME_OVER_MODEL:
            reasons.append(f"{who} ran {h.time_vs_model:.0f}x slower than modelled (more than "
                           f"{MAX_TIME_OVER_MODEL:g}x: the host, not the model, set its time)")
    if reasons:
        return False, "; ".join(reasons)
    judged = ((a is not None and b is not None) or any(x is not None for h in (mine, theirs)
                                                        for x in (h.time_vs_model, cpu_share(h))))
    return (True, None) if judged else (None, None)


__all__ = ["LoadProbe", "host_section", "measured_step_s", "modelled_step_s", "mean_load", "verdict_reliability",
           "cpu_share", "MAX_LOAD_GAP_PER_CPU", "MIN_CPU_SHARE", "MAX_TIME_OVER_MODEL", "WHAT_TO_DO"]
