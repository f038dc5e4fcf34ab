"""Reports of run records: the CLI's text table and ``report.md`` with its plots.

Input: :class:`~refspec.eval.record.RunRecord` s from ``records.jsonl`` and any Slurm task
files (:func:`refspec.eval.record_files.read_records`), their comparisons attached
(:func:`refspec.eval.baseline.attach_baselines`). Every figure printed is a record's, computed
by :mod:`refspec.energy.accounting`; the report formats, never recomputes. It states where the
energy came from (measured by which counter, or modelled by which roofline profile), labels
every injected-acceptance run, and prints each configuration's closure line: its energy line
items, their sum, the total, and whether they close. The parts: :mod:`.report_text` (names,
cells, which J/token), :mod:`.report_serving` (window beside run, latency targets, the greedy
audit), :mod:`.report_requests` (per request), :mod:`.policy_report` (speculation policies)
and :mod:`.plots`.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from refspec.energy.accounting.text import format_closure
from refspec.energy.accounting.latency import Targets
from refspec.energy.accounting.split_gate import withheld
from refspec.eval.load import WHAT_TO_DO
from refspec.eval.outputs import REPORT, write_atomic
from refspec.eval.plots import write_plots
from refspec.eval.policy_report import policy_section
from refspec.eval.record import RunRecord
from refspec.eval.report_requests import closure_md as request_closure_md, request_plots, requests_md
from refspec.eval.report_serving import (audit_md, greedy_text, invalid_notes, old_records_note, run_cell,
                                         serving_line, static_note, target_choices, targets_md, window_cell, windows_md)
from refspec.eval.report_text import (budgets_text, config_label, corpora, energy_sources, fmt, injection_lines,
                                      phases_text, refills_text, requests_text, sampling_text, setting, sort_key,
                                      ttft_text, verdict, vs_baseline_text)

log = logging.getLogger(__name__)

_NOTE = ("J/token counts every phase (prefill included) over emitted tokens: only accepted tokens count. window: the "
         "steady state (every slot busy, the stream still refilling); run: every phase of the run, ramp-up and drain "
         "included; rows: mean active rows; refills: median/max rows per refill prefill.")


def _corpus_line(corpus: str, rows: Sequence[RunRecord]) -> str:
    return (f"corpus {corpus}: model {setting(rows, lambda r: r.model)}, {setting(rows, lambda r: r.dtype)} on "
            f"{setting(rows, lambda r: r.device)}, {setting(rows, lambda r: r.stream.requests_unique)} prompts "
            f"({requests_text(rows)}), {budgets_text(rows)}, {sampling_text(rows)}")


def _table_row(r: RunRecord) -> str:
    return (f"{config_label(r):<26}{fmt(r.counts.tau, '.3f'):>6}{fmt(r.run.tokens_per_s, '.2f'):>9}"
            f"{fmt(r.run.mean_active_rows, '.1f'):>6}{refills_text(r):>9}{ttft_text(r):>16}"
            f"{fmt(r.latency.tpot_p99_s, '.1f', 1e3):>12}{window_cell(r):>13}{run_cell(r):>11}  "
            f"{phases_text(r):<30}{greedy_text(r):<26}{vs_baseline_text(r)}")


def format_table(records: Sequence[RunRecord]) -> str:
    """One fixed-width table of the records, grouped by corpus, with the energy source stated."""
    head = (f"{'configuration':<26}{'tau':>6}{'tok/s':>9}{'rows':>6}{'refills':>9}{'TTFT p50/99 ms':>16}"
            f"{'TPOT p99 ms':>12}{'J/tok window':>13}{'J/tok run':>11}  {'prefill/draft/verify/commit %':<30}"
            f"{'greedy = baseline':<26}vs baseline")
    lines = [f"!! {line}" for line in injection_lines(records)]
    by_corpus: dict[str, list[RunRecord]] = defaultdict(list)
    for r in sorted(records, key=sort_key):
        by_corpus[r.corpus].append(r)
    for corpus, rows in by_corpus.items():
        lines += [_corpus_line(corpus, rows), f"  {serving_line(rows)}", head, "-" * len(head)]
        lines += [_table_row(r) for r in rows]
        lines += [f"!! {config_label(r)}: {r.comparison.prefill_warning}" for r in rows if r.comparison.prefill_warning]
        lines += invalid_notes(rows, config_label) + [""]
    lines.append("J/token source: " + "; ".join(energy_sources(records)))
    if any(not r.energy.energy_measured for r in records) and any(r.run.j_per_token is not None for r in records):
        lines.append("  (modelled figures are estimates from the analytic model, not measurements)")
    if any(r.time_source == "modelled" for r in records):
        lines.append("  time, tokens/s and TPOT are MODELLED by the roofline meter, not measured")
    lines.append(_NOTE)
    lines += [f"note: {note}" for note in (static_note(records), old_records_note(records)) if note]
    lines += [f"verdict: {v}" for r in sorted(records, key=sort_key) if (v := verdict(r))]
    if any(r.comparison.verdict_reliable is False for r in records):
        lines.append(WHAT_TO_DO)
    return "\n".join(lines)


# ---- Markdown -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """What :func:`write_report` wrote."""

    markdown: Path
    plots: list[Path]


def _md_row(r: RunRecord) -> str:
    pred = (r.roofline or {}).get("j_per_token")
    cells = [config_label(r), fmt(r.counts.tau, ".3f"), fmt(r.run.tokens_per_s, ".2f"),
             fmt(r.run.mean_active_rows, ".1f"), refills_text(r), fmt(r.work.prefill_positions_per_token, ".2f"),
             *(fmt(x, ".1f", 1e3) for x in (r.latency.ttft_p50_s, r.latency.ttft_p99_s, r.latency.tpot_p50_s,
                                            r.latency.tpot_p99_s)),
             window_cell(r), run_cell(r), fmt(pred, ".4g"), phases_text(r), greedy_text(r),
             vs_baseline_text(r)]
    return "| " + " | ".join(cells) + " |"


def _md_table(records: Sequence[RunRecord]) -> list[str]:
    lines = ["| configuration | tau | tokens/s | mean active rows | refill rows p50/max | prefill positions per "
             "prompt token | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | J/token window | J/token run | "
             "roofline J/token | prefill/draft/verify/commit % | greedy = baseline | vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    lines += [_md_row(r) for r in records]
    notes = invalid_notes(records, config_label)
    return lines + ([""] + notes if notes else [])


def _split_text(r: RunRecord) -> str:
    """How the phase split was obtained, with the attribution's agreement and residuals; a split that
    failed its gate says so with the reasons and shows no shares."""
    e = r.energy
    method, a = e.phase_energy_method, e.attribution or {}
    reason = withheld(method, e.attribution)
    if reason is not None:
        return f"phase split withheld, {reason}"
    if not method or not method.startswith("attributed"):
        return f"phase split: {method or 'none'}"
    parts = [f"phase split: {method} (split gate passed)"]
    if a.get("agreement") is not None:
        parts.append(f"loops vs fit agree within {100 * a['agreement']:.1f} points")
    if a.get("additivity_residual") is not None:
        parts.append(f"additivity residual {100 * a['additivity_residual']:+.1f}%")
    if a.get("interaction_residual") is not None:
        points = a.get("interaction_points")
        parts.append(f"interaction residual {100 * a['interaction_residual']:+.1f}%"
                     + (f" (up to {points:.1f} points of share)" if points is not None else ""))
    if e.phase_share_true and e.phase_share:
        err = max(abs(e.phase_share[p] - t) for p, t in e.phase_share_true.items() if p in e.phase_share)
        parts.append(f"largest error against the simulated truth {100 * err:.1f} points")
    return "; ".join(parts)


def _closure_md(records: Sequence[RunRecord]) -> list[str]:
    """Each configuration's closure line, as the accounting formats it."""
    lines = ["## Closure", "",
             "Each configuration's energy split into line items (prefill, draft kept and rejected, verify "
             "useful and rejected, commit, other, in J); the items must add up to the total energy.", ""]
    for r in records:
        e = r.energy
        closure = format_closure(e.line_items_j, e.line_items_sum_j, r.run.energy_j, e.closure_error_j, e.closes,
                                 method=e.phase_energy_method)
        lines.append(f"- {config_label(r)}, {r.corpus}: `{closure}` ({_split_text(r)})")
    return lines + [""]


