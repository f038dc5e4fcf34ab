"""Choosing an operating point under a latency target, and what a tighter target costs.

Input: sweep records, one per configuration, each a mapping with at least ``batch``,
``drafter``, ``k``, ``tpot_p99_s`` (p99 time per output token per user, s) and
``energy_per_token_j`` (J per output token). Extra keys (e.g. ``source``, ``clock_mhz``) ride
along. A configuration meets a target T when its p99 TPOT <= T; among those the lowest J per
token wins (ties: the larger batch, then the smaller k, so the simpler configuration is kept).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

REQUIRED = ("batch", "drafter", "k", "tpot_p99_s", "energy_per_token_j")

Record = Mapping[str, Any]


def _check(records: Iterable[Record]) -> list[Record]:
    out = list(records)
    for i, r in enumerate(out):
        missing = [f for f in REQUIRED if f not in r]
        if missing:
            raise ValueError(f"sweep record {i} lacks {missing}; each needs {list(REQUIRED)}")
    return out


def _order(r: Record) -> tuple[float, int, int]:
    return (float(r["energy_per_token_j"]), -int(r["batch"]), int(r["k"]))


def choose_config(records: Iterable[Record], tpot_target_s: float) -> Record | None:
    """Lowest-energy configuration whose p99 TPOT meets ``tpot_target_s``.

    Args:
        records: sweep records (see the module docstring).
        tpot_target_s: p99 TPOT target in s.

    Returns:
        The chosen record, or None when no configuration meets the target.
    """
    feasible = [r for r in _check(records) if float(r["tpot_p99_s"]) <= tpot_target_s]
    return min(feasible, key=_order) if feasible else None


def cost_of_tighter_target(records: Iterable[Record], targets: Sequence[float]) -> list[dict[str, Any]]:
    """For each target, the best configuration, its energy, and the premium over the loosest.

    Args:
        records: sweep records.
        targets: p99 TPOT targets in s (any order; rows come out loosest first).

    Returns:
        One row per target with keys ``target_s``, ``feasible``, ``batch``, ``drafter``, ``k``,
        ``tpot_p99_s``, ``energy_per_token_j``, ``extra_vs_loosest`` (J/token relative to the
        loosest feasible target's choice, minus 1), ``plain_energy_per_token_j`` (best k = 0
        configuration meeting the target, or None) and ``speculation_premium`` (chosen /
        plain - 1 when both exist; negative means speculation saves energy at this target).
    """
    recs = _check(records)
    plain = [r for r in recs if int(r["k"]) == 0]
    rows: list[dict[str, Any]] = []
    loosest: float | None = None
    for target in sorted(targets, reverse=True):
        best = choose_config(recs, target)
        best_plain = choose_config(plain, target) if plain else None
        row: dict[str, Any] = dict(target_s=target, feasible=best is not None, batch=None, drafter=None, k=None,
                                   tpot_p99_s=None, energy_per_token_j=None, extra_vs_loosest=None,
                                   plain_energy_per_token_j=None if best_plain is None
                                   else float(best_plain["energy_per_token_j"]),
                                   speculation_premium=None)
        if best is not None:
            e = float(best["energy_per_token_j"])
            loosest = e if loosest is None else loosest
            row.update(batch=best["batch"], drafter=best["drafter"], k=best["k"], tpot_p99_s=float(best["tpot_p99_s"]),
                       energy_per_token_j=e, extra_vs_loosest=e / loosest - 1.0)
            if row["plain_energy_per_token_j"]:
                row["speculation_premium"] = e / row["plain_energy_per_token_j"] - 1.0
        rows.append(row)
    return rows


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
    return "\n".join(lines)


__all__ = ["choose_config", "cost_of_tighter_target", "format_targets", "REQUIRED"]
