"""Choosing an operating point under latency targets, and what a tighter target costs.

Input: sweep records, one per configuration, each a mapping with at least ``batch``,
``drafter``, ``k``, ``tpot_p99_s`` (p99 time per output token per user, s) and
``energy_per_token_j`` (J per output token; in a serving record the steady-state window's,
:mod:`refspec.energy.accounting.serving_window`), plus ``ttft_p99_s`` (p99 time to first token, s) when a
TTFT target is given. Extra keys ride along. A configuration meets the targets when each given
p99 is <= its target; among those the lowest J per token wins (ties: the larger batch, then the
smaller k, so the simpler configuration is kept). Callers that rank by another J/token figure of
a record pass it as ``energy`` (a function of the record). Every ratio comes from
:func:`refspec.energy.accounting.headline.energy_saving`; nothing here divides energies itself.

A record whose steady-state window is invalid (``window_valid`` false: too short or too empty
to trust, :func:`refspec.energy.accounting.serving_window.window_validity`; its ``window_invalid_reason``
says why) is never ranked: it cannot be chosen, and :func:`excluded_invalid` names those that
would have met the targets so a report can say so. A record without ``window_valid`` is ranked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

from refspec.energy.accounting.headline import energy_saving

REQUIRED = ("batch", "drafter", "k", "tpot_p99_s", "energy_per_token_j")

Record = Mapping[str, Any]
Energy = Callable[[Record], Any]


def _energy_field(r: Record) -> Any:
    return r.get("energy_per_token_j")


@dataclasses.dataclass(frozen=True)
class Targets:
    """p99 latency targets in s; None means no target on that figure."""

    tpot_p99_s: float | None = None
    ttft_p99_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in self.given().items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"latency target {name} must be a finite number of seconds > 0, got {value!r}")

    def given(self) -> dict[str, float]:
        """The targets that are set, record field -> seconds."""
        return {k: v for k, v in (("tpot_p99_s", self.tpot_p99_s), ("ttft_p99_s", self.ttft_p99_s)) if v is not None}

    def text(self) -> str:
        """``p99 TPOT <= 50 ms, p99 TTFT <= 1000 ms``."""
        names = {"tpot_p99_s": "p99 TPOT", "ttft_p99_s": "p99 TTFT"}
        return ", ".join(f"{names[k]} <= {1e3 * v:g} ms" for k, v in self.given().items()) or "no target"


def _finite(v: Any) -> float | None:
    return None if v is None or not math.isfinite(float(v)) else float(v)


def _check(records: Iterable[Record], targets: Targets | None = None) -> list[Record]:
    out = list(records)
    need = REQUIRED + tuple(f for f in (targets.given() if targets else {}) if f not in REQUIRED)
    for i, r in enumerate(out):
        missing = [f for f in need if f not in r]
        if missing:
            raise ValueError(f"sweep record {i} lacks {missing}; each needs {list(need)}")
    return out


def misses(r: Record, targets: Targets) -> dict[str, float | None]:
    """Per given target, by how much ``r`` misses it (s over the target; 0.0 when met; None: no figure)."""
    out: dict[str, float | None] = {}
    for field, target in targets.given().items():
        v = _finite(r.get(field))
        out[field] = None if v is None else max(0.0, v - target)
    return out


def valid_window(r: Record) -> bool:
    """Whether ``r`` may be ranked: its window is not marked invalid."""
    return r.get("window_valid") is not False


def meets(r: Record, targets: Targets, energy: Energy = _energy_field) -> bool:
    """Every given target met by a figure the record has (a missing or NaN figure does not meet it)."""
    return all(m == 0.0 for m in misses(r, targets).values()) and _finite(energy(r)) is not None


def choose(records: Iterable[Record], targets: Targets, energy: Energy = _energy_field) -> Record | None:
    """Lowest-energy configuration with a valid window meeting every target of ``targets``, or None."""
    feasible = [r for r in _check(records, targets) if meets(r, targets, energy) and valid_window(r)]
    return min(feasible, key=lambda r: (float(energy(r)), -int(r["batch"]), int(r["k"]))) if feasible else None


def excluded_invalid(records: Iterable[Record], targets: Targets, energy: Energy = _energy_field) -> list[Record]:
    """The records that meet ``targets`` but were not ranked because their window is invalid."""
    return [r for r in _check(records, targets) if meets(r, targets, energy) and not valid_window(r)]


def choose_config(records: Iterable[Record], tpot_target_s: float | None,
                  ttft_target_s: float | None = None, energy: Energy = _energy_field) -> Record | None:
    """Lowest-energy configuration with a valid window whose p99 TPOT (and p99 TTFT, when given) meets the target(s).

    Args:
        records: sweep records (see the module docstring).
        tpot_target_s: p99 TPOT target in s, or None.
        ttft_target_s: p99 TTFT target in s, or None.
        energy: a record's J/token (default: its ``energy_per_token_j``).

    Returns:
        The chosen record, or None when no configuration meets the targets.
    """
    return choose(records, Targets(tpot_target_s, ttft_target_s), energy)


def cost_of_tighter_target(records: Iterable[Record], targets: Sequence[float],
                           ttft_target_s: float | None = None, energy: Energy = _energy_field) -> list[dict[str, Any]]:
    """For each p99 TPOT target (the TTFT target, if any, held), the best configuration and its premiums.

    Args:
        records: sweep records.
        targets: p99 TPOT targets in s (any order; rows come out loosest first).
        ttft_target_s: p99 TTFT target in s every row also meets, or None.
        energy: a record's J/token (default: its ``energy_per_token_j``).

    Returns:
        One row per target with keys ``target_s``, ``feasible``, ``batch``, ``drafter``, ``k``,
        ``tpot_p99_s``, ``energy_per_token_j``, ``extra_vs_loosest`` (J/token relative to the
        loosest feasible target's choice, minus 1), ``plain_energy_per_token_j`` (best k = 0
        configuration meeting the target, or None), ``speculation_premium`` (chosen /
        plain - 1 when both exist; negative means speculation saves energy at this target) and
        ``invalid_excluded`` (configurations meeting the target that were not ranked: their
        window is invalid).
    """
    recs = _check(records, Targets(None, ttft_target_s))
    plain = [r for r in recs if int(r["k"]) == 0]
    rows: list[dict[str, Any]] = []
    loosest: float | None = None
    for target in sorted(targets, reverse=True):
        best = choose_config(recs, target, ttft_target_s, energy)
        best_plain = choose_config(plain, target, ttft_target_s, energy) if plain else None
        row: dict[str, Any] = dict(target_s=target, feasible=best is not None, batch=None, drafter=None, k=None,
                                   tpot_p99_s=None, energy_per_token_j=None, extra_vs_loosest=None,
                                   plain_energy_per_token_j=None if best_plain is None
                                   else float(energy(best_plain)),
                                   speculation_premium=None,
                                   invalid_excluded=len(excluded_invalid(recs, Targets(target, ttft_target_s), energy)))
        if best is not None:
            e = float(energy(best))
            loosest = e if loosest is None else loosest
            row.update(batch=best["batch"], drafter=best["drafter"], k=best["k"], tpot_p99_s=float(best["tpot_p99_s"]),
                       energy_per_token_j=e, extra_vs_loosest=premium(e, loosest))
            row["speculation_premium"] = premium(e, row["plain_energy_per_token_j"])
        rows.append(row)
    return rows


def premium(j_per_token: float, reference: float | None) -> float | None:
    """J/token over the reference's, minus 1: the accounting's saving with its sign turned."""
    saving = energy_saving(j_per_token, reference)
    return None if saving is None else 0.0 - saving  # 0.0 - 0.0 is +0.0, never -0.0


def format_targets(rows: Sequence[Mapping[str, Any]]) -> str:
    """Text table of :func:`cost_of_tighter_target` rows."""
    head = f"{'p99 target ms':>13} {'batch':>6} {'drafter':>12} {'k':>3} {'p99 ms':>8} {'J/token':>10} " \
           f"{'vs loosest':>10} {'plain J/tok':>11} {'spec vs plain':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r["feasible"]:
            lines.append(f"{1e3 * r['target_s']:>13.3f}  infeasible: no configuration meets the target")
            continue
        plain = "n/a" if r["plain_energy_per_token_j"] is None else f"{r['plain_energy_per_token_j']:.4g}"
        prem = "n/a" if r["speculation_premium"] is None else f"{100 * r['speculation_premium']:+.1f}%"
        lines.append(f"{1e3 * r['target_s']:>13.3f} {r['batch']:>6} {str(r['drafter']):>12} {r['k']:>3} "
                     f"{1e3 * r['tpot_p99_s']:>8.3f} {r['energy_per_token_j']:>10.4g} "
                     f"{100 * r['extra_vs_loosest']:>+9.1f}% {plain:>11} {prem:>13}")
    skipped = max((r.get("invalid_excluded") or 0 for r in rows), default=0)
    if skipped:
        lines.append(f"not ranked: up to {skipped} configuration(s) meeting a target whose window is invalid "
                     f"(window_invalid_reason)")
    return "\n".join(lines)


__all__ = ["Targets", "valid_window", "excluded_invalid", "choose", "choose_config", "premium",
           "cost_of_tighter_target", "format_targets", "meets", "misses", "REQUIRED"]