def _intro_md(recs: Sequence[RunRecord], title: str) -> list[str]:
    """Title, model, energy source and the caveats that apply to every figure."""
    md = [f"# {title}", "",
          f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} from {len(recs)} configurations.", ""]
    for line in injection_lines(recs):
        md += [f"> **{line}**", ""]
    models = sorted({f"{r.model} ({r.dtype}, {r.device})" for r in recs})
    md += [f"Model: {', '.join(models)}.", "",
           "**Energy source**: " + "; ".join(energy_sources(recs)) + ".",
           "J/token counts every phase, prefill included, over emitted tokens (only accepted tokens count). "
           "The roofline column is the analytic prediction of a steady-state decode step (no prefill) with the "
           "per-draft acceptance that reproduces the run's tau; it is always modelled.", ""]
    if any(not r.energy.energy_measured for r in recs if r.run.j_per_token is not None):
        md += ["Modelled energy figures are estimates, not measurements: no energy counter was read.", ""]
    if any(r.time_source == "modelled" for r in recs):
        md += ["**Times are modelled** (roofline meter in model mode): tokens/s and TPOT are not measured.", ""]
    return md


_RESULTS_NOTE = (
    "J/token window: over the steady state (from the first decode step with every slot busy to the first at which the "
    "stream can no longer refill a freed slot; ramp-up and drain excluded); J/token run: every phase of the run. Mean "
    "active rows: time-weighted over the run's decode steps. TTFT: arrival to first token, queueing included; TPOT: "
    "per request, (last token - first token) / (tokens - 1). Refill rows: median and largest number of requests one "
    "refill prefill took (a baseline with equal budgets refills in waves); prefill positions per prompt token: "
    "positions the target's prefill forwards computed per real prompt token (1.00: packed, nothing padded), from the "
    "ledger's work; a comparison whose prefill work per request differs from its baseline's by more than 10% is "
    "flagged with its cause. Greedy = baseline: requests whose output equals the baseline's, and how the others "
    "differ (Greedy audit per request, below).")


