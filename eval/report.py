"""Reports of evaluation records: the CLI's text table and ``report.md`` (plots: :mod:`refspec.eval.plots`).

Input: configuration records (:data:`refspec.eval.records.RECORD_FIELDS`) from ``records.jsonl``
and any Slurm task files (:func:`refspec.eval.sweep.read_records`). The serving parts (window
beside run, latency targets, the per-request greedy audit) are in :mod:`refspec.eval.report_serving`. Every figure printed is a
record field computed by :mod:`refspec.energy.accounting`; this module formats, never
recomputes. ``report.md`` states where the energy came from (measured by which counter, or
modelled by which roofline profile), labels every injected-acceptance run, and prints each
configuration's closure line: its energy line items, their sum, the total, and whether they close.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from refspec.energy.accounting.latency import Targets
from refspec.energy.accounting.text import format_closure
from refspec.eval.report_requests import closure_md as request_closure_md, request_plots, requests_md
from refspec.eval.report_serving import (audit_md, greedy_text, has_window, j_run, old_records_note, serving_line,
                                         static_note, target_choices, targets_md, window_cell, windows_md,
                                         invalid_notes)

log = logging.getLogger(__name__)

PHASE_ORDER = ("prefill", "draft", "verify", "commit", "other")


# ---- small formatting helpers ---------------------------------------------------------------
def _f(x: Any, spec: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(float(x) * scale, spec)


def config_label(r: Mapping[str, Any]) -> str:
    """``none b8`` / ``ngram k4 b8`` (``tree`` and ``injected`` marked)."""
    if r.get("drafter") == "none":
        return f"none b{r['batch']}"
    tree = " tree" if r.get("tree") else ""
    inj = " INJECTED" if r.get("acceptance_injected") else ""
    pol = "" if r.get("spec_policy", "fixed") == "fixed" else f" {r['spec_policy']}"
    return f"{r['drafter']}{tree} k{r['k']}{pol} b{r['batch']}{inj}"


def series_label(r: Mapping[str, Any]) -> str:
    """Drafter and K (and a static schedule), the series a plot draws across batches."""
    static = ", static" if r.get("schedule") == "static" else ""  # lockstep batches are a series of their own
    if r.get("drafter") == "none":
        return f"none (baseline{static})"
    pol = "" if r.get("spec_policy", "fixed") == "fixed" else f" {r['spec_policy']}"
    return f"{r['drafter']}{' tree' if r.get('tree') else ''} k={r['k']}{pol}{static}"


def _phases(r: Mapping[str, Any]) -> str:
    share = r.get("phase_share")
    if not share:
        return "n/a"
    return "/".join(f"{100 * share.get(p, 0.0):.0f}" for p in PHASE_ORDER[:4])


def _ttft(r: Mapping[str, Any]) -> str:
    """``p50/p99`` TTFT in ms."""
    return f"{_f(r.get('ttft_p50_s'), '.0f', 1e3)}/{_f(r.get('ttft_p99_s'), '.0f', 1e3)}"


def _refills(r: Mapping[str, Any]) -> str:
    """``median/max`` rows of the refill prefills, or n/a."""
    if r.get("refills") is None:
        return "n/a"
    return "none" if not r["refills"] else f"{r['refill_group_p50']:g}/{r['refill_group_max']}"


def verdict(r: Mapping[str, Any]) -> str | None:
    """One sentence: whether speculation saved energy per token in ``r`` against its baseline (None for a baseline)."""
    if r.get("drafter") == "none":
        return None
    what = config_label(r).replace(f" b{r.get('batch')}", "")
    where = f"on {r.get('corpus')} at batch {r.get('batch')}, {what}"
    saving, speed = r.get("energy_saving_vs_baseline"), r.get("speedup_vs_baseline")
    if saving is None:
        return f"{where}: no verdict (no baseline figure to compare with)."
    how = (f"saves {100 * saving:.1f}% energy per token against" if saving >= 0
           else f"costs {-100 * saving:.1f}% more energy per token than")
    pace = "" if speed is None else f", at {speed:.2f}x the tokens/s"
    which = "J/token, static schedule" if r.get("schedule") == "static" else "steady-state window J/token"
    return f"{where} {how} plain decoding ({which}{pace})."


def _vs_baseline(r: Mapping[str, Any]) -> str:
    if r.get("drafter") == "none":
        return "(baseline)"
    saving, speed = r.get("energy_saving_vs_baseline"), r.get("speedup_vs_baseline")
    if saving is None and speed is None:
        return "no baseline"
    parts = []
    if saving is not None:
        parts.append(f"{-100 * saving:+.1f}% J/tok ({'saving' if saving >= 0 else 'loss'})")
    if speed is not None:
        parts.append(f"{speed:.2f}x tok/s")
    return ", ".join(parts)


def energy_sources(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Distinct energy sources in words."""
    return sorted({str(r.get("energy_source_text") or r.get("energy_source")) for r in records})


