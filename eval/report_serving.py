"""The report's serving parts: the window beside the run, latency targets, and the greedy audit.

Which J/token a record shows is :mod:`refspec.eval.report_text`'s (the window's; a static or
old record's run's). The selection under targets is :func:`refspec.energy.accounting.latency.choose`,
which reads a mapping per record (:func:`latency_view`); the greedy audit's figures come from
:mod:`refspec.eval.baseline`. Nothing here computes a figure; it selects and formats.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

from refspec.energy.accounting.latency import Targets, choose, cost_of_tighter_target, format_targets, misses, premium
from refspec.eval.record import RunRecord
from refspec.eval.report_text import fmt, has_window, is_static, j_run, shown_j

Label = Callable[[RunRecord], str]
TIGHTER = (1.0, 0.75, 0.5, 0.25)
"""p99 TPOT targets tabulated, as fractions of the given one."""
_NAMES = {"tpot_p99_s": "TPOT", "ttft_p99_s": "TTFT"}


# ---- window and run ----------------------------------------------------------------------------
def static_note(rows: Sequence[RunRecord]) -> str | None:
    """The footnote for static rows' n/a window figures (None when no row is static)."""
    if not any(is_static(r) for r in rows):
        return None
    return ("n/a window (static schedule): lockstep batches never refill, so their 'window' pools the all-busy "
            "stretches of each batch and is no steady state beside a continuous one; compare their run J/token.")


def window_cell(r: RunRecord) -> str:
    """The window J/token, or why there is none."""
    if not has_window(r):
        return "absent"
    if is_static(r):
        return "n/a"
    v = r.window.j_per_token
    empty = r.window.note or (v is not None and math.isnan(float(v)))
    return "empty" if empty else fmt(v, ".4g") + ("*" if r.window.valid is False else "")


def _unresolved(r: RunRecord) -> str | None:
    """Why the counter's total over the run cannot be trusted (None: it can, or no counter)."""
    return (r.energy.attribution or {}).get("total_unresolved")


def run_cell(r: RunRecord) -> str:
    """The run J/token, marked ``*`` when the counter's total over the run is unresolved."""
    return fmt(j_run(r), ".4g") + ("*" if _unresolved(r) else "")


def invalid_notes(records: Sequence[RunRecord], label: Label) -> list[str]:
    """One line per configuration whose window is invalid or whose run total is unresolved (marked ``*``)."""
    return ([f"* {label(r)}: window invalid ({r.window.invalid_reason}); its J/token is shown, never ranked "
             f"by a latency target" for r in records if r.window is not None and r.window.valid is False
             and not r.window.note]
            + [f"* {label(r)}: run J/token unresolved ({_unresolved(r)})" for r in records if _unresolved(r)])


def windows_md(rows: Sequence[RunRecord], label: Label) -> list[str]:
    """Each configuration's steady-state window: its bounds, time, tokens, mean active rows (serving records only)."""
    recs = [r for r in rows if has_window(r)]
    if not recs:
        return []
    md = ["Steady-state windows (decode steps first..last, from the ledger by refspec.energy.accounting.serving_window):", "",
          "| configuration | steps | window s | window tokens | mean active rows, window / run | window tokens/s "
          "| note |", "|---|---|---:|---:|---:|---:|---|"]
    for r in recs:
        if is_static(r):  # the run's mean active rows stays: it is no window figure
            md.append(f"| {label(r)} | n/a | n/a | n/a | n/a / {fmt(r.run.mean_active_rows, '.1f')} | n/a | "
                      "static schedule: no steady state |")
            continue
        w = r.window
        steps = "n/a" if w.first_step is None else f"{w.first_step}..{w.last_step} ({w.steps})"
        md.append(f"| {label(r)} | {steps} | {fmt(w.time_s, '.4g')} | {fmt(w.tokens, '.0f')} | "
                  f"{fmt(w.mean_active_rows, '.1f')} / {fmt(r.run.mean_active_rows, '.1f')} | "
                  f"{fmt(w.tokens_per_s, '.4g')} | {w.note or ''} |")
    return md + [""]


