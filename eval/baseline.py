"""A run record beside its baseline's: the saving, the speed-up, the greedy audit, the prefill work.

The baseline is the no-drafter configuration at the same batch, corpus and settings; it serves
the same request stream. :func:`with_baseline` returns the record with its ``comparison``
section filled (records are frozen); the run fills it as soon as the baseline is known, and the
report again over the records it merges (:func:`attach_baselines`), since records from
separate Slurm tasks meet there for the first time. Whether the verdict can rest on the two
records' times is :func:`refspec.eval.load.verdict_reliability`'s. The saving and the speed-up come from
:func:`refspec.energy.accounting.headline.energy_saving` and :func:`~refspec.energy.accounting.headline.speedup`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from refspec.energy.accounting.headline import energy_saving, speedup
from refspec.eval.audit import MAX_LISTED, MarginFn, bound_text, classify, compare
from refspec.eval.load import verdict_reliability
from refspec.eval.prefill_work import prefill_comparison
from refspec.eval.record import Comparison, RunRecord

AUDIT_FIELDS = ("greedy_requests_compared", "greedy_requests_matching", "greedy_requests_near_tie",
                "greedy_requests_defect", "greedy_requests_unclassified", "greedy_requests_not_comparable",
                "greedy_near_ties", "greedy_defects", "greedy_near_tie_bound", "greedy_audit_baseline")
"""The comparison fields the per-request greedy audit fills (:mod:`refspec.eval.audit`)."""


def compared_j_per_token(r: RunRecord) -> float | None:
    """The J/token a saving compares: the steady-state window's; a record without a window (version 2), the run's."""
    return r.run.j_per_token if r.window is None else r.window.j_per_token


def _bound(dtype: Any) -> str | None:
    try:
        return bound_text(dtype)
    except ValueError:
        return None


def audit_fields(record: RunRecord, baseline: RunRecord | None, fn: MarginFn | None = None) -> dict[str, Any]:
    """The audit's comparison fields (:data:`AUDIT_FIELDS`) of ``record`` against ``baseline``.

    Args:
        record: a record with ``request_outputs``.
        baseline: its baseline's record, or None when the outputs are not comparable (sampling,
            injected acceptance, no baseline): every field is then None.
        fn: the near-tie test (:func:`refspec.eval.audit.margin_fn`); None (at report time, no
            model) counts the differing requests as unclassified, unless ``record`` already holds
            a classification made against this very baseline, which is kept.
    """
    none: dict[str, Any] = dict.fromkeys(AUDIT_FIELDS)
    if baseline is None or not record.request_outputs or not baseline.request_outputs:
        return none
    cmp = compare(record.request_outputs, baseline.request_outputs)
    key = f"{baseline.config_id}:{baseline.output_digest}"
    counts = {"greedy_requests_compared": cmp.compared, "greedy_requests_matching": cmp.matching,
              "greedy_requests_not_comparable": len(cmp.not_comparable), "greedy_audit_baseline": key}
    if fn is None:
        c = record.comparison
        if (c.greedy_audit_baseline == key and c.greedy_requests_near_tie is not None
                and c.greedy_requests_matching == cmp.matching):
            return {f: getattr(c, f) for f in AUDIT_FIELDS}
        return {**none, **counts, "greedy_requests_unclassified": len(cmp.divergent)}
    near, defects, unclassified = classify(cmp.divergent, fn)
    return {**counts, "greedy_requests_near_tie": len(near), "greedy_requests_defect": len(defects),
            "greedy_requests_unclassified": unclassified, "greedy_near_ties": tuple(near[:MAX_LISTED]),
            "greedy_defects": tuple(defects[:MAX_LISTED]),
            "greedy_near_tie_bound": _bound(getattr(fn, "dtype", None) or record.dtype)}


def baseline_figures(b: RunRecord) -> dict[str, Any]:
    """The baseline's figures a record carries beside its own (``baseline``)."""
    return {"config_id": b.config_id, "tau": b.counts.tau, "run_tokens_per_s": b.run.tokens_per_s,
            "tpot_p50_s": b.latency.tpot_p50_s, "tpot_p99_s": b.latency.tpot_p99_s,
            "window_j_per_token": None if b.window is None else b.window.j_per_token,
            "run_j_per_token": b.run.j_per_token, "run_net_j_per_token": b.run.net_j_per_token,
            "energy_source": b.energy.energy_source, "phase_energy_j": b.energy.phase_energy_j,
            "phase_share": b.energy.phase_share, "run_ids": b.stream.run_ids}


def with_baseline(record: RunRecord, baseline: RunRecord | None, *, margin_fn: MarginFn | None = None) -> RunRecord:
    """``record`` with its comparison section filled against ``baseline`` (unchanged without one).

    ``margin_fn`` (:func:`refspec.eval.audit.margin_fn` of the target) classifies each request
    whose greedy output differs from the baseline's; without it they are counted only.
    """
    if record.is_baseline:  # the baseline itself: nothing to compare with
        return dataclasses.replace(record, comparison=Comparison(**audit_fields(record, None)))
    if baseline is None:
        return record
    same = (None if None in (record.stream.stream_digest, baseline.stream.stream_digest)
            else record.stream.stream_digest == baseline.stream.stream_digest)
    comparable = record.greedy and not record.acceptance_injected and not baseline.acceptance_injected
    reliable, why = verdict_reliability(record, baseline)
    match = rows = None
    if comparable and baseline.row_digests and record.row_digests:
        rows = sum(a == b for a, b in zip(record.row_digests, baseline.row_digests))
        match = record.output_digest == baseline.output_digest
    fields = dict(baseline=baseline_figures(baseline), same_stream_as_baseline=same,
                  energy_saving_vs_baseline=energy_saving(compared_j_per_token(record), compared_j_per_token(baseline)),
                  speedup_vs_baseline=speedup(record.run.tokens_per_s, baseline.run.tokens_per_s),
                  greedy_match_baseline=match, greedy_rows_matching=rows, verdict_reliable=reliable,
                  verdict_unreliable_reason=why,
                  **prefill_comparison(record.work, baseline.work, same_stream=same),
                  **audit_fields(record, baseline if comparable else None, margin_fn))
    return dataclasses.replace(record, comparison=dataclasses.replace(record.comparison, **fields))


def attach_baselines(records: Sequence[RunRecord]) -> list[RunRecord]:
    """Every record with its comparison against its baseline among ``records`` (order kept)."""
    by_id = {r.config_id: r for r in records}
    return [with_baseline(r, by_id.get(r.baseline_config_id or "")) for r in records]


__all__ = ["with_baseline", "attach_baselines", "audit_fields", "baseline_figures", "compared_j_per_token",
           "AUDIT_FIELDS"]
