"""Phase attribution when one step is shorter than the energy counter's period.

NVML's total-energy counter updates every 20-100 ms; a draft or verify phase lasts
milliseconds, so per-phase windows read 0 J or a whole update's worth. Two remedies, both
pure functions here:

(A) **Phase-isolated loops** (:func:`additivity_check`): run each phase alone in a loop for
    >= 10 s, divide the loop's energy by its iterations to get J per step of that phase, and
    check that the per-phase figures add up to the J per step of the combined run.
(B) **Non-negative regression** (:func:`nnls_phase_power`): cut a run into many 1-5 s windows,
    each with a measured energy and per-phase times (from CUDA events); solve
    ``E_w ~= sum_p P_p t_wp`` for per-phase powers ``P_p >= 0`` by non-negative least squares.
    The residual says how well a constant power per phase explains the windows.

:mod:`refspec.energy.accounting.phase_energy` applies both to a ledger run (its counter records' sub-windows,
its loop records) for the accounting.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import nnls


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loop:
    """One metered loop.

    Attributes:
        energy_j: energy of the whole loop in J.
        time_s: duration of the loop in s.
        iterations: steps the loop ran.
        rows: rows each call ran, when the run's calls of this phase differ in rows (a prefill of
            the R rows refilled): a call of R rows is then priced R / ``rows`` loop calls.
        phase_time_s: a loop of the whole step only: the time of each of its phases over the
            loop, s (the rest of ``time_s`` is host time between them).
    """

    energy_j: float
    time_s: float
    iterations: int
    rows: int | None = None
    phase_time_s: Mapping[str, float] | None = None

    @property
    def power_w(self) -> float:
        """Mean power over the loop, W."""
        return self.energy_j / self.time_s

    @property
    def j_per_step(self) -> float:
        """Energy per iteration in J."""
        return self.energy_j / self.iterations

    @property
    def s_per_step(self) -> float:
        """Time per iteration in s."""
        return self.time_s / self.iterations


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditivityCheck:
    """Result of :func:`additivity_check`.

    Attributes:
        phase_j_per_step: J per step of each phase-isolated loop.
        predicted_j_per_step: their sum.
        combined_j_per_step: J per step of the combined run.
        relative_error: (predicted - combined) / combined, for energy.
        time_relative_error: the same for time per step.
        phase_share: each phase's share of the predicted energy.
        ok: both errors within the tolerance.
        tolerance: the relative tolerance used.
    """

    phase_j_per_step: dict[str, float]
    predicted_j_per_step: float
    combined_j_per_step: float
    relative_error: float
    time_relative_error: float
    phase_share: dict[str, float]
    ok: bool
    tolerance: float


def additivity_check(isolated: Mapping[str, Loop], combined: Loop, *, tolerance: float = 0.05) -> AdditivityCheck:
    """Check that phase-isolated loop energies add up to the combined run's (method A).

    Args:
        isolated: per phase, a loop that ran only that phase (each >= 10 s on an NVML counter).
        combined: the full run (all phases each step).
        tolerance: accepted relative error of energy and time per step.

    Returns:
        The :class:`AdditivityCheck`; ``ok`` False means phases interact (caches, clocks,
        overlap) and isolated figures should not be used as a split.
    """
    if not isolated:
        raise ValueError("additivity_check needs at least one phase-isolated loop")
    per_phase = {p: loop.j_per_step for p, loop in isolated.items()}
    predicted = sum(per_phase.values())
    predicted_t = sum(loop.s_per_step for loop in isolated.values())
    err = (predicted - combined.j_per_step) / combined.j_per_step
    err_t = (predicted_t - combined.s_per_step) / combined.s_per_step
    return AdditivityCheck(
        phase_j_per_step=per_phase, predicted_j_per_step=predicted, combined_j_per_step=combined.j_per_step,
        relative_error=err, time_relative_error=err_t,
        phase_share={p: e / predicted for p, e in per_phase.items()},
        ok=abs(err) <= tolerance and abs(err_t) <= tolerance, tolerance=tolerance)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhasePower:
    """Result of :func:`nnls_phase_power`.

    Attributes:
        power_w: fitted power of each phase, and of the time outside every phase
            (``"unattributed"``: fitted, or the ``host_w`` it was priced at) in W.
        energy_j: power x total time of each phase over all windows, in J.
        share: each phase's share of the fitted energy.
        residual_j: Euclidean norm of the window residuals, J.
        relative_residual: residual norm / norm of the window energies.
        window_residuals_j: measured - fitted energy per window, J.
    """

    power_w: dict[str, float]
    energy_j: dict[str, float]
    share: dict[str, float]
    residual_j: float
    relative_residual: float
    window_residuals_j: tuple[float, ...]


def nnls_phase_power(window_energy_j: Sequence[float], phase_time_s: Sequence[Sequence[float]],
                     phases: Sequence[str], *, window_time_s: Sequence[float] | None = None,
                     host_w: float | None = None) -> PhasePower:
    """Fit per-phase power from window energies and per-phase times (method B).

    Solves ``min ||T P - E||`` subject to ``P >= 0`` with ``T[w, p]`` the time phase ``p`` ran
    in window ``w`` (e.g. summed CUDA-event times) and ``E[w]`` the window's counter energy.

    Args:
        window_energy_j: energy of each window, J, shape [W].
        phase_time_s: time of each phase in each window, s, shape [W, P].
        phases: phase names, length P.
        window_time_s: full duration of each window, s, shape [W]; when given, the time not
            covered by any phase becomes an extra ``"unattributed"`` column (idle gaps, host
            overhead) so it does not inflate the phase powers.
        host_w: with ``window_time_s``, price that time at this power (W, e.g. the measured idle
            power) instead of fitting it: its energy is taken off each window first. Use it when
            a phase lasts about as long as the host time every step (commit), which a fit cannot
            tell apart.

    Returns:
        The :class:`PhasePower` fit.

    Raises:
        ValueError: mismatched shapes or fewer windows than unknowns.
    """
    e = np.asarray(window_energy_j, dtype=float)  # [W]
    t = np.asarray(phase_time_s, dtype=float)  # [W, P]
    names = list(phases)
    if t.ndim != 2 or t.shape != (e.shape[0], len(names)):
        raise ValueError(f"phase_time_s must have shape [W={e.shape[0]}, P={len(names)}], got {t.shape}")
    host = np.zeros_like(e)  # [W] energy of the host time when it is priced, not fitted
    if window_time_s is not None:
        gap = np.asarray(window_time_s, dtype=float) - t.sum(axis=1)
        if gap.shape != e.shape:
            raise ValueError(f"window_time_s must have shape [{e.shape[0]}], got {gap.shape}")
        gap = np.clip(gap, 0.0, None)
        if host_w is None:
            t = np.column_stack([t, gap])
            names.append("unattributed")
        else:
            host = host_w * gap
    if t.shape[0] < t.shape[1]:
        raise ValueError(f"{t.shape[0]} windows cannot determine {t.shape[1]} powers; record more windows")
    power, residual = nnls(t, e - host)
    fitted = t @ power + host
    energy = power * t.sum(axis=0)
    if window_time_s is not None and host_w is not None:
        names.append("unattributed")
        power, energy = np.append(power, host_w), np.append(energy, host.sum())
    total = float(energy.sum())
    return PhasePower(
        power_w={n: float(p) for n, p in zip(names, power)},
        energy_j={n: float(x) for n, x in zip(names, energy)},
        share={n: (float(x) / total if total else 0.0) for n, x in zip(names, energy)},
        residual_j=float(residual),
        relative_residual=float(residual / np.linalg.norm(e)) if np.linalg.norm(e) else 0.0,
        window_residuals_j=tuple(float(x) for x in e - fitted),
    )


__all__ = ["Loop", "AdditivityCheck", "additivity_check", "PhasePower", "nnls_phase_power"]