def serving_line(rows: Sequence[RunRecord]) -> str:
    """``continuous schedule, 32 requests (16 unique)`` per distinct setting, or the old-record note."""
    old = [r for r in rows if not has_window(r)]
    parts = list(dict.fromkeys(f"{r.stream.schedule or '?'} schedule, {r.stream.requests} requests "
                               f"({r.stream.requests_unique} unique) at batch {r.batch}"
                               for r in sorted(rows, key=lambda r: r.batch) if has_window(r)))
    if old:
        parts.append(f"{len(old)} record(s) without serving fields (static lockstep, written before steady-state "
                     f"windows): their window fields are absent and their J/token is the whole run's")
    return "; ".join(parts)


def old_records_note(records: Sequence[RunRecord]) -> str | None:
    old = sorted(r.config_id for r in records if not has_window(r))
    if not old:
        return None
    return (f"{len(old)} record(s) lack the serving window fields (window_j_per_token, run_mean_active_rows, "
            f"TTFT): " + ", ".join(old[:6]) + (" ..." if len(old) > 6 else "") + ". Their J/token is the whole "
            "run's (drain included), so it is not comparable with a window's; rerun their sweep for windows.")


# ---- the greedy audit ------------------------------------------------------------------------
def greedy_text(r: RunRecord) -> str:
    """Per-request audit counts a reader can check, or the old per-row match, explained."""
    c = r.comparison
    if c.greedy_requests_compared is not None:
        n, m = c.greedy_requests_compared, c.greedy_requests_matching
        if m == n:
            return f"yes ({m}/{n} req)"
        parts = [f"{m}/{n} req equal"]
        for count, word in ((c.greedy_requests_near_tie, "near-tie"), (c.greedy_requests_defect, "DEFECT"),
                            (c.greedy_requests_unclassified, "unclassified")):
            if count:
                parts.append(f"{count} {word}")
        return ", ".join(parts)
    if c.greedy_match_baseline is None:
        return "-"
    if c.greedy_match_baseline:
        return "yes (rows)"
    rows = r.stream.requests or 0
    return f"no: {rows - (c.greedy_rows_matching or 0)}/{rows} rows differ, unclassified"


def _divergence(d: Mapping[str, Any], kind: str, op: str) -> str:
    return (f"  - {kind} request {d['id']} at token {d['position']}: baseline {d['baseline_token']}, this run "
            f"{d['token']}; top-2 margin {fmt(d.get('top2_margin'), '.4g')}, gap {fmt(d.get('gap'), '.4g')} {op} "
            f"bound {fmt(d.get('bound'), '.4g')}")


def audit_md(records: Sequence[RunRecord]) -> list[str]:
    """The greedy audit: what was compared, the bound, every defect listed, the near-ties counted."""
    audited = [r for r in records if r.comparison.greedy_requests_compared is not None]
    old = [r for r in records if r.comparison.greedy_requests_compared is None
           and r.comparison.greedy_match_baseline is False]
    md = ["### Greedy audit per request", "",
          "Each request's greedy output is compared token for token with the baseline's for the same request "
          "(same id and prompt). A differing request is a **near-tie** when, at its first divergent token, a "
          "target forward over prompt + common prefix puts both emitted tokens within rounding noise of the top "
          "logit (refspec.eval.audit: max(4 ulp in the run's dtype, 128 ulp in fp32) at the top logit's "
          "magnitude), else a **defect** (a bug). fp32 runs should match outright; bf16/fp16 flip near-ties "
          "routinely.", ""]
    if not audited and not old:
        return md + ["No greedy comparison in these records (sampling, injected acceptance or baseline only).", ""]
    for r in audited:
        c = r.comparison
        md.append(f"- {r.config_id} ({r.dtype}): {greedy_text(r)}; {c.greedy_requests_not_comparable or 0} "
                  f"request(s) not comparable; bound: {c.greedy_near_tie_bound or 'n/a'}")
        for d in c.greedy_defects or ():
            md.append(_divergence(d, "DEFECT", ">")
                      + (f" ({d['reason']})" if d.get("reason") and "bound" not in d["reason"] else ""))
        md += [_divergence(d, "near-tie", "<=") for d in c.greedy_near_ties or ()]
        if c.greedy_requests_unclassified:
            md.append(f"  - {c.greedy_requests_unclassified} differing request(s) unclassified: compared at "
                      "report time without the model; the run itself classifies them")
    for r in old:
        md.append(f"- {r.config_id}: {greedy_text(r)} (record without per-request outputs: no "
                  "classification possible; rerun its sweep)")
    return md + [""]


