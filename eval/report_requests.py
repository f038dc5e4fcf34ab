"""Energy and acceptance per request: the record's fields, the JSONL export, the report section and plots.

:func:`request_fields` runs once per configuration, in :func:`refspec.eval.run.run_configuration`:
it splits the ledger runs' energy among their requests (:func:`refspec.energy.per_request.split_energy`,
the rule in ``docs/accounting.md``), checks the engine's per-request acceptance against the
ledger (:func:`refspec.energy.per_request.request_acceptance`), takes each request's latencies
from the ledger (:func:`refspec.energy.serving_window.request_times`), adds the figures to each
entry of ``request_outputs`` and returns the configuration's summary fields (:data:`FIELD_TEXT`).
Everything after that formats record fields and computes nothing new: :func:`write_request_metrics`
(``--per-request-metrics FILE``), :func:`closure_md`, :func:`requests_md` and :func:`request_plots`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from refspec.energy.accounting.serving_window import percentile, request_times
from refspec.energy.ledger.step_groups import group_steps
from refspec.energy.per_request import (PARTS, pooled_acceptance, request_acceptance, split_energy,
                                        split_profile)

log = logging.getLogger(__name__)
Record = Mapping[str, Any]

REQUEST_OUTPUT_TEXT = (
    "per request, beside id/prompt/budget/arrival_s/tokens: output_tokens (emitted, from the ledger), energy_j "
    "(its share of every phase it took part in, J; null without energy), j_per_token, energy_by_phase_j, "
    "energy_by_part_j (shared, tokens, head, pairs, keys), verify_steps, accepted_per_step, accepted_hist (steps "
    "accepting 0..K drafts), acceptance_per_position (rate at draft positions 1..K), acceptance_length "
    "((accepted + steps) / steps), ttft_s, tpot_s (null for one token), e2e_s")
FIELD_TEXT: dict[str, str] = {
    "request_energy_p50_j": "p50 over requests of the J charged to each (docs/accounting.md, per request)",
    "request_energy_p99_j": "p99 of the same (J)",
    "request_j_per_token_p50": "p50 over requests of their J / their output tokens",
    "request_j_per_token_p99": "p99 of the same",
    "request_energy_sum_j": "J charged to requests, summed",
    "request_unattributed_j": "J no request was charged, by name: idle_slots (per-row work of empty or finished "
                              "slots), no_request (a phase without a participant), outside_phases (counter "
                              "energy no phase record was given)",
    "request_unattributed_share": "unattributed J / total energy",
    "request_closure_error_j": "requests + unattributed - total energy (J)",
    "request_energy_closes": "requests + unattributed = total energy within 1e-9 relative",
    "request_split_profile": "the roofline profile whose modelled parts set the split's proportions",
    "acceptance_hist": "verify steps (over every request) that accepted 0, 1, ..., K drafts",
    "acceptance_per_position": "per draft position 1..K: steps accepting at least that many / steps offering it",
    "acceptance_tau_from_positions": "1 + accepted / steps from the histogram: equals tau",
}
_SUMMARY = ("request_energy_p50_j", "request_energy_p99_j", "request_j_per_token_p50", "request_j_per_token_p99",
            "request_unattributed_share", "request_energy_closes")


# ---- the record's fields ----------------------------------------------------------------------
def request_fields(ledger: Sequence[Record], run_ids: Sequence[str], results: Sequence[Any],
                   outputs: Sequence[dict[str, Any]], *, profile: Any = None) -> dict[str, Any]:
    """Add each request's figures to its entry of ``outputs`` (in place); return the summary fields.

    Args:
        ledger: the configuration's ledger records, read back from disk.
        run_ids: its runs.
        results: the engine's ``ServeResult`` of each run (per-request accepted drafts per step).
        outputs: the record's ``request_outputs`` (dicts with ``id``).
        profile: the hardware profile of the split's proportions (default: the meter's, see
            :func:`refspec.energy.per_request.split_profile`).

    Raises:
        refspec.energy.per_request.PerRequestError: the engine's counts disagree with the ledger.
    """
    phases = [r for r in ledger if r.get("kind") == "phase" and r.get("run_id") in set(run_ids)]
    accepted = {q.id: list(q.accepted_per_step) for res in results for q in res.requests}
    acceptance = request_acceptance(ledger, run_ids, accepted)
    k_max = max((int(r.get("k", 0) or 0) for r in phases), default=0)
    times = {q.id: q for run in run_ids
             for q in request_times(group_steps(run, [r for r in phases if r["run_id"] == run]), run)}
    has_energy = any(r.get("energy_j") is not None for r in phases) or any(
        r.get("kind") == "counter" and r.get("run_id") in set(run_ids) for r in ledger)
    split = split_energy(ledger, run_ids, split_profile(profile, {str(r["source"]) for r in phases})) \
        if has_energy else None  # a time-only meter: acceptance and latencies only
    for out in outputs:
        rid = int(out["id"])
        a, t = acceptance[rid], times[rid]
        e = split.requests.get(rid) if split is not None else None
        energy = (e.energy_j if e else 0.0) if split is not None else None
        acc, offered = a.position_counts(k_max)
        out.update(output_tokens=t.tokens, energy_j=energy,
                   j_per_token=None if energy is None else energy / t.tokens,
                   energy_by_phase_j=None if split is None else dict(e.by_phase_j if e else {}),
                   energy_by_part_j=None if split is None else dict(e.by_part_j if e else dict.fromkeys(PARTS, 0.0)),
                   verify_steps=a.verify_steps, accepted_per_step=list(a.accepted_per_step),
                   accepted_hist=a.histogram(k_max),
                   acceptance_per_position=[x / o if o else None for x, o in zip(acc, offered)],
                   acceptance_length=a.acceptance_length, ttft_s=t.ttft_s, tpot_s=t.tpot_s, e2e_s=t.e2e_s)
    pooled = pooled_acceptance(acceptance.values(), k_max)
    fields: dict[str, Any] = {"acceptance_hist": pooled["histogram"],
                              "acceptance_per_position": pooled["per_position"],
                              "acceptance_tau_from_positions": pooled["tau"]}
    fields.update(dict.fromkeys(k for k in FIELD_TEXT if k not in fields))
    if split is None:
        return fields
    energies = [o["energy_j"] for o in outputs]
    per_token = [o["j_per_token"] for o in outputs]
    lost = sum(split.unattributed_j.values())
    fields.update(request_energy_p50_j=percentile(energies, 50), request_energy_p99_j=percentile(energies, 99),
                  request_j_per_token_p50=percentile(per_token, 50), request_j_per_token_p99=percentile(per_token, 99),
                  request_energy_sum_j=sum(energies), request_unattributed_j=dict(split.unattributed_j),
                  request_unattributed_share=lost / split.total_j if split.total_j else None,
                  request_closure_error_j=split.closure_error_j, request_energy_closes=split.closes,
                  request_split_profile=split.profile)
    if not split.closes:
        log.warning("runs %s: per-request energy does not close: requests %.6g J + unattributed %.6g J vs total "
                    "%.6g J", list(run_ids), sum(energies), lost, split.total_j)
    return fields


# ---- the JSONL export -------------------------------------------------------------------------
_CONFIG_KEYS = ("config_id", "model", "drafter", "k", "tree", "batch", "corpus", "schedule", "request_rate",
                "energy_source")


def write_request_metrics(path: Path, records: Sequence[Record]) -> int:
    """Write one JSON line per request of every record (its configuration's keys, then its
    figures; prompt and token ids left out), atomically; returns the lines written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for r in records:
        config = {k: r.get(k) for k in _CONFIG_KEYS}
        for out in r.get("request_outputs") or ():
            lines.append(json.dumps({**config, **{k: v for k, v in out.items() if k not in ("prompt", "tokens")}}))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(lines)