def _results_md(recs: Sequence[RunRecord]) -> list[str]:
    """One table per corpus, and a note on greedy outputs that differ from the baseline's."""
    md = ["## Results", ""]
    for corpus in corpora(recs):
        rows = [r for r in recs if r.corpus == corpus]
        md += [f"### {corpus}", "",
               f"{setting(rows, lambda r: r.stream.requests_unique)} prompts ({requests_text(rows)}), "
               f"{budgets_text(rows)}, {sampling_text(rows)}; {serving_line(rows)}.", ""]
        note = static_note(rows)
        md += _md_table(rows) + [""] + ([note, ""] if note else [])
        md += [f"> **{config_label(r)}**: {r.comparison.prefill_warning}\n" for r in rows
               if r.comparison.prefill_warning]
        md += [f"- {v}" for r in rows if (v := verdict(r))] + [""] + windows_md(rows, config_label)
        if any(r.comparison.verdict_reliable is False for r in rows):
            md += [f"> **{WHAT_TO_DO[0].upper()}{WHAT_TO_DO[1:]}.**", ""]
    md += [_RESULTS_NOTE, ""]
    note = old_records_note(recs)
    return md + ([f"> {note}", ""] if note else [])


def _unfinished_md(ledgers: Sequence[Path]) -> str:
    """How many ledger runs did not finish (interrupted or killed): marked there, counted nowhere."""
    from refspec.energy.ledger.read import unfinished_in

    gone = {rid: why for p in ledgers if p.exists() for rid, why in unfinished_in(p).items()}
    if not gone:
        return "Every run in the ledgers completed."
    kinds = ", ".join(f"{sum(v == k for v in gone.values())} {k}" for k in sorted(set(gone.values())))
    return (f"{len(gone)} ledger run(s) did not finish ({kinds}); they are marked in the ledger and no figure "
            f"counts them.")


def _audit_md(recs: Sequence[RunRecord], corrupt: Sequence[tuple[str, int, str]], ledgers: Sequence[Path]) -> list[str]:
    """Skipped records lines, the ledgers behind the figures, versions and licences."""
    from refspec.eval.corpora.catalog import licence_text

    md = []
    if corrupt:
        md += ["## Skipped records lines", ""] + [f"- {f}, line {n}: {why}" for f, n, why in corrupt] + [""]
    versions = ", ".join(f"{k} {v}" for k, v in (recs[0].versions or {}).items()) if recs else ""
    return md + ["## Audit trail", "",
                 *audit_md(recs),
                 "Every figure is computed from the ledger records of its configuration (run ids in each record) "
                 "by refspec.energy.accounting: " + ", ".join(f"`{p.name}`" for p in ledgers) + ".", "",
                 _unfinished_md(ledgers), "",
                 f"Versions: {versions}." if versions else "", "",
                 f"CPU GEMM plan: {recs[0].cpu_gemm_plan}." if recs and recs[0].cpu_gemm_plan else "", "",
                 "## Corpora and licences", "", "```", licence_text(), "```", ""]


def write_report(out_dir: Path, records: Sequence[RunRecord], *, latency_target_s: float | None = None,
                 ttft_target_s: float | None = None, corrupt: Sequence[tuple[str, int, str]] = (),
                 ledgers: Sequence[Path] = (), title: str = "refspec evaluation", frontier: bool = False) -> Report:
    """Write ``report.md`` and the plots into ``out_dir``.

    Args:
        out_dir: destination (the run or sweep directory).
        records: run records (comparisons already attached).
        latency_target_s: p99 TPOT target in s, or None.
        ttft_target_s: p99 TTFT target in s, or None.
        corrupt: ``(file, line, reason)`` of records lines that were skipped.
        ledgers: ledger files behind the records.
        title: the report's heading.
        frontier: add the energy-latency frontier (``report --frontier``).

    Returns:
        The Markdown file and the plots written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = sorted(records, key=sort_key)
    targets = Targets(latency_target_s, ttft_target_s)
    choices: dict[str, Any] | None = target_choices(recs, targets) if targets.given() else None
    plots = write_plots(recs, out_dir, latency_target_s, choices, ledgers) + request_plots(recs, out_dir, config_label)
    policy_md, policy_plots = policy_section(recs, out_dir, ledgers, frontier_plot=frontier)
    plots += policy_plots
    md = _intro_md(recs, title) + _results_md(recs) + policy_md + requests_md(recs, config_label)
    md += _closure_md(recs) + request_closure_md(recs, config_label)  # per request closes in the closure section
    md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    md += targets_md(recs, targets, choices, config_label) + _audit_md(recs, corrupt, ledgers)
    path = write_atomic(out_dir / REPORT, "\n".join(md))
    return Report(markdown=path, plots=plots)


__all__ = ["format_table", "write_report", "Report"]