# ---- latency targets ---------------------------------------------------------------------------
@dataclasses.dataclass
class CorpusChoice:
    """One corpus under the targets: the choice, every configuration's misses, what lacks a figure."""

    corpus: str
    chosen: RunRecord | None
    rows: list[tuple[RunRecord, dict[str, float | None]]]
    no_figure: list[tuple[RunRecord, list[str]]]
    tighter: list[dict[str, Any]] | None


def latency_view(r: RunRecord) -> dict[str, Any]:
    """What :mod:`refspec.energy.accounting.latency` reads of a record: its identity, p99 latencies, window
    validity, and the J/token the report shows (:func:`refspec.eval.report_text.shown_j`)."""
    return {"batch": r.batch, "drafter": r.drafter, "k": r.k, "tpot_p99_s": r.latency.tpot_p99_s,
            "ttft_p99_s": r.latency.ttft_p99_s, "energy_per_token_j": shown_j(r),
            **({} if r.window is None else {"window_valid": r.window.valid})}


def target_choices(records: Sequence[RunRecord], targets: Targets) -> dict[str, CorpusChoice]:
    """Per corpus: the lowest-J/token configuration meeting ``targets`` and every other one's misses.

    A static row is ranked by its run's J/token (:func:`refspec.eval.report_text.shown_j`), the figure shown for it.
    """
    by_corpus: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_corpus[r.corpus].append(r)
    out: dict[str, CorpusChoice] = {}
    for corpus, rows in sorted(by_corpus.items()):
        usable, lacking = [], []
        for r in rows:
            view = latency_view(r)
            absent = [("J/token" if f == "energy_per_token_j" else f) for f in ("energy_per_token_j", *targets.given())
                      if view[f] is None]
            (lacking.append((r, absent)) if absent else usable.append(r))
        views = [latency_view(r) for r in usable]
        best = choose(views, targets) if usable else None
        tighter = None
        if targets.tpot_p99_s is not None and usable:
            tighter = cost_of_tighter_target(views, [targets.tpot_p99_s * f for f in TIGHTER], targets.ttft_p99_s)
        out[corpus] = CorpusChoice(corpus=corpus, chosen=next((r for r, v in zip(usable, views) if v is best), None),
                                   rows=[(r, misses(v, targets)) for r, v in zip(usable, views)],
                                   no_figure=lacking, tighter=tighter)
    return out


def _chosen_j(r: RunRecord) -> str:
    """The chosen configuration's J/token, saying which (a static row shows its run's)."""
    if is_static(r):
        return f"{fmt(j_run(r), '.4g')} J/token (run, static schedule)"
    return f"{window_cell(r)} J/token (window)"


def _miss_cell(miss: float | None, target: float) -> str:
    if miss is None:
        return "no figure"
    return "meets" if miss == 0.0 else f"+{1e3 * miss:.3g} ms ({100 * miss / target:+.0f}%)"


def _row_md(r: RunRecord, ms: Mapping[str, float | None], targets: Targets, chosen: RunRecord | None,
            label: Label) -> str:
    vs = premium(float(shown_j(r)), float(shown_j(chosen))) if chosen else None
    mark = " **chosen**" if r is chosen else ""
    cells = [f"{label(r)}{mark}", window_cell(r), run_cell(r), fmt(r.run.mean_active_rows, ".1f"),
             fmt(r.latency.ttft_p99_s, ".1f", 1e3), fmt(r.latency.tpot_p99_s, ".1f", 1e3),
             *(_miss_cell(ms[f], t) for f, t in targets.given().items()),
             "n/a" if vs is None else f"{100 * vs:+.1f}%"]
    return "| " + " | ".join(cells) + " |"


