"""Headline measures of a run, computed from its ledger records alone.

Nothing else in refspec computes these numbers: reports, sweeps and plots call
:func:`account` on ledger records (:func:`refspec.energy.ledger.read_ledger`). Definitions:

Per step
    Counts (drafted, accepted, emitted, verified, rows_active, emitted_per_row) are taken as the
    maximum over the step's records, so a count may be written on one phase record or repeated
    on several. ``rows_active`` comes from the verify record when there is one. A step's time is
    the sum of its records' times (phases do not overlap).

Only accepted tokens count
    J per output token = total energy (all phases, prefill included) / tokens emitted (all
    records, prefill's first token included). Rejected drafts earn nothing.

J per verified token
    verify-phase energy / verified positions: what one target position costs.

Energy on rejected drafts
    A chain verify of K drafts computes K + 1 positions per active row; the accepted drafts and
    the position that yields the bonus (or recovered) token are useful, the rest were refuted:
    ``rejected positions = verified - accepted - rows_active`` per step (for a tree the same
    formula counts every off-path node). Verify energy is split in proportion to positions:
    ``verify rejected J = verify J x rejected / verified``, per step, then summed. Likewise
    ``draft rejected J = draft J x (drafted - accepted) / drafted``: the share of draft energy
    spent proposing tokens that were not accepted. Tokens cut by EOS or a budget after
    acceptance are not counted as rejected (they appear as accepted + rows_active - emitted).

Line items and closure
    prefill, draft (kept), draft (rejected), verify (useful), verify (rejected), commit and
    other must sum to the total energy; ``closes`` says whether they do within 1e-9 relative.

Gross and net of idle
    net = gross - idle W x time, for the run and per phase. Idle power is passed in or read from
    the run header (measured on a GPU, the profile's value when modelled).

Throughput, TPOT and tau
    tokens/s = emitted / total time. TPOT of a row = (sum of the times of decode steps 0 ...
    the row's last emitting step) / (tokens the row emitted - 1): the first token comes from
    prefill and its latency is TTFT, not TPOT. Rows that emitted fewer than two tokens have no
    TPOT. p50 / p99 are linear-interpolated percentiles across rows. tau (acceptance length) =
    (accepted + bonus) / row-steps = (sum accepted + sum rows_active) / sum rows_active over
    steps with a verify, i.e. the mean of accepted + 1 per active row per step.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

LINE_ITEMS = ("prefill", "draft_kept", "draft_rejected", "verify_useful", "verify_rejected", "commit", "other")
CLOSURE_RTOL = 1e-9


class AccountingError(ValueError):
    """Ledger records that cannot be accounted as asked."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accounting:
    """Headline measures of one run (see the module docstring for every definition).

    Energies are in J, powers in W, times in s. Energy fields are None when the ledger holds
    no energy (time-only meter); net fields are None without an idle power.
    """

    run_id: str | None
    labels: dict[str, Any]
    sources: tuple[str, ...]
    measured: bool
    batch: int
    steps: int
    rows_with_tpot: int
    emitted: int
    drafted: int
    accepted: int
    verified: int
    rejected_positions: int
    row_steps: int
    total_time_s: float
    prefill_time_s: float
    decode_time_s: float
    phase_time_s: dict[str, float]
    tokens_per_s: float | None
    tau: float | None
    acceptance_rate: float | None
    tpot_per_row_s: tuple[float | None, ...]
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    total_energy_j: float | None
    j_per_token: float | None
    j_per_verified_token: float | None
    phase_energy_j: dict[str, float] | None
    phase_share: dict[str, float] | None
    line_items_j: dict[str, float] | None
    rejected_energy_j: float | None
    rejected_share: float | None
    verify_rejected_j: float | None
    draft_rejected_j: float | None
    draft_rejected_share: float | None
    closure_error_j: float | None
    closes: bool | None
    idle_w: float | None
    net_energy_j: float | None
    net_j_per_token: float | None
    net_phase_energy_j: dict[str, float] | None


