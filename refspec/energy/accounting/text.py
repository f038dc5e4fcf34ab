"""An :class:`~refspec.energy.accounting.headline.Accounting` in words: the run's text statement and its closure line.

Formatting only: every number printed here was computed by :mod:`refspec.energy.accounting.headline`.
"""
from __future__ import annotations

from typing import Mapping

from refspec.energy.accounting.headline import CLOSURE_RTOL, Accounting


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x * scale, spec)


def format_closure(line_items_j: Mapping[str, float] | None, line_items_sum_j: float | None,
                   total_energy_j: float | None, closure_error_j: float | None, closes: bool | None,
                   method: str | None = None) -> str:
    """The closure line: how the total was split (``method``), the line items (J), their sum, the
    total, and whether they close."""
    if line_items_j is None or line_items_sum_j is None or total_energy_j is None or closure_error_j is None:
        return "closure: n/a (no energy recorded)"
    terms = " + ".join(f"{name.replace('_', ' ')} {e:.6g}" for name, e in line_items_j.items())
    split = f" ({method} split)" if method else ""
    # an error within the closure tolerance is the float sum's rounding: printed as 0
    error_j = 0.0 if abs(closure_error_j) <= CLOSURE_RTOL * max(1.0, abs(total_energy_j)) else closure_error_j
    return (f"closure{split}: {terms} = {line_items_sum_j:.6g} J; total {total_energy_j:.6g} J; "
            f"error {error_j:.3g} J -> {'OK' if closes else 'FAILED: they do not close'}")


def _energy_lines(acc: Accounting) -> list[str]:
    assert acc.total_energy_j is not None and acc.phase_energy_j is not None
    net = acc.net_energy_j is not None and acc.net_phase_energy_j is not None
    if net:
        lines = [f"energy {acc.total_energy_j:.6g} J gross, {acc.net_energy_j:.6g} J net of idle {acc.idle_w:g} W",
                 f"J/token {_fmt(acc.j_per_token, '.6g')} gross, {_fmt(acc.net_j_per_token, '.6g')} net; "
                 f"J/verified position {_fmt(acc.j_per_verified_token, '.6g')}"]
    else:
        lines = [f"energy {acc.total_energy_j:.6g} J gross, net n/a (no idle power)",
                 f"J/token {_fmt(acc.j_per_token, '.6g')} gross; "
                 f"J/verified position {_fmt(acc.j_per_verified_token, '.6g')}"]
    lines.append(f"{'phase':<10}{'time s':>12}{'energy J':>14}{'share':>9}" + (f"{'net J':>14}" if net else ""))
    for p, e in acc.phase_energy_j.items():
        if acc.phase_share is None:  # the split failed its gate: times only, the total stands unsplit
            lines.append(f"{p:<10}{acc.phase_time_s[p]:>12.6g}{'-':>14}{'-':>9}")
            continue
        row = f"{p:<10}{acc.phase_time_s[p]:>12.6g}{e:>14.6g}{100 * acc.phase_share[p]:>8.1f}%"
        if net and acc.net_phase_energy_j is not None:
            row += f"{acc.net_phase_energy_j[p]:>14.6g}"
        lines.append(row)
    lines.append(f"rejected drafts: {acc.rejected_energy_j:.6g} J ({_fmt(acc.rejected_share, '.1f', 100)}% of total; "
                 f"verify {acc.verify_rejected_j:.6g} J, draft {acc.draft_rejected_j:.6g} J = "
                 f"{_fmt(acc.draft_rejected_share, '.1f', 100)}% of draft energy)")
    lines += _attribution_lines(acc)
    lines.append(format_closure(acc.line_items_j, acc.line_items_sum_j, acc.total_energy_j, acc.closure_error_j,
                                acc.closes, acc.phase_energy_method))
    return lines


def _shares(shares: Mapping[str, float] | None) -> str:
    return "n/a" if shares is None else ", ".join(f"{p} {100 * x:.1f}%" for p, x in shares.items())