# ---- the report -------------------------------------------------------------------------------
def _f(x: Any, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(float(x) * scale, spec)


def _has(r: Record) -> bool:
    return r.get("request_energy_p50_j") is not None


def closure_md(records: Sequence[Record], label: Any) -> list[str]:
    """Per configuration: J charged to requests + unattributed (by name) = the total energy."""
    rows = [r for r in records if r.get("request_energy_closes") is not None]
    if not rows:
        return []
    md = ["Per request (docs/accounting.md): the J charged to requests plus what no request caused must add up "
          "to the total energy.", ""]
    for r in rows:
        lost = r.get("request_unattributed_j") or {}
        names = ", ".join(f"{k} {v:.6g}" for k, v in lost.items())
        ok = "closes" if r["request_energy_closes"] else "DOES NOT CLOSE"
        md.append(f"- {label(r)}, {r.get('corpus')}: `{len(r.get('request_outputs') or ())} requests "
                  f"{r['request_energy_sum_j']:.6g} J + unattributed {sum(lost.values()):.6g} J ({names}) = "
                  f"{r['request_energy_sum_j'] + sum(lost.values()):.6g} J; total {r.get('total_energy_j'):.6g} J; "
                  f"error {r['request_closure_error_j']:.3g} J; {ok}`")
    return md + [""]


def _hist_text(r: Record) -> str:
    hist = r.get("acceptance_hist") or []
    steps = sum(hist)
    return " ".join(f"{i}:{100 * n / steps:.0f}%" for i, n in enumerate(hist)) if steps else "n/a"


def _positions_text(r: Record) -> str:
    return " ".join(_f(x, ".2f") for x in r.get("acceptance_per_position") or []) or "n/a"


def answer(records: Sequence[Record], label: Any) -> str | None:
    """One sentence answering 'what did my request cost in a batch of B?' at the largest batch run."""
    rows = [r for r in records if _has(r)]
    if not rows:
        return None
    batch = max(int(r["batch"]) for r in rows)
    top = sorted((r for r in rows if int(r["batch"]) == batch), key=lambda r: (str(r["corpus"]), label(r)))
    parts = [f"{label(r).replace(f' b{batch}', '')} on {r['corpus']} {r['request_energy_p50_j']:.3g} J "
             f"(p99 {r['request_energy_p99_j']:.3g} J, {r['request_j_per_token_p50']:.3g} J/token against the run's "
             f"{_f(r.get('energy_per_token_j_run'), '.3g')})" for r in top]
    lost = max(float(r.get("request_unattributed_share") or 0.0) for r in top)
    measured = all(r.get("energy_measured") for r in top)
    return (f"What did my request cost in a batch of {batch}? At the median, {'; '.join(parts)}; at most "
            f"{100 * lost:.2g}% of a run's energy was no request's ({'measured' if measured else 'modelled'}).")


def requests_md(records: Sequence[Record], label: Any) -> list[str]:
    """The report's per-request section: the answer, per corpus the J per request and the acceptance."""
    rows = [r for r in records if _has(r) or r.get("acceptance_hist")]
    if not rows:
        return []
    md = ["## Energy and acceptance per request", ""]
    if sentence := answer(rows, label):
        md += [sentence, ""]
    head = ("configuration", "requests", "J/request p50", "J/request p99", "J/token per request p50",
            "J/token per request p99", "J/token run", "unattributed %", "tau",
            "accepted drafts per step (share of steps)", "acceptance rate per position")
    for corpus in sorted({str(r["corpus"]) for r in rows}):
        md += [f"### {corpus}", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * 8 + "---|---|"]
        for r in (x for x in rows if x["corpus"] == corpus):
            cells = [label(r), str(len(r.get("request_outputs") or ()))]
            cells += [_f(r.get(k), ".4g") for k in ("request_energy_p50_j", "request_energy_p99_j",
                                                    "request_j_per_token_p50", "request_j_per_token_p99",
                                                    "energy_per_token_j_run")]
            cells += [_f(r.get("request_unattributed_share"), ".2f", 100), _f(r.get("tau"), ".3f"), _hist_text(r),
                      _positions_text(r)]
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
    return md + ["A request's joules: the shared cost of each phase it took part in (weights, fixed per-forward "
                 "costs) divided among the phase's active rows, plus the per-row work its own row did (tokens, "
                 "keys attended, its prompt), in the roofline model's proportions of the recorded work; empty or "
                 "finished slots stay unattributed. Acceptance rate at position i: verify steps that accepted at "
                 "least i drafts over steps that offered i; tau = 1 + their sum at a fixed K.", ""]


# ---- the plots --------------------------------------------------------------------------------
def request_plots(records: Sequence[Record], out_dir: Path, label: Any) -> list[Path]:
    """``request_energy.png`` (J per request against its output tokens, a panel per corpus, a
    colour per configuration) and ``acceptance_hist.png`` (a panel per configuration)."""
    from refspec.eval.plots import _energy_label, _panels, _save
    from refspec.eval.report import energy_sources

    written = []
    recs = [r for r in records if _has(r)]
    if recs:
        names = sorted({str(r["corpus"]) for r in recs})
        plt, fig, axes = _panels(len(names))
        for ax, corpus in zip(axes, names):
            for i, r in enumerate(x for x in recs if x["corpus"] == corpus):
                outs = r.get("request_outputs") or []
                ax.scatter([o["output_tokens"] for o in outs], [o["energy_j"] for o in outs], s=10, alpha=0.7,
                           color=f"C{i % 10}", label=label(r))
            ax.set(title=corpus, xlabel="output tokens of the request",
                   ylabel=_energy_label(recs).replace("per output token", "per request"))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
        written.append(_save(plt, fig, out_dir / "request_energy.png",
                             "Energy per request (" + "; ".join(energy_sources(recs)) + ")"))
    spec = [r for r in records if r.get("drafter") != "none" and sum(r.get("acceptance_hist") or []) > 0]
    if spec:
        plt, fig, axes = _panels(len(spec), width=4.0, height=3.0)
        for ax, r in zip(axes, spec):
            hist = r["acceptance_hist"]
            ax.bar(range(len(hist)), [n / sum(hist) for n in hist], color="C0")
            ax.set(title=f"{label(r)}, {r['corpus']}", xlabel="drafts accepted in a verify step",
                   ylabel="share of steps", xticks=range(len(hist)))
            ax.grid(True, axis="y", alpha=0.3)
        written.append(_save(plt, fig, out_dir / "acceptance_hist.png", "Accepted drafts per verify step"))
    return written


__all__ = ["FIELD_TEXT", "REQUEST_OUTPUT_TEXT", "request_fields", "write_request_metrics",
           "closure_md", "answer", "requests_md", "request_plots"]
