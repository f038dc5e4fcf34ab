"""The fit over several mixes, checking the loops where one mix alone cannot.

In a steady state at one K and one batch every step drafts, verifies and commits once, so a fit
of one power per phase over the run's sub-windows is undetermined (:mod:`refspec.energy.accounting.phase_energy`),
and a shift of power from one phase to another that leaves the total unchanged passes every
check the loops have (:mod:`refspec.energy.accounting.split_gate`). Runs of other mixes (another K, another
batch) change the phases' proportions: one fit over the sub-windows of all of them is determined
where each phase draws about the same power in each, and its shares of each mix are then a
second estimate to hold each mix's loops against. A step drafts, verifies and commits once in
every mix, so each steady mix adds one direction of those three phases' times: it takes three
mixes (the refills vary the prefill's) to fit their three powers; fewer are reported undetermined.

The check passes when the fit is determined and, in every mix, each phase's share by the loops
lies within ``agreement`` (plus twice the fitted share's standard error) of its share by the
fit. A phase whose power differs between the mixes (a verify of more positions) makes the fit's
residual, hence its standard errors, grow: the check then widens or, past the fit's own limits,
reports the fit undetermined rather than passing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from refspec.energy.accounting.phase_energy import phase_energy, shares
from refspec.energy.accounting.split_gate import GATE, GateRule, disagreement

Run = tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class MixCheck:
    """The fit over several mixes against each mix's loops.

    Attributes:
        fit_determined: the pooled fit passed its own limits.
        fit_power_w: the pooled fit's power per phase (and host), W; None without a fit.
        share_fit: per mix, each phase's share by the fit's powers and the mix's own phase times.
        share_loops: per mix, each phase's share by its loops (None for a mix without loops).
        worst: per mix with loops, ``(phase, difference, allowance)`` of its largest disagreement.
        passed: the fit is determined and every mix's loops agree with it.
        reasons: why not.
    """

    fit_determined: bool
    fit_power_w: dict[str, float] | None
    share_fit: dict[str, dict[str, float]]
    share_loops: dict[str, dict[str, float] | None]
    worst: dict[str, tuple[str, float, float]]
    passed: bool
    reasons: tuple[str, ...]


def mix_check(mixes: Mapping[str, Sequence[Run]], *, host_w: float | None, rule: GateRule = GATE) -> MixCheck:
    """One fit over every mix's sub-windows, held against each mix's loops.

    Args:
        mixes: per mix name, its runs ``(phase records, counter records, loop records)``.
        host_w: the host time's power (the idle power), W.
        rule: the gate (floors and the agreement tolerance).
    """
    without_loops = [(p, c, ()) for runs in mixes.values() for p, c, _ in runs]
    pooled = phase_energy(without_loops, host_w=host_w, rule=rule)
    fit = pooled.fit
    share_fit: dict[str, dict[str, float]] = {}
    share_loops: dict[str, dict[str, float] | None] = {}
    worst: dict[str, tuple[str, float, float]] = {}
    reasons = [] if pooled.fit_determined else ["the fit over the mixes is undetermined: " +
                                                "; ".join(pooled.split_gate.reasons if pooled.split_gate else ())]
    for name, runs in mixes.items():
        own = phase_energy(list(runs), host_w=host_w, rule=rule)
        share_loops[name] = own.share_loops
        if fit is None:
            continue
        phase_s: dict[str, float] = {}
        for records, _, _ in runs:
            for r in records:
                phase_s[str(r["phase"])] = phase_s.get(str(r["phase"]), 0.0) + float(r["time_s"])
        share_fit[name] = shares({p: fit.power_w.get(p, 0.0) * t for p, t in phase_s.items() if t > 0})
        if own.share_loops is not None:
            worst[name] = disagreement(own.share_loops, share_fit[name], pooled.fit_share_se or {})
            phase, diff, allowance = worst[name]
            if diff > rule.agreement + allowance:
                reasons.append(f"{name}: loops and the mixes' fit disagree on {phase} by {diff:.3f} of a share, "
                               f"beyond {rule.agreement:.3f} + 2 s.e. {allowance:.3f}")
        else:
            reasons.append(f"{name}: no loops to check")
    return MixCheck(fit_determined=pooled.fit_determined, fit_power_w=dict(fit.power_w) if fit else None,
                    share_fit=share_fit, share_loops=share_loops, worst=worst, passed=not reasons,
                    reasons=tuple(reasons))


__all__ = ["MixCheck", "mix_check"]