def _attribution_lines(acc: Accounting) -> list[str]:
    """How the phases' energy was obtained and, when attributed, how well the estimates agree."""
    lines = [f"phase energy: {acc.phase_energy_method}"]
    a = acc.attribution
    if a is not None:
        lines[0] += (f" over {a['sub_windows']} counter sub-windows, {a['measured_j']:.6g} J measured in "
                     f"{a['span_s']:.6g} s, unattributed {a['unattributed_j']:.6g} J")
        se = max((a["fit_share_se"] or {}).values(), default=None)
        lines.append(f"  fit: {_shares(a['fit_share'])}; residual {_fmt(a['fit_relative_residual'], '.1%')}; "
                     f"largest share s.e. {_fmt(se, '.1%')}; condition {_fmt(a['fit_condition'], '.3g')}")
        if a["fit_share"] is not None and not a["fit_determined"]:
            lines.append("  fit undetermined: its split is too uncertain to use (the phases ran in nearly the same "
                         "proportions in every sub-window, or too few sub-windows); run phase-isolated loops")
        if a["loops_share"] is not None:
            lines.append(f"  loops: {_shares(a['loops_share'])}; agreement (largest share difference) "
                         f"{_fmt(a['agreement'], '.3f')}; "
                         f"additivity residual {_fmt(a['additivity_residual'], '+.1%')}; "
                         f"interaction residual {_fmt(a['interaction_residual'], '+.1%')} "
                         f"(up to {_fmt(a.get('interaction_points'), '.1f')} points of share)")
        gate = a["split_gate"] or {}
        lines.append("  split gate: passed" if gate.get("passed") else
                     f"  split gate: FAILED, total only: {'; '.join(gate.get('reasons') or ['no split'])}")
    if acc.phase_share_true is not None:
        err = (a or {}).get("total_error_vs_true")
        lines.append(f"  true (simulated): {_shares(acc.phase_share_true)}; total error {_fmt(err, '+.2%')}")
    if acc.phase_share_naive is not None:
        lines.append(f"  naive per-phase read: {_shares(acc.phase_share_naive)}")
    return lines


def _serving_lines(acc: Accounting) -> list[str]:
    """Active rows, the steady-state window and the per-request latencies."""
    w = acc.window
    lines = [f"mean active rows {acc.mean_active_rows:.3f} of {acc.batch} (time-weighted over decode steps)",
             "window valid" if acc.window_valid else f"window INVALID: {acc.window_invalid_reason}"]
    if w is None or w.empty:
        lines.append(f"window: empty ({w.note if w is not None else 'not computed'}); figures NaN")
    else:
        where = (f"steps {w.first_step}..{w.last_step}" if w.first_step is not None
                 else f"{len(w.bounds)} runs, bounds {[b and [b[0], b[1] - 1] for b in w.bounds]}")
        lines.append(f"window: {where} ({w.steps} decode steps), {w.time_s:.6g} s, {w.tokens:g} tokens, "
                     f"{_fmt(w.energy_j, '.6g')} J{f' (counter, {w.counter_reads} reads)' if w.counter_reads else ''}, "
                     f"J/token {_fmt(w.j_per_token, '.6g')}, mean active rows {w.mean_active_rows:.3f}")
    ms = lambda x: _fmt(x, ".3f", 1e3)  # noqa: E731
    lines.append(f"requests {len(acc.requests)}: TTFT p50 {ms(acc.ttft_p50_s)} ms p99 {ms(acc.ttft_p99_s)} ms; "
                 f"ITL p50 {ms(acc.itl_p50_s)} ms p99 {ms(acc.itl_p99_s)} ms; "
                 f"end-to-end p50 {ms(acc.e2e_p50_s)} ms p99 {ms(acc.e2e_p99_s)} ms")
    return lines


def format_accounting(acc: Accounting) -> str:
    """A small text report: sources, tokens, per-token figures, phases, line items, closure."""
    kind = ("measured" if acc.measured else
            "modelled" if all(s.startswith("modelled") for s in acc.sources) else "mixed/none")
    runs = f"run {acc.run_id}" if acc.run_id is not None else f"runs {', '.join(map(str, acc.run_ids))}"
    lines = [runs + (f"  labels {acc.labels}" if acc.labels else ""),
             f"energy source ({kind}): {', '.join(acc.sources)}",
             f"batch {acc.batch}, decode steps {acc.steps}, emitted {acc.emitted}, drafted {acc.drafted}, "
             f"accepted {acc.accepted}, verified {acc.verified}, rejected positions {acc.rejected_positions}",
             f"tau {_fmt(acc.tau, '.3f')}  acceptance {_fmt(acc.acceptance_rate, '.3f')}  "
             f"tokens/s {_fmt(acc.tokens_per_s, '.2f')}  TPOT p50 {_fmt(acc.tpot_p50_s, '.3f', 1e3)} ms  "
             f"p99 {_fmt(acc.tpot_p99_s, '.3f', 1e3)} ms ({acc.rows_with_tpot} requests)",
             f"time {acc.total_time_s:.6g} s (prefill {acc.prefill_time_s:.6g} s, decode {acc.decode_time_s:.6g} s)",
             *_serving_lines(acc)]
    if acc.total_energy_j is None:
        return "\n".join(lines + ["energy: none recorded (time-only meter)"])
    return "\n".join(lines + _energy_lines(acc))


__all__ = ["format_accounting", "format_closure"]