def _not_judged(r: RunRecord, absent: Sequence[str], label: Label) -> str:
    why = (f"empty window: {r.window.note}" if r.window is not None and r.window.note else
           "a record written before serving windows" if not has_window(r) else "not recorded")
    return f"- {label(r)}: not judged, it has no {', '.join(absent)} ({why})"


def targets_md(records: Sequence[RunRecord], targets: Targets | None, choices: Mapping[str, CorpusChoice] | None,
               label: Label) -> list[str]:
    """The report's latency-target section (``label``: a record's configuration label)."""
    lines = ["## Latency targets", ""]
    if targets is None or not targets.given():
        return lines + ["No latency target given (`--latency-target SECONDS`: p99 TPOT; `--ttft-target SECONDS`: "
                        "p99 TTFT); the plot shows the trade-off without one.", ""]
    lines += [f"Targets: {targets.text()}. Chosen per corpus: the configuration (batch, drafter, k) with the lowest "
              "steady-state J/token (the window's; a record without window fields competes with its run J/token "
              "and is marked) among those meeting every target (refspec.energy.accounting.latency.choose). The others show "
              "by how much they miss each target, and their J/token against the choice.", ""]
    note = old_records_note(records)
    if note:
        lines += [f"> {note}", ""]
    for corpus, c in sorted((choices or {}).items()):
        head = (f"**{corpus}**: " + (f"{label(c.chosen)}, {_chosen_j(c.chosen)}" if c.chosen
                                     else "no configuration meets the targets"))
        given = list(targets.given())
        lines += [head, "", "| configuration | J/token window | J/token run | mean active rows | TTFT p99 ms | "
                  "TPOT p99 ms | " + " | ".join(f"{_NAMES[f]} miss" for f in given) + " | J/token vs chosen |",
                  "|---|" + "---:|" * (6 + len(given))]
        lines += [_row_md(r, ms, targets, c.chosen, label) for r, ms in c.rows]
        note = static_note([r for r, _ in c.rows])
        lines += ["", note] if note else []
        lines.append("")
        lines += [_not_judged(r, absent, label) for r, absent in c.no_figure]
        if c.tighter:
            lines += ["", f"What tighter targets cost (p99 TPOT at {', '.join(f'{f:g}x' for f in TIGHTER)} the given "
                      "one" + (f", p99 TTFT held at {1e3 * targets.ttft_p99_s:g} ms" if targets.ttft_p99_s else "")
                      + "):", "", "```", format_targets(c.tighter), "```"]
        lines.append("")
    return lines


def targets_text(choices: Mapping[str, CorpusChoice], targets: Targets, label: Label) -> list[str]:
    """Lines for the CLI: the choice per corpus, or that none meets the targets."""
    out = [f"latency targets {targets.text()}:"]
    for corpus, c in sorted(choices.items()):
        if c.chosen is None:
            out.append(f"  {corpus}: no configuration meets the targets")
        else:
            run = "" if has_window(c.chosen) else " (run J/token: no window fields)"
            j = _chosen_j(c.chosen) if is_static(c.chosen) else f"{fmt(shown_j(c.chosen), '.4g')} J/token"
            out.append(f"  {corpus}: {label(c.chosen)}, {j}{run}")
    return out


def unmet(choices: Mapping[str, CorpusChoice]) -> list[str]:
    """Corpora where no configuration meets the targets."""
    return [c for c, ch in sorted(choices.items()) if ch.chosen is None]


__all__ = ["static_note", "window_cell", "run_cell", "invalid_notes", "windows_md", "serving_line", "old_records_note",
           "greedy_text", "audit_md", "CorpusChoice", "latency_view", "target_choices", "targets_md", "targets_text",
           "unmet", "TIGHTER"]