def injection_lines(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The injection label of every injected record (deduplicated)."""
    out = []
    for r in records:
        if r.get("acceptance_injected"):
            label = (r.get("injection") or {}).get("label") or "ACCEPTANCE INJECTED"
            if label not in out:
                out.append(label)
    return out


def _rows(records: Sequence[Mapping[str, Any]]) -> str:
    """``rows decoded: 4 at batch 1, 8 at batch 8`` (``requests served`` for serving records)."""
    by_batch = {int(r["batch"]): r.get("rows") for r in records}
    what = "requests served" if all(has_window(r) for r in records) else "rows decoded"
    return f"{what}: " + ", ".join(f"{n} at batch {b}" for b, n in sorted(by_batch.items()))


def sort_key(r: Mapping[str, Any]) -> tuple:
    """Records in report order: corpus, batch, baseline first, drafter, K."""
    return (str(r.get("corpus")), int(r.get("batch", 0)), r.get("drafter") != "none", str(r.get("drafter")),
            int(r.get("k", 0)))


def _setting(rows: Sequence[Mapping[str, Any]], key: str) -> str:
    """The value every row shares; a merged directory whose rows differ says so instead of quoting the first."""
    values = list(dict.fromkeys(str(r.get(key)) for r in rows))
    return values[0] if len(values) == 1 else "MIXED " + "/".join(values)


def _budgets(rows: Sequence[Mapping[str, Any]]) -> str:
    """``budgets up to 64 new tokens (reference: 1..64, median 29)``; MIXED when the rows differ."""
    texts = []
    for r in rows:
        lengths = r.get("output_lengths")
        spread = "" if not lengths else (f" ({lengths['dist']}: {lengths['min']}..{lengths['max']}, median "
                                         f"{lengths['p50']})")
        texts.append(f"budgets up to {r.get('max_new_tokens')} new tokens{spread}")
    texts = list(dict.fromkeys(texts))
    return texts[0] if len(texts) == 1 else "MIXED " + " / ".join(texts)


def _sampling(rows: Sequence[Mapping[str, Any]]) -> str:
    kinds = list(dict.fromkeys("greedy" if r.get("greedy") else f"temperature {r.get('temperature')}" for r in rows))
    return kinds[0] if len(kinds) == 1 else "MIXED " + "/".join(kinds)


# ---- the text table (CLI) ---------------------------------------------------------------------
def format_table(records: Sequence[Mapping[str, Any]]) -> str:
    """One fixed-width table of the records, grouped by corpus, with the energy source stated."""
    head = (f"{'configuration':<26}{'tau':>6}{'tok/s':>9}{'rows':>6}{'refills':>9}{'TTFT p50/99 ms':>16}"
            f"{'TPOT p99 ms':>12}{'J/tok window':>13}{'J/tok run':>11}  {'prefill/draft/verify/commit %':<30}"
            f"{'greedy = baseline':<26}vs baseline")
    lines: list[str] = []
    for line in injection_lines(records):
        lines.append(f"!! {line}")
    by_corpus: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=sort_key):
        by_corpus[str(r.get("corpus"))].append(r)
    for corpus, rows in by_corpus.items():
        lines.append(f"corpus {corpus}: model {_setting(rows, 'model')}, {_setting(rows, 'dtype')} on "
                     f"{_setting(rows, 'device')}, {_setting(rows, 'prompts_unique')} prompts ({_rows(rows)}), "
                     f"{_budgets(rows)}, {_sampling(rows)}")
        lines.append(f"  {serving_line(rows)}")
        lines.append(head)
        lines.append("-" * len(head))
        for r in rows:
            lines.append(f"{config_label(r):<26}{_f(r.get('tau'), '.3f'):>6}{_f(r.get('tokens_per_s'), '.2f'):>9}"
                         f"{_f(r.get('mean_active_rows'), '.1f'):>6}{_refills(r):>9}{_ttft(r):>16}"
                         f"{_f(r.get('tpot_p99_s'), '.1f', 1e3):>12}{window_cell(r):>13}{_f(j_run(r), '.4g'):>11}  "
                         f"{_phases(r):<30}{greedy_text(r):<26}{_vs_baseline(r)}")
        lines += [f"!! {config_label(r)}: {r['prefill_warning']}" for r in rows if r.get("prefill_warning")]
        lines += invalid_notes(rows, config_label)
        lines.append("")
    srcs = energy_sources(records)
    lines.append("J/token source: " + "; ".join(srcs))
    if any(not r.get("energy_measured") for r in records) and any(r.get("energy_per_token_j") is not None
                                                                   for r in records):
        lines.append("  (modelled figures are estimates from the analytic model, not measurements)")
    if any(r.get("time_source") == "modelled" for r in records):
        lines.append("  time, tokens/s and TPOT are MODELLED by the roofline meter, not measured")
    lines.append("J/token counts every phase (prefill included) over emitted tokens: only accepted tokens count. "
                 "window: the steady state (every slot busy, the stream still refilling); run: every phase of the "
                 "run, ramp-up and drain included; rows: mean active rows; refills: median/max rows per refill "
                 "prefill.")
    for note in (static_note(records), old_records_note(records)):
        if note:
            lines.append(f"note: {note}")
    lines += [f"verdict: {v}" for r in sorted(records, key=sort_key) if (v := verdict(r))]
    return "\n".join(lines)


# ---- latency targets --------------------------------------------------------------------------
def corpora(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The records' corpora, sorted."""
    return sorted({str(r["corpus"]) for r in records})


def with_energy(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records that have both J/token and p99 TPOT."""
    return [r for r in records if r.get("energy_per_token_j") is not None and r.get("tpot_p99_s") is not None]


def latency_choices(records: Sequence[Mapping[str, Any]], targets: Targets | None) -> dict[str, Any] | None:
    """Per corpus, the choice under ``targets`` (:func:`refspec.eval.report_serving.target_choices`); None without."""
    return target_choices(records, targets) if targets is not None and targets.given() else None


# ---- Markdown -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """What :func:`write_report` wrote."""

    markdown: Path
    plots: list[Path]


def _md_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| configuration | tau | tokens/s | mean active rows | refill rows p50/max | prefill positions per "
             "prompt token | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | J/token window | J/token run | "
             "roofline J/token | prefill/draft/verify/commit % | greedy = baseline | vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in records:
        pred = (r.get("roofline") or {}).get("j_per_token")
        lines.append(f"| {config_label(r)} | {_f(r.get('tau'), '.3f')} | {_f(r.get('tokens_per_s'), '.2f')} | "
                     f"{_f(r.get('mean_active_rows'), '.1f')} | {_refills(r)} | "
                     f"{_f(r.get('prefill_positions_per_token'), '.2f')} | {_f(r.get('ttft_p50_s'), '.1f', 1e3)} | "
                     f"{_f(r.get('ttft_p99_s'), '.1f', 1e3)} | "
                     f"{_f(r.get('tpot_p50_s'), '.1f', 1e3)} | {_f(r.get('tpot_p99_s'), '.1f', 1e3)} | "
                     f"{window_cell(r)} | {_f(j_run(r), '.4g')} | {_f(pred, '.4g')} | {_phases(r)} | {greedy_text(r)} | "
                     f"{_vs_baseline(r)} |")
    notes = invalid_notes(records, config_label)
    return lines + ([""] + notes if notes else [])


def _split_text(r: Mapping[str, Any]) -> str:
    """How the phase split was obtained, with the attribution's agreement and residual."""
    method, a = r.get("phase_energy_method"), r.get("attribution") or {}
    if not method or not method.startswith(("attributed", "measured-total")):
        return f"phase split: {method or 'none'}"
    parts = [f"phase split: {method}"]
    if a.get("agreement") is not None:
        parts.append(f"loops vs fit agree within {100 * a['agreement']:.1f} points")
    if a.get("additivity_residual") is not None:
        parts.append(f"additivity residual {100 * a['additivity_residual']:+.1f}%")
    if r.get("phase_share_true"):
        err = max(abs(r["phase_share"][p] - t) for p, t in r["phase_share_true"].items() if p in r["phase_share"])
        parts.append(f"largest error against the simulated truth {100 * err:.1f} points")
    return "; ".join(parts)


def _closure_md(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each configuration's closure line, as the accounting formats it."""
    lines = ["## Closure", "",
             "Each configuration's energy split into line items (prefill, draft kept and rejected, verify "
             "useful and rejected, commit, other, in J); the items must add up to the total energy.", ""]
    for r in records:
        closure = format_closure(r.get("line_items_j"), r.get("line_items_sum_j"), r.get("total_energy_j"),
                                 r.get("closure_error_j"), r.get("closes"), method=r.get("phase_energy_method"))
        lines.append(f"- {config_label(r)}, {r.get('corpus')}: `{closure}` ({_split_text(r)})")
    return lines + [""]


def _intro_md(recs: Sequence[Mapping[str, Any]], title: str) -> list[str]:
    """Title, model, energy source and the caveats that apply to every figure."""
    md = [f"# {title}", "",
          f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} from {len(recs)} configurations.", ""]
    for line in injection_lines(recs):
        md += [f"> **{line}**", ""]
    models = sorted({f"{r.get('model')} ({r.get('dtype')}, {r.get('device')})" for r in recs})
    md += [f"Model: {', '.join(models)}.", "",
           "**Energy source**: " + "; ".join(energy_sources(recs)) + ".",
           "J/token counts every phase, prefill included, over emitted tokens (only accepted tokens count). "
           "The roofline column is the analytic prediction of a steady-state decode step (no prefill) with the "
           "per-draft acceptance that reproduces the run's tau; it is always modelled.", ""]
    if any(not r.get("energy_measured") for r in recs if r.get("energy_per_token_j") is not None):
        md += ["Modelled energy figures are estimates, not measurements: no energy counter was read.", ""]
    if any(r.get("time_source") == "modelled" for r in recs):
        md += ["**Times are modelled** (roofline meter in model mode): tokens/s and TPOT are not measured.", ""]
    return md


def _results_md(recs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One table per corpus, and a note on greedy outputs that differ from the baseline's."""
    md = ["## Results", ""]
    for corpus in corpora(recs):
        rows = [r for r in recs if r["corpus"] == corpus]
        md += [f"### {corpus}", "",
               f"{_setting(rows, 'prompts_unique')} prompts ({_rows(rows)}), {_budgets(rows)}, {_sampling(rows)}; "
               f"{serving_line(rows)}.", ""]
        note = static_note(rows)
        md += _md_table(rows) + [""] + ([note, ""] if note else [])
        md += [f"> **{config_label(r)}**: {r['prefill_warning']}\n" for r in rows if r.get("prefill_warning")]
        md += [f"- {v}" for r in rows if (v := verdict(r))] + [""] + windows_md(rows, config_label)
    md += ["J/token window: over the steady state (from the first decode step with every slot busy to the first at "
           "which the stream can no longer refill a freed slot; ramp-up and drain excluded); J/token run: every "
           "phase of the run. Mean active rows: time-weighted over the run's decode steps. TTFT: arrival to first "
           "token, queueing included; TPOT: per request, (last token - first token) / (tokens - 1). "
           "Refill rows: median and largest number of requests one refill prefill took (a baseline with equal "
           "budgets refills in waves); prefill positions per prompt token: positions the target's prefill "
           "forwards computed per real prompt token (1.00: packed, nothing padded), from the ledger's work; a "
           "comparison whose prefill work per request differs from its baseline's by more than 10% is flagged "
           "with its cause. "
           "Greedy = baseline: requests whose output equals the baseline's, and how the others differ (Greedy "
           "audit per request, below).", ""]
    note = old_records_note(recs)
    if note:
        md += [f"> {note}", ""]
    return md


def _unfinished_md(ledgers: Sequence[Path]) -> str:
    """How many ledger runs did not finish (interrupted or killed): marked there, counted nowhere."""
    from refspec.energy.ledger.read import unfinished_in

    gone = {rid: why for p in ledgers if p.exists() for rid, why in unfinished_in(p).items()}
    if not gone:
        return "Every run in the ledgers completed."
    kinds = ", ".join(f"{sum(v == k for v in gone.values())} {k}" for k in sorted(set(gone.values())))
    return (f"{len(gone)} ledger run(s) did not finish ({kinds}); they are marked in the ledger and no figure "
            f"counts them.")


def _audit_md(recs: Sequence[Mapping[str, Any]], corrupt: Sequence[tuple[str, int, str]],
              ledgers: Sequence[Path]) -> list[str]:
    """Skipped records lines, the ledgers behind the figures, versions and licences."""
    from refspec.eval.corpora import licence_text

    md = []
    if corrupt:
        md += ["## Skipped records lines", ""] + [f"- {f}, line {n}: {why}" for f, n, why in corrupt] + [""]
    versions = ", ".join(f"{k} {v}" for k, v in (recs[0].get("versions") or {}).items()) if recs else ""
    return md + ["## Audit trail", "",
                 *audit_md(recs),
                 "Every figure is computed from the ledger records of its configuration (run ids in each record) "
                 "by refspec.energy.accounting: " + ", ".join(f"`{p.name}`" for p in ledgers) + ".", "",
                 _unfinished_md(ledgers), "",
                 f"Versions: {versions}." if versions else "", "",
                 f"CPU GEMM plan: {recs[0]['cpu_gemm_plan']}." if recs and recs[0].get("cpu_gemm_plan") else "", "",
                 "## Corpora and licences", "", "```", licence_text(), "```", ""]


def write_report(out_dir: Path, records: Sequence[Mapping[str, Any]], *, latency_target_s: float | None = None,
                 ttft_target_s: float | None = None, corrupt: Sequence[tuple[str, int, str]] = (), ledgers: Sequence[Path] = (),
                 title: str = "refspec evaluation", frontier: bool = False) -> Report:
    """Write ``report.md`` and the plots into ``out_dir``.

    Args:
        out_dir: destination (the sweep directory).
        records: configuration records (comparison fields already attached).
        latency_target_s: p99 TPOT target in s, or None.
        ttft_target_s: p99 TTFT target in s, or None.
        corrupt: ``(file, line, reason)`` of records lines that were skipped.
        ledgers: ledger files behind the records.
        title: the report's heading.
        frontier: add the energy-latency frontier (``report --frontier``).

    Returns:
        The Markdown file and the plots written.
    """
    from refspec.eval.plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    recs = sorted(records, key=sort_key)
    targets = Targets(latency_target_s, ttft_target_s)
    choices = latency_choices(recs, targets)
    plots = write_plots(recs, out_dir, latency_target_s, choices, ledgers) + request_plots(recs, out_dir, config_label)
    from refspec.eval.policy_report import policy_section  # speculation policies, the frontier

    policy_md, policy_plots = policy_section(recs, out_dir, ledgers, frontier_plot=frontier)
    plots += policy_plots
    md = _intro_md(recs, title) + _results_md(recs) + policy_md + requests_md(recs, config_label)
    md += _closure_md(recs) + request_closure_md(recs, config_label)  # per request closes in the closure section
    md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    md += targets_md(recs, targets, choices, config_label) + _audit_md(recs, corrupt, ledgers)
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return Report(markdown=path, plots=plots)


__all__ = ["format_table", "write_report", "Report", "verdict", "latency_choices", "config_label", "series_label",
           "energy_sources", "injection_lines", "corpora", "with_energy", "sort_key", "PHASE_ORDER"]
