"""The gate a split of a counter's total must pass before it is printed.

A counter measures a run's total over windows it resolves; the split among phases is inferred
(:mod:`refspec.energy.accounting.phase_energy`). An inference that its data cannot bear must not be printed
as a number that looks like the others, so each split is checked, and one that fails a check is
reported as ``measured-total-only`` with the reasons:

* **resolution**: every phase-isolated loop (and every sub-window a fit uses) spans at least
  ``min_periods`` counter periods and ``min_s`` seconds (a GPU's power average and clocks settle
  over about a second, whatever the counter's period);
* **plausibility**: every loop draws at least the device's idle power;
* **coverage**: every phase that ran has a loop, or a determined fit prices it;
* **additivity**: the loops' prediction of the run (each record's time at its loop's power, the
  host time at the idle power) is within ``additivity`` of the counter's total;
* **agreement**: where the fit is determined too, loops and fit give each phase a share within
  ``agreement`` of each other, plus twice the fitted share's standard error;
* **interaction**: the loop of the whole step (the run's draft, verify and commit interleaved)
  drew what the isolated loops' powers predict for its phases' times, within ``interaction``
  points of share. Additivity cannot see power moved from one phase to another inside the run
  (it sums to zero); phases that change each other's power (clocks held up after a hungry
  phase, heat, caches) do change the interleaved step's energy against the isolated loops', and
  show here. The residual r is relative to the step's energy; the step's phases take a part w
  of the split, so r x w of the split is energy the loops put in no phase. Where the
  interaction adds energy to the phases it touches (clocks held up after a hungry phase) or
  takes it from all of them, no share moves by more than that: the check bounds |r| x w. A
  shift between phases with the total unchanged it cannot see (the agreement check can, over
  a varied mix).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from refspec.energy.accounting.attribution import Loop


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateRule:
    """The thresholds of the gate (module docstring).

    Attributes:
        min_periods: fewest counter periods a loop (and a fit's sub-window) spans.
        min_s: shortest loop (and fit sub-window), s.
        additivity: largest |additivity residual|, relative to the measured total.
        agreement: largest difference of a phase's share between loops and a determined fit.
        interaction: largest |interaction residual| x the step phases' part of the split (a
            share's largest error from it).
    """

    min_periods: int = 10
    min_s: float = 1.0
    additivity: float = 0.05
    agreement: float = 0.03
    interaction: float = 0.03

    def floor_s(self, period_s: float | None) -> float:
        """Shortest loop or sub-window on a counter of ``period_s`` seconds (None: unknown), s."""
        return max(self.min_periods * (period_s or 0.0), self.min_s)


GATE = GateRule()
"""The gate the accounting applies."""
STEP_LOOP_SPANS = 3
"""The step loop runs this many loop lengths: its power changes within every step, which a sensor
sampling part of each period averages only over many periods (an isolated loop's hardly changes)."""


@dataclasses.dataclass(frozen=True)
class SplitGate:
    """Whether a split of a counter's total passed its gate, and why not.

    Attributes:
        passed: every check passed (the split is printed).
        reasons: one line per failed check (empty when passed).
    """

    passed: bool
    reasons: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"passed": bool, "reasons": [str, ...]}``."""
        return {"passed": self.passed, "reasons": list(self.reasons)}


def loop_reasons(loops: Mapping[str, Loop], ran: set[str], *, fit_prices: bool, period_s: float | None,
                 idle_w: float | None, rule: GateRule = GATE) -> list[str]:
    """The resolution, plausibility and coverage checks of the loops.

    Args:
        loops: per phase its pooled isolated loop.
        ran: the phases that took time in the run.
        fit_prices: a determined fit prices phases without a loop.
        period_s: the counter's period, s (None: not recorded).
        idle_w: the device's idle power, W (None: not recorded).
        rule: the thresholds.

    Returns:
        One line per failed check.
    """
    out = []
    if period_s is None:
        out.append("the counter records give no period: the loops' resolution cannot be checked")
    floor = rule.floor_s(period_s)
    for p, loop in sorted(loops.items()):
        if loop.time_s < floor:
            periods = f" = {loop.time_s / period_s:.3g} counter periods" if period_s else ""
            out.append(f"loop {p} spans {loop.time_s:.3g} s{periods}, under the floor max({rule.min_periods} "
                       f"periods, {rule.min_s:g} s) = {floor:.3g} s")
        if idle_w is not None and loop.power_w < idle_w:
            out.append(f"loop {p} draws {loop.power_w:.4g} W, below the idle {idle_w:.4g} W")
    if idle_w is None:
        out.append("no idle power recorded: the loops' powers and the host time cannot be checked against it")
    missing = sorted(ran - set(loops))
    if missing and not fit_prices:
        out.append(f"no loop for {', '.join(missing)} and no determined fit to price it")
    return out


def interaction_residual(step: Loop, loops: Mapping[str, Loop]) -> float | None:
    """(predicted - measured) / measured energy of the step loop, the prediction being each of its
    phases' time at its isolated loop's power, its host time spread over them in proportion
    (as each isolated loop's own host time is in its power); None when a phase of the step has
    no isolated loop or the step loop kept no phase times."""
    times = {p: t for p, t in (step.phase_time_s or {}).items() if t > 0}
    if not times or any(p not in loops for p in times) or step.energy_j <= 0:
        return None
    phase_s = sum(times.values())
    predicted = step.time_s / phase_s * sum(loops[p].power_w * t for p, t in times.items())
    return (predicted - step.energy_j) / step.energy_j


def disagreement(share_loops: Mapping[str, float], share_fit: Mapping[str, float],
                 share_se: Mapping[str, float]) -> tuple[str, float, float]:
    """The phase whose loop and fit shares differ most beyond the fit's own uncertainty: ``(phase,
    difference, allowance)``, the allowance being twice its fitted share's standard error."""
    def excess(p: str) -> float:
        return abs(share_loops[p] - share_fit[p]) - 2 * share_se.get(p, 0.0)

    worst = max(share_fit, key=excess)
    return worst, abs(share_loops[worst] - share_fit[worst]), 2 * share_se.get(worst, 0.0)


def check_reasons(*, additivity: float | None, agreement: tuple[str, float, float] | None,
                  interaction: float | None, has_step: bool, step_part: float = 1.0,
                  rule: GateRule = GATE) -> list[str]:
    """The additivity, agreement (:func:`disagreement`) and interaction checks of a loop split
    (None: not computed; no agreement without a determined fit); ``step_part``: the step loop's
    phases' part of the split energy."""
    out = []
    if additivity is None:
        out.append("the additivity residual could not be formed (no price for the host time)")
    elif abs(additivity) > rule.additivity:
        out.append(f"additivity residual {additivity:+.1%} beyond {rule.additivity:.0%}")
    if agreement is not None and agreement[1] > rule.agreement + agreement[2]:
        phase, diff, allowance = agreement
        out.append(f"loops and fit disagree on {phase} by {diff:.3f} of a share, beyond {rule.agreement:.3f} + the "
                   f"fit's 2 s.e. {allowance:.3f}")
    if not has_step:
        out.append("no loop of the whole step: the interaction check cannot run")
    elif interaction is None:
        out.append("the step loop cannot be predicted (a phase without an isolated loop, or no phase times)")
    elif abs(interaction) * step_part > rule.interaction:
        out.append(f"interaction residual {interaction:+.1%} of a step that is {step_part:.0%} of the split moves up "
                   f"to {100 * abs(interaction) * step_part:.1f} points of share, beyond {100 * rule.interaction:g}: "
                   f"the phases change each other's power inside the step")
    return out


def total_reason(span_s: float | None, period_s: float | None, rule: GateRule = GATE) -> str | None:
    """Why a counter's total over a run of ``span_s`` seconds cannot be trusted, or None: read at the
    run's bounds, it is off by up to a period at each end, so the run must span the gate's floor."""
    if span_s is None or not period_s:
        return None
    floor = rule.floor_s(period_s)
    if span_s >= floor:
        return None
    return (f"the counter spans {span_s:.3g} s = {span_s / period_s:.3g} periods over the run, under max("
            f"{rule.min_periods} periods, {rule.min_s:g} s) = {floor:.3g} s: its total is off by up to a period "
            f"at each end")


def withheld(method: str | None, attribution: Mapping[str, Any] | None) -> str | None:
    """Why an accounting's phase split must not be shown, or None when it may be.

    Args:
        method: its ``phase_energy_method``.
        attribution: its ``attribution`` (with ``split_gate``), None when the energy was read per phase.

    Returns:
        ``"measured-total-only: <reasons>"`` for a split that failed its gate (or had none to
        check), else None.
    """
    if method != "measured-total-only":
        return None
    gate = (attribution or {}).get("split_gate") or {}
    return "measured-total-only: " + "; ".join(gate.get("reasons") or ["no phase loops and no determined fit"])


__all__ = ["GateRule", "GATE", "STEP_LOOP_SPANS", "SplitGate", "loop_reasons", "interaction_residual", "disagreement", "check_reasons",
           "total_reason", "withheld"]