def _select_run(records: Sequence[Mapping[str, Any]], run_id: str | None) -> tuple[str | None, dict[str, Any] | None,
                                                                                    list[Mapping[str, Any]]]:
    ids = list(dict.fromkeys(r.get("run_id") for r in records))
    if run_id is None:
        if len(ids) > 1:
            raise AccountingError(f"the records hold {len(ids)} runs {ids}; pass run_id= to pick one")
        run_id = ids[0] if ids else None
    header = next((dict(r) for r in records if r.get("kind") == "run" and r.get("run_id") == run_id), None)
    phases = [r for r in records if r.get("kind", "phase") == "phase" and r.get("run_id") == run_id]
    if not phases:
        raise AccountingError(f"no phase records for run {run_id!r}")
    return run_id, header, phases


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def account(records: Iterable[Mapping[str, Any]], *, run_id: str | None = None,
            idle_w: float | None = None) -> Accounting:
    """Compute the :class:`Accounting` of one run from its ledger records.

    Args:
        records: ledger records (run header and phase records), e.g. from ``read_ledger``.
        run_id: the run to account when the records hold several.
        idle_w: idle power in W; default: the run header's ``idle_w``.

    Returns:
        The run's :class:`Accounting`.

    Raises:
        AccountingError: no phase records, or several runs and no ``run_id``.
    """
    run_id, header, phases = _select_run(list(records), run_id)
    if idle_w is None and header is not None:
        idle_w = header.get("idle_w")
    has_energy = all(r.get("energy_j") is not None for r in phases)
    sources = tuple(sorted({str(r["source"]) for r in phases}))
    batch = max(int(r["batch"]) for r in phases)

    # 1. group by step; counts are maxima over a step's records, times and energies sums
    by_step: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in phases:
        by_step[int(r["step"])].append(r)
    phase_time: dict[str, float] = defaultdict(float)
    phase_energy: dict[str, float] = defaultdict(float)
    items = dict.fromkeys(LINE_ITEMS, 0.0)
    totals = dict.fromkeys(("emitted", "drafted", "accepted", "verified", "rejected", "row_steps"), 0)
    step_time: dict[int, float] = {}
    per_row_steps: dict[int, list[int]] = {}
    for step, recs in by_step.items():
        count = {f: max(int(r.get(f, 0) or 0) for r in recs) for f in ("drafted", "accepted", "emitted", "verified")}
        verify_recs = [r for r in recs if r["phase"] == "verify"]
        rows_active = max(int(r["rows_active"]) for r in (verify_recs or recs))
        rows = [list(r.get("emitted_per_row") or ()) for r in recs]
        width = max((len(x) for x in rows), default=0)
        per_row_steps[step] = [max((x[i] for x in rows if i < len(x)), default=0) for i in range(width)]
        step_time[step] = sum(float(r["time_s"]) for r in recs)
        for f in ("drafted", "accepted", "emitted", "verified"):
            totals[f] += count[f]
        rejected = max(count["verified"] - count["accepted"] - rows_active, 0) if count["verified"] else 0
        if verify_recs or count["verified"]:
            totals["row_steps"] += rows_active
        totals["rejected"] += rejected
        for r in recs:
            phase_time[r["phase"]] += float(r["time_s"])
            if not has_energy:
                continue
            e = float(r["energy_j"])
            phase_energy[r["phase"]] += e
            if r["phase"] == "verify":
                bad = e * rejected / count["verified"] if count["verified"] else 0.0
                items["verify_rejected"] += bad
                items["verify_useful"] += e - bad
            elif r["phase"] == "draft":
                bad = e * max(count["drafted"] - count["accepted"], 0) / count["drafted"] if count["drafted"] else 0.0
                items["draft_rejected"] += bad
                items["draft_kept"] += e - bad
            elif r["phase"] in ("prefill", "commit"):
                items[r["phase"]] += e
            else:
                items["other"] += e

    # 2. times, throughput, TPOT per row, tau
    total_time = sum(step_time.values())
    prefill_time = sum(t for s, t in step_time.items() if s < 0)
    decode_steps = sorted(s for s in step_time if s >= 0)
    tpots: list[float | None] = []
    for row in range(max((len(v) for v in per_row_steps.values()), default=0)):
        counts = {s: (v[row] if row < len(v) else 0) for s, v in per_row_steps.items()}
        emitting = [s for s in decode_steps if counts.get(s, 0) > 0]
        n = sum(counts.values())
        if n < 2 or not emitting:
            tpots.append(None)
            continue
        tpots.append(sum(step_time[s] for s in decode_steps if s <= emitting[-1]) / (n - 1))
    valid = [t for t in tpots if t is not None]
    emitted = totals["emitted"]
    tau = (totals["accepted"] + totals["row_steps"]) / totals["row_steps"] if totals["row_steps"] else None

    # 3. energy: totals, shares, per token, rejected, closure, net of idle
    energy: dict[str, Any] = dict.fromkeys(
        ("total_energy_j", "j_per_token", "j_per_verified_token", "phase_energy_j", "phase_share", "line_items_j",
         "rejected_energy_j", "rejected_share", "verify_rejected_j", "draft_rejected_j", "draft_rejected_share",
         "closure_error_j", "closes", "net_energy_j", "net_j_per_token", "net_phase_energy_j"))
    if has_energy:
        total = sum(float(r["energy_j"]) for r in phases)
        rejected_j = items["verify_rejected"] + items["draft_rejected"]
        draft_j = phase_energy.get("draft", 0.0)
        closure = sum(items.values()) - total
        energy.update(
            total_energy_j=total,
            j_per_token=total / emitted if emitted else None,
            j_per_verified_token=phase_energy.get("verify", 0.0) / totals["verified"] if totals["verified"] else None,
            phase_energy_j=dict(phase_energy),
            phase_share={p: (e / total if total else math.nan) for p, e in phase_energy.items()},
            line_items_j=items,
            rejected_energy_j=rejected_j,
            rejected_share=rejected_j / total if total else None,
            verify_rejected_j=items["verify_rejected"],
            draft_rejected_j=items["draft_rejected"],
            draft_rejected_share=items["draft_rejected"] / draft_j if draft_j else None,
            closure_error_j=closure,
            closes=abs(closure) <= CLOSURE_RTOL * max(1.0, abs(total)),
        )
        if idle_w is not None:
            net = total - idle_w * total_time
            energy.update(net_energy_j=net, net_j_per_token=net / emitted if emitted else None,
                          net_phase_energy_j={p: e - idle_w * phase_time[p] for p, e in phase_energy.items()})
    return Accounting(
        run_id=run_id, labels=dict((header or {}).get("labels") or {}), sources=sources,
        measured=all(s.startswith("measured") for s in sources), batch=batch, steps=len(decode_steps),
        rows_with_tpot=len(valid), emitted=emitted, drafted=totals["drafted"], accepted=totals["accepted"],
        verified=totals["verified"], rejected_positions=totals["rejected"], row_steps=totals["row_steps"],
        total_time_s=total_time, prefill_time_s=prefill_time, decode_time_s=total_time - prefill_time,
        phase_time_s=dict(phase_time), tokens_per_s=emitted / total_time if total_time else None, tau=tau,
        acceptance_rate=totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        tpot_per_row_s=tuple(tpots), tpot_p50_s=_percentile(valid, 50), tpot_p99_s=_percentile(valid, 99),
        idle_w=idle_w, **energy)


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x * scale, spec)


