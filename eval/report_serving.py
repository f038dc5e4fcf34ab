"""The report's serving parts: the window beside the run, latency targets, and the greedy audit.

Records of a serving run carry the steady-state window's J/token as ``energy_per_token_j`` and
the whole run's as ``energy_per_token_j_run`` (:mod:`refspec.energy.serving_window`); a record
written before serving windows (a static lockstep run, record_version 2 without those fields)
has only the run's figure, under ``energy_per_token_j``. Every reader here goes through
:func:`j_window` / :func:`j_run`, so an old record is never shown as if it had a window.
The selection under targets is :func:`refspec.energy.latency.choose`; the greedy audit fields
come from :mod:`refspec.eval.audit`. Nothing here computes a figure; it selects and formats.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Mapping, Sequence

from refspec.energy.accounting.latency import Targets, choose, cost_of_tighter_target, format_targets, misses, premium

Record = Mapping[str, Any]
TIGHTER = (1.0, 0.75, 0.5, 0.25)
"""p99 TPOT targets tabulated, as fractions of the given one."""
_NAMES = {"tpot_p99_s": "TPOT", "ttft_p99_s": "TTFT"}


def _f(x: Any, spec: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(float(x) * scale, spec)


# ---- window and run ----------------------------------------------------------------------------
def has_window(r: Record) -> bool:
    """Whether ``r`` carries the serving fields (window J/token beside the run's)."""
    return "energy_per_token_j_run" in r


def j_window(r: Record) -> float | None:
    """Steady-state window J/token; None for a record without window fields."""
    return r.get("energy_per_token_j") if has_window(r) else None


def j_run(r: Record) -> float | None:
    """Whole-run J/token (an old record's only J/token)."""
    return r.get("energy_per_token_j_run") if has_window(r) else r.get("energy_per_token_j")


def is_static(r: Record) -> bool:
    """A lockstep (``--schedule static``) serving record, whose window figures are not shown."""
    return has_window(r) and r.get("schedule") == "static"


def shown_j(r: Record) -> float | None:
    """The J/token the report shows and ranks by: the window's, a static (lockstep) row's run's."""
    return j_run(r) if is_static(r) else r.get("energy_per_token_j")


def static_note(rows: Sequence[Record]) -> str | None:
    """The footnote for static rows' n/a window figures (None when no row is static)."""
    if not any(is_static(r) for r in rows):
        return None
    return ("n/a window (static schedule): lockstep batches never refill, so their 'window' pools the all-busy "
            "stretches of each batch and is no steady state beside a continuous one; compare their run J/token.")


def window_cell(r: Record) -> str:
    """The window J/token, or why there is none."""
    if not has_window(r):
        return "absent"
    if is_static(r):
        return "n/a"
    v = r.get("energy_per_token_j")
    empty = r.get("window_note") or (v is not None and math.isnan(float(v)))
    return "empty" if empty else _f(v, ".4g") + ("*" if r.get("window_valid") is False else "")


def invalid_notes(records: Sequence[Record], label: Any) -> list[str]:
    """One line per configuration whose window is invalid (marked ``*``): why, and that it is not ranked."""
    return [f"* {label(r)}: window invalid ({r.get('window_invalid_reason')}); its J/token is shown, never ranked "
            f"by a latency target" for r in records if r.get("window_valid") is False and not r.get("window_note")]


def windows_md(rows: Sequence[Record], label: Any) -> list[str]:
    """Each configuration's steady-state window: its bounds, time, tokens, mean active rows (serving records only)."""
    recs = [r for r in rows if has_window(r)]
    if not recs:
        return []
    md = ["Steady-state windows (decode steps first..last, from the ledger by refspec.energy.serving_window):", "",
          "| configuration | steps | window s | window tokens | mean active rows, window / run | window tokens/s "
          "| note |", "|---|---|---:|---:|---:|---:|---|"]
    for r in recs:
        if is_static(r):  # the run's mean active rows stays: it is no window figure
            md.append(f"| {label(r)} | n/a | n/a | n/a | n/a / {_f(r.get('mean_active_rows'), '.1f')} | n/a | "
                      "static schedule: no steady state |")
            continue
        steps = ("n/a" if r.get("window_first_step") is None
                 else f"{r['window_first_step']}..{r['window_last_step']} ({r.get('window_steps')})")
        md.append(f"| {label(r)} | {steps} | {_f(r.get('window_s'), '.4g')} | {_f(r.get('window_tokens'), '.0f')} | "
                  f"{_f(r.get('window_mean_active_rows'), '.1f')} / {_f(r.get('mean_active_rows'), '.1f')} | "
                  f"{_f(r.get('window_tokens_per_s'), '.4g')} | {r.get('window_note') or ''} |")
    return md + [""]


def serving_line(rows: Sequence[Record]) -> str:
    """``continuous schedule, 32 requests (16 unique)`` per distinct setting, or the old-record note."""
    old = [r for r in rows if not has_window(r)]
    parts = list(dict.fromkeys(f"{r.get('schedule', '?')} schedule, {r.get('requests')} requests "
                               f"({r.get('requests_unique')} unique) at batch {r.get('batch')}"
                               for r in sorted(rows, key=lambda r: int(r.get("batch", 0))) if has_window(r)))
    if old:
        parts.append(f"{len(old)} record(s) without serving fields (static lockstep, written before steady-state "
                     f"windows): their window fields are absent and their J/token is the whole run's")
    return "; ".join(parts)


def old_records_note(records: Sequence[Record]) -> str | None:
    old = sorted(str(r.get("config_id")) for r in records if not has_window(r))
    if not old:
        return None
    return (f"{len(old)} record(s) lack the serving window fields (energy_per_token_j_run, mean_active_rows, "
            f"TTFT): " + ", ".join(old[:6]) + (" ..." if len(old) > 6 else "") + ". Their J/token is the whole "
            "run's (drain included), so it is not comparable with a window's; rerun their sweep for windows.")


# ---- the greedy audit ------------------------------------------------------------------------
def greedy_text(r: Record) -> str:
    """Per-request audit counts a reader can check, or the old per-row match, explained."""
    n = r.get("greedy_requests_compared")
    if n is not None:
        m = r.get("greedy_requests_matching")
        if m == n:
            return f"yes ({m}/{n} req)"
        parts = [f"{m}/{n} req equal"]
        for field, word in (("greedy_requests_near_tie", "near-tie"), ("greedy_requests_defect", "DEFECT"),
                            ("greedy_requests_unclassified", "unclassified")):
            if r.get(field):
                parts.append(f"{r[field]} {word}")
        return ", ".join(parts)
    match = r.get("greedy_match_baseline")
    if match is None:
        return "-"
    if match:
        return "yes (rows)"
    rows = r.get("rows")
    return f"no: {rows - (r.get('greedy_rows_matching') or 0)}/{rows} rows differ, unclassified"


def audit_md(records: Sequence[Record]) -> list[str]:
    """The greedy audit: what was compared, the bound, every defect listed, the near-ties counted."""
    audited = [r for r in records if r.get("greedy_requests_compared") is not None]
    old = [r for r in records if r.get("greedy_requests_compared") is None and r.get("greedy_match_baseline") is False]
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
        md.append(f"- {r.get('config_id')} ({r.get('dtype')}): {greedy_text(r)}; "
                  f"{r.get('greedy_requests_not_comparable') or 0} request(s) not comparable; "
                  f"bound: {r.get('greedy_near_tie_bound') or 'n/a'}")
        for d in r.get("greedy_defects") or []:
            md.append(f"  - DEFECT request {d['id']} at token {d['position']}: baseline {d['baseline_token']}, this "
                      f"run {d['token']}; top-2 margin {_f(d.get('top2_margin'), '.4g')}, gap "
                      f"{_f(d.get('gap'), '.4g')} > bound {_f(d.get('bound'), '.4g')}"
                      + (f" ({d['reason']})" if d.get("reason") and "bound" not in d["reason"] else ""))
        for d in r.get("greedy_near_ties") or []:
            md.append(f"  - near-tie request {d['id']} at token {d['position']}: baseline {d['baseline_token']}, this "
                      f"run {d['token']}; top-2 margin {_f(d.get('top2_margin'), '.4g')}, gap {_f(d.get('gap'), '.4g')}"
                      f" <= bound {_f(d.get('bound'), '.4g')}")
        if r.get("greedy_requests_unclassified"):
            md.append(f"  - {r['greedy_requests_unclassified']} differing request(s) unclassified: compared at "
                      "report time without the model; the run itself classifies them")
    for r in old:
        md.append(f"- {r.get('config_id')}: {greedy_text(r)} (record without per-request outputs: no "
                  "classification possible; rerun its sweep)")
    return md + [""]


# ---- latency targets ---------------------------------------------------------------------------
@dataclasses.dataclass
class CorpusChoice:
    """One corpus under the targets: the choice, every configuration's misses, what lacks a figure."""

    corpus: str
    chosen: Record | None
    rows: list[tuple[Record, dict[str, float | None]]]
    no_figure: list[tuple[Record, list[str]]]
    tighter: list[dict[str, Any]] | None


def target_choices(records: Sequence[Record], targets: Targets) -> dict[str, CorpusChoice]:
    """Per corpus: the lowest-J/token configuration meeting ``targets`` and every other one's misses.

    A static row is ranked by its run's J/token (:func:`shown_j`), the figure shown for it.
    """
    by_corpus: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_corpus[str(r.get("corpus"))].append(r)
    out: dict[str, CorpusChoice] = {}
    for corpus, rows in sorted(by_corpus.items()):
        usable, lacking = [], []
        for r in rows:
            absent = [f for f in ("energy_per_token_j", *targets.given())
                      if (shown_j(r) if f == "energy_per_token_j" else r.get(f)) is None]
            (lacking.append((r, absent)) if absent else usable.append(r))
        chosen = choose(usable, targets, shown_j) if usable else None
        tighter = None
        if targets.tpot_p99_s is not None and usable:
            tighter = cost_of_tighter_target(usable, [targets.tpot_p99_s * f for f in TIGHTER], targets.ttft_p99_s,
                                             shown_j)
        out[corpus] = CorpusChoice(corpus=corpus, chosen=chosen, rows=[(r, misses(r, targets)) for r in usable],
                                   no_figure=lacking, tighter=tighter)
    return out


def _chosen_j(r: Record) -> str:
    """The chosen configuration's J/token, saying which (a static row shows its run's)."""
    if is_static(r):
        return f"{_f(j_run(r), '.4g')} J/token (run, static schedule)"
    return f"{window_cell(r)} J/token (window)"


def _miss_cell(miss: float | None, target: float) -> str:
    if miss is None:
        return "no figure"
    return "meets" if miss == 0.0 else f"+{1e3 * miss:.3g} ms ({100 * miss / target:+.0f}%)"


def _row_md(r: Record, ms: Mapping[str, float | None], targets: Targets, chosen: Record | None, label: Any) -> str:
    vs = premium(float(shown_j(r)), float(shown_j(chosen))) if chosen else None
    mark = " **chosen**" if r is chosen else ""
    cells = [f"{label(r)}{mark}", window_cell(r), _f(j_run(r), ".4g"), _f(r.get("mean_active_rows"), ".1f"),
             _f(r.get("ttft_p99_s"), ".1f", 1e3), _f(r.get("tpot_p99_s"), ".1f", 1e3),
             *(_miss_cell(ms[f], t) for f, t in targets.given().items()),
             "n/a" if vs is None else f"{100 * vs:+.1f}%"]
    return "| " + " | ".join(cells) + " |"


def targets_md(records: Sequence[Record], targets: Targets | None, choices: Mapping[str, CorpusChoice] | None,
               label: Any) -> list[str]:
    """The report's latency-target section (``label``: a record's configuration label)."""
    lines = ["## Latency targets", ""]
    if targets is None or not targets.given():
        return lines + ["No latency target given (`--latency-target SECONDS`: p99 TPOT; `--ttft-target SECONDS`: "
                        "p99 TTFT); the plot shows the trade-off without one.", ""]
    lines += [f"Targets: {targets.text()}. Chosen per corpus: the configuration (batch, drafter, k) with the lowest "
              "steady-state J/token (the window's; a record without window fields competes with its run J/token "
              "and is marked) among those meeting every target (refspec.energy.latency.choose). The others show "
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
        for r, absent in c.no_figure:
            why = (f"empty window: {r['window_note']}" if r.get("window_note") else
                   "a record written before serving windows" if not has_window(r) else "not recorded")
            lines.append(f"- {label(r)}: not judged, it has no {', '.join(absent)} ({why})")
        if c.tighter:
            lines += ["", f"What tighter targets cost (p99 TPOT at {', '.join(f'{f:g}x' for f in TIGHTER)} the given "
                      "one" + (f", p99 TTFT held at {1e3 * targets.ttft_p99_s:g} ms" if targets.ttft_p99_s else "")
                      + "):", "", "```", format_targets(c.tighter), "```"]
        lines.append("")
    return lines


def targets_text(choices: Mapping[str, CorpusChoice], targets: Targets, label: Any) -> list[str]:
    """Lines for the CLI: the choice per corpus, or that none meets the targets."""
    out = [f"latency targets {targets.text()}:"]
    for corpus, c in sorted(choices.items()):
        if c.chosen is None:
            out.append(f"  {corpus}: no configuration meets the targets")
        else:
            run = "" if has_window(c.chosen) else " (run J/token: no window fields)"
            j = _chosen_j(c.chosen) if is_static(c.chosen) else f"{_f(c.chosen['energy_per_token_j'], '.4g')} J/token"
            out.append(f"  {corpus}: {label(c.chosen)}, {j}{run}")
    return out


def unmet(choices: Mapping[str, CorpusChoice]) -> list[str]:
    """Corpora where no configuration meets the targets."""
    return [c for c, ch in sorted(choices.items()) if ch.chosen is None]


__all__ = ["has_window", "is_static", "static_note", "j_window", "j_run", "window_cell", "invalid_notes", "windows_md",
           "serving_line", "old_records_note", "greedy_text", "audit_md", "CorpusChoice", "target_choices", "targets_md", "targets_text",
           "unmet", "TIGHTER"]
