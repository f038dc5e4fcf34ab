"""Energy and acceptance per request in the report: the JSONL export, the Markdown and the plots.

The figures are a record's (``per_request`` and each entry of ``request_outputs``), computed
once per configuration by :func:`refspec.eval.record_figures.request_figures`: the energy split
among the requests (the rule in ``docs/accounting.md``), their acceptance checked against the
ledger, their latencies from the accounting. Everything here formats them and computes nothing
new: :func:`write_request_metrics` (``--per-request-metrics FILE``), :func:`closure_md`,
:func:`requests_md` and :func:`request_plots`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable, Sequence

from refspec.energy.accounting.split_gate import withheld
from refspec.eval.outputs import write_atomic
from refspec.eval.plots import energy_label, panels, save
from refspec.eval.record import RunRecord
from refspec.eval.report_text import energy_sources, fmt

log = logging.getLogger(__name__)
Label = Callable[[RunRecord], str]


# ---- the JSONL export -------------------------------------------------------------------------
def _config(r: RunRecord) -> dict:
    return {"config_id": r.config_id, "model": r.model, "drafter": r.drafter, "k": r.k, "tree": r.tree,
            "batch": r.batch, "corpus": r.corpus, "schedule": r.stream.schedule, "request_rate": r.stream.request_rate,
            "energy_source": r.energy.energy_source}


def write_request_metrics(path: Path, records: Sequence[RunRecord]) -> int:
    """Write one JSON line per request of every record (its configuration's keys, then its
    figures; prompt and token ids left out), atomically; returns the lines written."""
    lines = [json.dumps({**_config(r), **{k: v for k, v in dataclasses.asdict(out).items()
                                          if k not in ("prompt", "tokens")}})
             for r in records for out in r.request_outputs]
    write_atomic(path, "".join(line + "\n" for line in lines))
    return len(lines)


# ---- the report -------------------------------------------------------------------------------
def _withheld(r: RunRecord) -> str | None:
    """Why the record's phase split (and so its per-request split) is not shown, or None."""
    return withheld(r.energy.phase_energy_method, r.energy.attribution)


def _has(r: RunRecord) -> bool:
    return r.per_request.request_energy_p50_j is not None


def closure_md(records: Sequence[RunRecord], label: Label) -> list[str]:
    """Per configuration: J charged to requests + the named items (idle slots, no request, host) against
    the total energy, the residual apart; a split that failed its gate charges no request and says why."""
    rows = [r for r in records if r.per_request.request_energy_closes is not None or _withheld(r) is not None]
    if not rows:
        return []
    md = ["Per request (docs/accounting.md): the J charged to requests plus the named items no request caused "
          "(each priced from the recorded work) against the total energy; the residual is what neither explains.",
          ""]
    for r in rows:
        q = r.per_request
        if (reason := _withheld(r)) is not None:
            md.append(f"- {label(r)}, {r.corpus}: no per-request split, {reason}; total {r.run.energy_j:.6g} J")
            continue
        lost = q.request_unattributed_j or {}
        names = " + ".join(f"{k} {v:.6g}" for k, v in lost.items())
        ok = "closes" if q.request_energy_closes else "DOES NOT CLOSE"
        md.append(f"- {label(r)}, {r.corpus}: `{len(r.request_outputs)} requests "
                  f"{q.request_energy_sum_j:.6g} J + {names or 'no named items'} = "
                  f"{q.request_energy_sum_j + sum(lost.values()):.6g} J; total {r.run.energy_j:.6g} J; "
                  f"residual {q.request_closure_error_j:.3g} J; {ok}`")
    return md + [""]


def _hist_text(r: RunRecord) -> str:
    hist = r.per_request.acceptance_hist or ()
    steps = sum(hist)
    return " ".join(f"{i}:{100 * n / steps:.0f}%" for i, n in enumerate(hist)) if steps else "n/a"


def _positions_text(r: RunRecord) -> str:
    return " ".join(fmt(x, ".2f") for x in r.per_request.acceptance_per_position or ()) or "n/a"