def format_accounting(acc: Accounting) -> str:
    """A small text report: sources, tokens, per-token figures, phases, line items, closure."""
    kind = ("measured" if acc.measured else
            "modelled" if all(s.startswith("modelled") for s in acc.sources) else "mixed/none")
    lines = [f"run {acc.run_id}" + (f"  labels {acc.labels}" if acc.labels else ""),
             f"energy source ({kind}): {', '.join(acc.sources)}",
             f"batch {acc.batch}, decode steps {acc.steps}, emitted {acc.emitted}, drafted {acc.drafted}, "
             f"accepted {acc.accepted}, verified {acc.verified}, rejected positions {acc.rejected_positions}",
             f"tau {_fmt(acc.tau, '.3f')}  acceptance {_fmt(acc.acceptance_rate, '.3f')}  "
             f"tokens/s {_fmt(acc.tokens_per_s, '.2f')}  TPOT p50 {_fmt(acc.tpot_p50_s, '.3f', 1e3)} ms  "
             f"p99 {_fmt(acc.tpot_p99_s, '.3f', 1e3)} ms ({acc.rows_with_tpot} rows)",
             f"time {acc.total_time_s:.6g} s (prefill {acc.prefill_time_s:.6g} s, decode {acc.decode_time_s:.6g} s)"]
    if acc.total_energy_j is None or acc.phase_energy_j is None or acc.phase_share is None \
            or acc.line_items_j is None:
        lines.append("energy: none recorded (time-only meter)")
        return "\n".join(lines)
    net = acc.net_energy_j is not None and acc.net_phase_energy_j is not None
    if net:
        lines.append(f"energy {acc.total_energy_j:.6g} J gross, {acc.net_energy_j:.6g} J net of idle {acc.idle_w:g} W")
        lines.append(f"J/token {_fmt(acc.j_per_token, '.6g')} gross, {_fmt(acc.net_j_per_token, '.6g')} net; "
                     f"J/verified position {_fmt(acc.j_per_verified_token, '.6g')}")
    else:
        lines.append(f"energy {acc.total_energy_j:.6g} J gross, net n/a (no idle power)")
        lines.append(f"J/token {_fmt(acc.j_per_token, '.6g')} gross; "
                     f"J/verified position {_fmt(acc.j_per_verified_token, '.6g')}")
    lines.append(f"{'phase':<10}{'time s':>12}{'energy J':>14}{'share':>9}" + (f"{'net J':>14}" if net else ""))
    for p, e in acc.phase_energy_j.items():
        row = f"{p:<10}{acc.phase_time_s[p]:>12.6g}{e:>14.6g}{100 * acc.phase_share[p]:>8.1f}%"
        if net and acc.net_phase_energy_j is not None:
            row += f"{acc.net_phase_energy_j[p]:>14.6g}"
        lines.append(row)
    lines.append("line items (J): " + ", ".join(f"{k} {v:.6g}" for k, v in acc.line_items_j.items()))
    lines.append(f"rejected drafts: {acc.rejected_energy_j:.6g} J ({_fmt(acc.rejected_share, '.1f', 100)}% of total; "
                 f"verify {acc.verify_rejected_j:.6g} J, draft {acc.draft_rejected_j:.6g} J = "
                 f"{_fmt(acc.draft_rejected_share, '.1f', 100)}% of draft energy)")
    lines.append(f"closure: line items sum to the total within {acc.closure_error_j:.3g} J -> "
                 + ("OK" if acc.closes else "FAILED"))
    return "\n".join(lines)


__all__ = ["Accounting", "AccountingError", "account", "format_accounting", "LINE_ITEMS"]
