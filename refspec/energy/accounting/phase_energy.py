"""Per-phase energy of ledger runs: read directly, or attributed from counter windows and loops,
and split only where the split passes its gate.

A modelled meter (the roofline) and a counter fine enough to read a phase (the fake counter of
tests) write every phase record's ``energy_j``: the accounting uses them as they are
(method ``modelled`` or ``measured-direct``). A counter that cannot see a phase (NVML, RAPL,
the simulated counter) writes ``energy_j`` null and reads its counter only at a run's start,
at sub-window bounds, and at its end (``counter`` records). Its phases' energy is then
attributed (:mod:`refspec.energy.accounting.attribution`):

``attributed-loops``
    Where a loop runner wrote ``loop`` records (:mod:`refspec.phase_loops`: a phase alone,
    repeated at the run's shapes), a phase record's energy = its loop's power (the loop's J
    over its s) x the record's own time: the loop gives the power the phase draws alone, the
    run's timer what the phase lasted there. A phase without a loop takes the fit's power.
``attributed-fit``
    Without loops: each pair of consecutive counter reads bounds a sub-window (sub-windows
    shorter than the gate's floor are merged into their neighbour), its energy the counter
    difference, its time the reads' ``wall_s`` difference, each phase's time in it the sum of
    its records' ``time_s``; :func:`~refspec.energy.accounting.attribution.nnls_phase_power` fits one power
    per phase; the time outside every phase (host work) is priced at ``host_w`` (the run's idle
    power) when given, else fitted as a column of its own. The fit is used only when it is
    determined: each phase share's standard error at most :data:`FIT_SHARE_SE_LIMIT` and the
    phase-time matrix's condition number at most :data:`FIT_CONDITION_LIMIT` (a steady state at
    a fixed K drafts and verifies in a fixed ratio, so any split of their joint energy fits
    about as well as another).
``measured-total-only``
    The split failed its gate (:class:`SplitGate`, the reasons recorded): the run's total is
    measured, its split is not; every joule is ``unattributed``.

**The gate** (:class:`GateRule`, defaults :data:`GATE`). A loop split is used only when every
loop spans at least ``min_periods`` counter periods and ``min_s`` seconds; every loop draws at
least the idle power; every phase that ran has a loop (or a determined fit prices it); the
additivity residual (the loops' prediction of the run, host time priced at the idle power,
against the counter's total) is within ``additivity``; where the fit is determined, loops and
fit agree within ``agreement`` per share (plus twice the fit's standard error); and the
interaction check passes: the loop of the
whole step (``step``, the run's draft, verify and commit interleaved) drew what the isolated
loops' powers predict for its phases' times, its residual times the step phases' part of the
split within ``interaction`` points of share (phases that change each other's power, through
clocks, heat or caches, show there and nowhere else). A fit
split is used only when the fit is determined and its sub-windows meet the same floors.

Either way the measured total is the counter's, last read minus first, so the parts close on
it: whatever the phase records were not given (host time, the fit's residual) is the named
item ``unattributed`` = measured total - sum of the phase records' energies; the host time
(counter span minus phase time) and its price at ``host_w`` are reported beside it. With a
simulated counter the records also carry the truth (``energy_true_j``) and the naive per-phase
read (``energy_naive_j``), from which the true and naive shares are formed for comparison.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from refspec.energy.accounting.attribution import Loop, PhasePower, nnls_phase_power
from refspec.energy.accounting.split_gate import (GATE, GateRule, SplitGate, check_reasons, disagreement,
                                                  interaction_residual, loop_reasons)

Record = Mapping[str, Any]
METHODS = ("modelled", "measured-direct", "attributed-loops", "attributed-fit", "measured-total-only")
FIT_SHARE_SE_LIMIT = 0.02
"""Largest standard error of a phase's fitted share (from the fit's own residual) at which the
fit's split is used. The error grows as the phases run in more nearly the same proportions in
every sub-window (a fixed K in a steady state: no fit can tell their powers apart) and as the
counter's sampling noise grows against the sub-windows' energy."""
FIT_CONDITION_LIMIT = 1e3
"""Largest condition number of the sub-windows' phase-time matrix (columns scaled to unit norm)
at which the fit's split is used, whatever its residual: beyond it the phases' times are
proportional in every sub-window and an exact fit is one of many."""
STEP_LOOP = "step"
"""The loop record of the whole step interleaved (the interaction check's)."""


@dataclasses.dataclass(frozen=True)
class SubWindow:
    """The energy between two counter reads of a run and the phases run between them.

    Attributes:
        energy_j: counter difference, J.
        time_s: difference of the reads' ``wall_s``, s (host time included).
        phase_time_s: time of each phase between the reads, s (engine clock).
        true_j: the simulated counter's true energy over the window, J (None for a real counter).
    """

    energy_j: float
    time_s: float
    phase_time_s: dict[str, float]
    true_j: float | None

    def __add__(self, other: "SubWindow") -> "SubWindow":
        """Two consecutive windows as one."""
        times = dict(self.phase_time_s)
        for p, t in other.phase_time_s.items():
            times[p] = times.get(p, 0.0) + t
        true = None if self.true_j is None or other.true_j is None else self.true_j + other.true_j
        return SubWindow(self.energy_j + other.energy_j, self.time_s + other.time_s, times, true)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseEnergy:
    """How the energy of some runs was split among their phases.

    Attributes:
        method: one of :data:`METHODS`, or None when no energy was recorded (a time-only meter).
        records: per run, its phase records with ``energy_j`` as the accounting uses it.
        total_j: the energy the runs drew: the counters' (last read - first) under attribution,
            else the sum of the records.
        unattributed_j: ``total_j`` minus the records' sum (0 for a direct read).
        span_s: the counters' wall span under attribution (host time included), else None.
        host_s: the span's time outside every phase record, s (None for a direct read).
        host_j: ``host_s`` priced at ``host_w`` (the fit's host power without one), J; None when
            neither is known.
        period_s: the counter's period, from its records (None if they do not give it).
        split_gate: the gate's verdict (None for a direct read).
        sub_windows: the counter sub-windows, short ones merged (empty for a direct read).
        fit: the fit of per-phase power over ``sub_windows`` (None with too few of them).
        fit_condition: condition number of the fit's phase-time matrix (columns at unit norm).
        fit_share_se: standard error of each phase's fitted share, from the fit's residual.
        fit_determined: the fit's split is certain enough to use (:data:`FIT_SHARE_SE_LIMIT`,
            :data:`FIT_CONDITION_LIMIT`).
        loops: per phase, the loop records pooled (empty without loops; the step loop apart).
        step_loop: the loop of the whole step, pooled (None without one).
        share_fit / share_loops: each phase's share of the phase energy by either estimate (the
            loops' phases by their power, the others by the fit), reported whether or not the
            split passed.
        agreement: largest difference of a phase's share between the two (None unless both).
        additivity_residual: (predicted - measured) / measured, the prediction being the loops'
            power x each record's time, the fit's for phases without a loop, and the host time
            at ``host_j``.
        interaction_residual: (predicted - measured) / measured over the step loop, the
            prediction being the isolated loops' powers x its phases' times (its host time
            spread in proportion).
        interaction_points: |interaction residual| x the step phases' part of the split, in
            points of share: energy the loops put in no phase, the most it moves a share when it
            adds to every phase it touches (the gate's interaction check).
        share_true / share_naive: a simulated counter's true and naively read shares.
        true_total_j: a simulated counter's true energy over the runs' spans, J.
    """

    method: str | None
    records: tuple[tuple[Record, ...], ...]
    total_j: float | None
    unattributed_j: float = 0.0
    span_s: float | None = None
    host_s: float | None = None
    host_j: float | None = None
    period_s: float | None = None
    split_gate: SplitGate | None = None
    sub_windows: tuple[SubWindow, ...] = ()
    fit: PhasePower | None = None
    fit_condition: float | None = None
    fit_share_se: dict[str, float] | None = None
    fit_determined: bool = False
    loops: dict[str, Loop] = dataclasses.field(default_factory=dict)
    step_loop: Loop | None = None
    share_fit: dict[str, float] | None = None
    share_loops: dict[str, float] | None = None
    agreement: float | None = None
    additivity_residual: float | None = None
    interaction_residual: float | None = None
    interaction_points: float | None = None
    share_true: dict[str, float] | None = None
    share_naive: dict[str, float] | None = None
    true_total_j: float | None = None


def shares(energy: Mapping[str, float]) -> dict[str, float]:
    """Each key's share of the sum (NaN shares when the sum is 0)."""
    total = sum(energy.values())
    return {k: (e / total if total else float("nan")) for k, e in energy.items()}


def _by_phase(records: Sequence[Record], field: str) -> dict[str, float] | None:
    out: dict[str, float] = defaultdict(float)
    for r in records:
        if r.get(field) is None:
            return None
        out[str(r["phase"])] += float(r[field])
    return dict(out)


def sub_windows(phases: Sequence[Record], counters: Sequence[Record],
                column: Callable[[Record], str] = lambda r: str(r["phase"])) -> list[SubWindow]:
    """The sub-windows between consecutive counter reads of one run (phases placed by their mid
    clock), each phase record's time summed under ``column(record)`` (default: its phase)."""
    reads = sorted(counters, key=lambda c: (float(c["clock_s"]), float(c["wall_s"])))
    clocks = [float(c["clock_s"]) for c in reads]
    times: list[dict[str, float]] = [defaultdict(float) for _ in reads[1:]]
    for r in phases:
        mid = float(r["clock_s"]) + float(r["time_s"]) / 2
        assert clocks[0] <= mid <= clocks[-1], f"phase at clock {r['clock_s']} lies outside the counter reads"
        i = min(bisect.bisect_right(clocks, mid) - 1, len(times) - 1)  # a 0 s phase may sit on the last read
        times[i][column(r)] += float(r["time_s"])
    out = []
    for a, b, t in zip(reads, reads[1:], times):
        true = (None if a.get("energy_true_j") is None or b.get("energy_true_j") is None
                else float(b["energy_true_j"]) - float(a["energy_true_j"]))
        out.append(SubWindow(energy_j=float(b["energy_j"]) - float(a["energy_j"]),
                             time_s=float(b["wall_s"]) - float(a["wall_s"]), phase_time_s=dict(t), true_j=true))
    return out


def merged(windows: Sequence[SubWindow], floor_s: float) -> list[SubWindow]:
    """One run's consecutive sub-windows merged until each lasts at least ``floor_s`` (a short
    remainder joins the last one)."""
    out: list[SubWindow] = []
    pending: SubWindow | None = None
    for w in windows:
        pending = w if pending is None else pending + w
        if pending.time_s >= floor_s:
            out.append(pending)
            pending = None
    if pending is not None:
        out[-1:] = [out[-1] + pending] if out else [pending]
    return out


@dataclasses.dataclass(frozen=True)
class _Fit:
    power: PhasePower | None = None
    condition: float | None = None
    share_se: dict[str, float] | None = None

    @property
    def determined(self) -> bool:
        return (self.share_se is not None and max(self.share_se.values(), default=0.0) <= FIT_SHARE_SE_LIMIT
                and self.condition is not None and self.condition <= FIT_CONDITION_LIMIT)


def _fit(windows: Sequence[SubWindow], names: Sequence[str], host_w: float | None) -> _Fit:
    """The fit, the condition number of its design and each phase share's standard error."""
    cols = len(names) + (host_w is None)
    if len(windows) < cols:
        return _Fit()  # too few windows to determine a power per phase (and the host time's)
    times = [[w.phase_time_s.get(p, 0.0) for p in names] for w in windows]
    fit = nnls_phase_power([w.energy_j for w in windows], times, names, window_time_s=[w.time_s for w in windows],
                           host_w=host_w)
    design = np.array([t + ([max(w.time_s - sum(t), 0.0)] if host_w is None else []) for t, w in zip(times, windows)])
    norms = np.linalg.norm(design, axis=0)
    condition = float(np.linalg.cond(design / np.where(norms > 0, norms, 1.0)))
    dof = len(windows) - cols
    if dof <= 0:
        return _Fit(fit, condition)  # an exact fit says nothing of its own error
    variance = float(np.sum(np.square(fit.window_residuals_j))) / dof  # J^2 per window
    cov = variance * np.linalg.pinv(design.T @ design)  # [cols, cols] of the powers, W^2
    phase_j = sum(fit.energy_j[p] for p in names) or 1.0
    se = {p: float(design[:, i].sum() * np.sqrt(max(cov[i, i], 0.0))) / phase_j for i, p in enumerate(names)}
    return _Fit(fit, condition, se)


def _pool_loops(loops: Sequence[Record]) -> dict[str, Loop]:
    """Loop records pooled by phase; a loop that gives its ``rows`` pools per row-call (``rows`` 1);
    the step loop's phase times add up."""
    out: dict[str, Loop] = {}
    for r in loops:
        rows = r.get("rows")
        prev = out.get(str(r["phase"]), Loop(energy_j=0.0, time_s=0.0, iterations=0, rows=1 if rows else None))
        if (prev.rows is None) != (rows is None):
            raise ValueError(f"loop records of phase {r['phase']!r} mix calls priced per call and per row")
        times = dict(prev.phase_time_s or {})
        for p, t in (r.get("phase_time_s") or {}).items():
            times[p] = times.get(p, 0.0) + float(t)
        out[str(r["phase"])] = Loop(energy_j=prev.energy_j + float(r["energy_j"]),
                                    time_s=prev.time_s + float(r["time_s"]),
                                    iterations=prev.iterations + int(r["iterations"]) * int(rows or 1), rows=prev.rows,
                                    phase_time_s=times or None)
    return {p: loop for p, loop in out.items() if loop.time_s > 0}  # a loop that took no time gives no power


def _direct(runs: Sequence[Sequence[Record]]) -> PhaseEnergy:
    flat = [r for run in runs for r in run]
    if any(r.get("energy_j") is None for r in flat):
        return PhaseEnergy(method=None, records=tuple(tuple(run) for run in runs), total_j=None)
    method = "modelled" if all(str(r["source"]).startswith("modelled") for r in flat) else "measured-direct"
    return PhaseEnergy(method=method, records=tuple(tuple(run) for run in runs),
                       total_j=sum(float(r["energy_j"]) for r in flat))


def phase_energy(runs: Sequence[tuple[Sequence[Record], Sequence[Record], Sequence[Record]]], *,
                 host_w: float | None = None, rule: GateRule = GATE) -> PhaseEnergy:
    """The per-phase energy of ``runs`` taken together (see the module docstring).

    Args:
        runs: per run, ``(phase records, counter records, loop records)``.
        host_w: power of the host time between phases, W (the run's idle power); None fits it,
            and leaves the loops unchecked against idle (their gate fails).
        rule: the split's gate.

    Returns:
        The :class:`PhaseEnergy`; the runs are attributed together (one fit over all their
        sub-windows, loops pooled by phase) when their phase records hold no energy and each
        run has at least two counter reads.

    Raises:
        ValueError: a run whose phases hold no energy has fewer than two counter reads.
    """
    phases = [list(p) for p, _, _ in runs]
    if all(r.get("energy_j") is not None for run in phases for r in run) or not any(c for _, c, _ in runs):
        return _direct(phases)
    if any(len(c) < 2 for _, c, _ in runs):
        raise ValueError("a counter-metered run needs at least its start and end counter reads to be accounted")
    return _attributed(phases, runs, host_w, rule)


def _period(runs: Sequence[tuple[Sequence[Record], Sequence[Record], Sequence[Record]]]) -> float | None:
    """The counter's period: the longest its records give (None when one of them gives none)."""
    periods = [c.get("period_s") for _, counters, _ in runs for c in counters]
    return None if any(p is None for p in periods) else max(float(p) for p in periods)


def _attributed(phases: list[list[Record]], runs: Sequence[tuple[Sequence[Record], Sequence[Record],
                                                                   Sequence[Record]]],
                host_w: float | None, rule: GateRule) -> PhaseEnergy:
    flat = [r for run in phases for r in run]
    period = _period(runs)
    floor = rule.floor_s(period)
    raw = [sub_windows(p, c) for p, c, _ in runs]
    windows = [w for run in raw for w in merged(run, floor)]
    names = sorted({str(r["phase"]) for r in flat if float(r["time_s"]) > 0})
    fitted = _fit(windows, names, host_w)
    fit_ok = fitted.determined and all(w.time_s >= floor for w in windows)
    fit = fitted.power if fit_ok else None  # the split it can give
    loops = _pool_loops([r for _, _, lp in runs for r in lp])
    step = loops.pop(STEP_LOOP, None)
    measured = sum(w.energy_j for run in raw for w in run)
    span = sum(w.time_s for run in raw for w in run)
    host_s = span - sum(float(r["time_s"]) for r in flat)
    host_power = host_w if host_w is not None else (fit.power_w.get("unattributed") if fit is not None else None)
    host_j = None if host_power is None else host_power * host_s

    def by_fit(r: Record, power: PhasePower | None = fit) -> float:
        return power.power_w.get(str(r["phase"]), 0.0) * float(r["time_s"]) if power is not None else 0.0

    def by_loops(r: Record) -> float:  # a phase without a loop takes the fit's figure
        loop = loops.get(str(r["phase"]))
        return by_fit(r) if loop is None else loop.power_w * float(r["time_s"])

    def share_by(energy: Callable[[Record], float]) -> dict[str, float]:
        return shares({p: sum(energy(r) for r in flat if r["phase"] == p) for p in names})

    share_fit = share_by(lambda r: by_fit(r, fitted.power)) if fitted.power is not None else None  # even undetermined
    share_loops = share_by(by_loops) if loops else None
    both = fit is not None and share_loops is not None and share_fit is not None
    agreement = max(abs(share_loops[p] - share_fit[p]) for p in names) if both else None  # type: ignore[index]
    worst = disagreement(share_loops, share_fit, fitted.share_se or {}) if both else None  # type: ignore[arg-type]
    loop_j = sum(by_loops(r) for r in flat)
    additivity = ((loop_j + host_j - measured) / measured if loops and host_j is not None and measured else None)
    interaction = interaction_residual(step, loops) if step is not None else None
    in_step = set((step.phase_time_s or {}) if step is not None else ())
    step_part = sum(by_loops(r) for r in flat if r["phase"] in in_step) / loop_j if loop_j > 0 else 1.0
    if loops:
        reasons = loop_reasons(loops, set(names), fit_prices=fit is not None, period_s=period, idle_w=host_w,
                               rule=rule) + check_reasons(additivity=additivity, agreement=worst,
                                                          interaction=interaction, has_step=step is not None,
                                                          step_part=step_part, rule=rule)
    else:
        reasons = [] if fit is not None else [_fit_reason(fitted, windows, floor)]
    method = "measured-total-only" if reasons else "attributed-loops" if loops else "attributed-fit"
    energy = {"attributed-loops": by_loops, "attributed-fit": by_fit}.get(method, lambda r: 0.0)
    records = tuple(tuple({**r, "energy_j": energy(r)} for r in run) for run in phases)
    attributed = sum(r["energy_j"] for run in records for r in run)
    truths = [w.true_j for run in raw for w in run]
    true_by_phase, naive_by_phase = _by_phase(flat, "energy_true_j"), _by_phase(flat, "energy_naive_j")
    return PhaseEnergy(  # the measured total, what the split gave each record, and every figure it rests on
        method=method, records=records, total_j=measured, unattributed_j=measured - attributed, span_s=span,
        host_s=host_s, host_j=host_j, period_s=period, split_gate=SplitGate(not reasons, tuple(reasons)),
        sub_windows=tuple(windows), fit=fitted.power, fit_condition=fitted.condition, fit_share_se=fitted.share_se,
        fit_determined=fitted.determined, loops=loops, step_loop=step, share_fit=share_fit, share_loops=share_loops,
        agreement=agreement, additivity_residual=additivity, interaction_residual=interaction,
        interaction_points=None if interaction is None else 100 * abs(interaction) * step_part,
        share_true=shares(true_by_phase) if true_by_phase else None,
        share_naive=shares(naive_by_phase) if naive_by_phase else None,
        true_total_j=None if any(t is None for t in truths) else sum(truths))  # type: ignore[arg-type]


def _fit_reason(fitted: _Fit, windows: Sequence[SubWindow], floor_s: float) -> str:
    """Why a fit without loops gives no split."""
    if fitted.power is None:
        return f"{len(windows)} sub-windows of at least {floor_s:.3g} s cannot fit a power per phase; run the loops"
    if not fitted.determined:
        se = max((fitted.share_se or {}).values(), default=float("nan"))
        return (f"the fit is undetermined (largest share s.e. {100 * se:.3g} percentage points, condition "
                f"{fitted.condition:.3g}): the phases ran in nearly the same proportions in every sub-window; run "
                f"the loops")
    return f"a sub-window lasts under {floor_s:.3g} s"


__all__ = ["METHODS", "FIT_SHARE_SE_LIMIT", "FIT_CONDITION_LIMIT", "STEP_LOOP", "SubWindow", "PhaseEnergy",
           "phase_energy", "sub_windows", "merged", "shares"]