def answer(records: Sequence[RunRecord], label: Label) -> str | None:
    """One sentence answering 'what did my request cost in a batch of B?' at the largest batch run."""
    rows = [r for r in records if _has(r)]
    if not rows:
        return None
    batch = max(r.batch for r in rows)
    top = sorted((r for r in rows if r.batch == batch), key=lambda r: (r.corpus, label(r)))
    parts = [f"{label(r).replace(f' b{batch}', '')} on {r.corpus} {r.per_request.request_energy_p50_j:.3g} J "
             f"(p99 {r.per_request.request_energy_p99_j:.3g} J, {r.per_request.request_j_per_token_p50:.3g} J/token "
             f"against the run's {fmt(r.run.j_per_token, '.3g')})" for r in top]
    lost = max(float(r.per_request.request_unattributed_share or 0.0) for r in top)
    measured = all(r.energy.energy_measured for r in top)
    return (f"What did my request cost in a batch of {batch}? At the median, {'; '.join(parts)}; at most "
            f"{100 * lost:.2g}% of a run's energy was no request's ({'measured' if measured else 'modelled'}).")


def _row(r: RunRecord, label: Label) -> str:
    q = r.per_request
    cells = [label(r), str(len(r.request_outputs))]
    cells += [fmt(x, ".4g") for x in (q.request_energy_p50_j, q.request_energy_p99_j, q.request_j_per_token_p50,
                                      q.request_j_per_token_p99, r.run.j_per_token)]
    cells += [fmt(q.request_unattributed_share, ".2f", 100), fmt(r.counts.tau, ".3f"), _hist_text(r),
              _positions_text(r)]
    return "| " + " | ".join(cells) + " |"


def requests_md(records: Sequence[RunRecord], label: Label) -> list[str]:
    """The report's per-request section: the answer, per corpus the J per request and the acceptance."""
    rows = [r for r in records if _has(r) or r.per_request.acceptance_hist]
    if not rows:
        return []
    md = ["## Energy and acceptance per request", ""]
    if sentence := answer(rows, label):
        md += [sentence, ""]
    head = ("configuration", "requests", "J/request p50", "J/request p99", "J/token per request p50",
            "J/token per request p99", "J/token run", "unattributed %", "tau",
            "accepted drafts per step (share of steps)", "acceptance rate per position")
    for corpus in sorted({r.corpus for r in rows}):
        md += [f"### {corpus}", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * 8 + "---|---|"]
        md += [_row(r, label) for r in rows if r.corpus == corpus] + [""]
    return md + ["A request's joules: the shared cost of each phase it took part in (weights, fixed per-forward "
                 "costs) divided among the phase's active rows, plus the per-row work its own row did (tokens, "
                 "keys attended, its prompt), in the roofline model's proportions of the recorded work; empty or "
                 "finished slots, phases without a request and the host time between phases are named items. "
                 "A configuration whose phase split failed its gate has no per-request joules. Acceptance rate at "
                 "position i: verify steps that accepted at least i drafts over steps that offered i; tau = 1 + their sum at a fixed K.", ""]


# ---- the plots --------------------------------------------------------------------------------
def request_plots(records: Sequence[RunRecord], out_dir: Path, label: Label) -> list[Path]:
    """``request_energy.png`` (J per request against its output tokens, a panel per corpus, a
    colour per configuration) and ``acceptance_hist.png`` (a panel per configuration)."""
    written = []
    recs = [r for r in records if _has(r)]
    if recs:
        names = sorted({r.corpus for r in recs})
        plt, fig, axes = panels(len(names))
        for ax, corpus in zip(axes, names):
            for i, r in enumerate(x for x in recs if x.corpus == corpus):
                ax.scatter([o.output_tokens for o in r.request_outputs], [o.energy_j for o in r.request_outputs],
                           s=10, alpha=0.7, color=f"C{i % 10}", label=label(r))
            ax.set(title=corpus, xlabel="output tokens of the request",
                   ylabel=energy_label(recs).replace("per output token", "per request"))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
        written.append(save(plt, fig, out_dir / "request_energy.png",
                            "Energy per request (" + "; ".join(energy_sources(recs)) + ")"))
    spec = [r for r in records if not r.is_baseline and sum(r.per_request.acceptance_hist or ()) > 0]
    if spec:
        plt, fig, axes = panels(len(spec), width=4.0, height=3.0)
        for ax, r in zip(axes, spec):
            hist = r.per_request.acceptance_hist
            ax.bar(range(len(hist)), [n / sum(hist) for n in hist], color="C0")
            ax.set(title=f"{label(r)}, {r.corpus}", xlabel="drafts accepted in a verify step",
                   ylabel="share of steps", xticks=range(len(hist)))
            ax.grid(True, axis="y", alpha=0.3)
        written.append(save(plt, fig, out_dir / "acceptance_hist.png", "Accepted drafts per verify step"))
    return written


__all__ = ["write_request_metrics", "closure_md", "answer", "requests_md", "request_plots"]
