"""What decided a comparison: refill groups and prefill work per request, read from the ledger.

A speculative run and its baseline serve the same requests, so they should do the same prefill
work per request; when they do not, the prefill, not speculation, can decide the verdict (with
equal budgets a baseline refills in waves, and a refill forward padded to the longest prompt of
its group computes positions no prompt has). :func:`prefill_fields` reads, from a
configuration's ledger records:

- its refill groups: the rows each refill prefill took (prefills after a decode step; the first
  fill is the ramp-up), their count, median and maximum;
- its prefill work: positions the target's forwards computed in prefill phases (a forward's
  ``query_tokens``, else rows x tokens per row: what ran, padding included), per request
  prefilled, beside the real prompt tokens per request.

:func:`prefill_comparison` compares them with the baseline's and, when the positions per
request differ by more than :data:`PREFILL_WORK_TOLERANCE`, words a warning naming the cause.
"""
from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

PREFILL_WORK_TOLERANCE = 0.10
"""Relative difference in prefill positions per request above which a comparison is flagged."""

FIELD_TEXT: dict[str, str] = {
    "refills": "refill prefills after a decode step (the first fill excluded)",
    "refill_group_p50": "median rows per refill prefill (null without refills)",
    "refill_group_max": "most rows in one refill prefill (null without refills)",
    "prefill_positions_per_request": "positions the target's prefill forwards computed (padding included), per "
                                     "request prefilled, from the ledger's work; null when it records none",
    "prefill_tokens_per_request": "real prompt tokens per request prefilled",
    "prefill_positions_per_token": "prefill positions computed per real prompt token (1 for packed prefill)",
    "prefill_work_vs_baseline": "prefill positions per request / the baseline's (null: not comparable)",
    "prefill_warning": "why this comparison's prefill work differs from the baseline's by more than 10 % (null "
                       "when it does not)",
}
"""The record fields of this module, name -> description (listed in RECORD_FIELDS)."""


def _positions(forward: Mapping[str, Any]) -> int:
    """Query positions one recorded forward computed."""
    q = forward.get("query_tokens")
    return int(q) if q is not None else int(forward["rows"]) * int(forward["tokens_per_row"])


def _target_positions(prefills: Sequence[Mapping[str, Any]]) -> int | None:
    """Positions computed by the target's forwards (the model of each run's first prefill forward)."""
    total, target = 0, {}
    for r in prefills:
        work = r.get("work")
        if not work:
            return None  # a ledger that records no work
        target.setdefault(r["run_id"], work[0]["model"])  # the target runs first, drafter resets after
        total += sum(_positions(f) for f in work if f["model"] == target[r["run_id"]])
    return total


def prefill_fields(records: Sequence[Mapping[str, Any]], run_ids: Sequence[str],
                   prompt_lengths: Sequence[int]) -> dict[str, Any]:
    """The refill groups and prefill work of ``run_ids`` (see the module docstring).

    Args:
        records: ledger records (any runs; those of ``run_ids`` are read).
        run_ids: the configuration's ledger runs.
        prompt_lengths: tokens of each request's prompt (every request is prefilled once).
    """
    runs = set(run_ids)
    prefills = [r for r in records if r.get("kind") == "phase" and r.get("phase") == "prefill"
                and r.get("run_id") in runs]
    groups = [int(r["rows_active"]) for r in prefills if r["step"] >= 0]
    requests = sum(int(r["rows_active"]) for r in prefills)
    positions = _target_positions(prefills)
    tokens = sum(prompt_lengths) / len(prompt_lengths) if prompt_lengths else None
    per_request = positions / requests if positions is not None and requests else None
    return {"refills": len(groups), "refill_group_p50": statistics.median(groups) if groups else None,
            "refill_group_max": max(groups, default=None), "prefill_positions_per_request": per_request,
            "prefill_tokens_per_request": tokens,
            "prefill_positions_per_token": per_request / tokens if per_request is not None and tokens else None}


def _groups_text(r: Mapping[str, Any]) -> str:
    if not r.get("refills"):
        return "no refills"
    return f"refill groups of median {r['refill_group_p50']:g}, max {r['refill_group_max']} rows"


def _cause(record: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    """Why the prefill work per request differs: other requests, other prompt tokens, or padding."""
    if record.get("same_stream_as_baseline") is False:
        return "the two runs served different request streams (stream_digest differs)"
    tok, base_tok = record.get("prefill_tokens_per_request"), baseline.get("prefill_tokens_per_request")
    if tok and base_tok and abs(tok / base_tok - 1) > PREFILL_WORK_TOLERANCE:
        return f"they prefilled different prompts ({tok:.1f} against {base_tok:.1f} prompt tokens per request)"
    ppt, base_ppt = record.get("prefill_positions_per_token"), baseline.get("prefill_positions_per_token")
    return (f"padding: prefill forwards padded to the longest prompt of their group compute {base_ppt:.2f} "
            f"positions per prompt token in the baseline ({_groups_text(baseline)}) against {ppt:.2f} here "
            f"({_groups_text(record)})")


def prefill_comparison(record: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> dict[str, Any]:
    """``prefill_work_vs_baseline`` and ``prefill_warning`` of ``record`` against ``baseline``."""
    mine = record.get("prefill_positions_per_request")
    theirs = None if baseline is None else baseline.get("prefill_positions_per_request")
    if record.get("drafter") == "none" or not mine or not theirs:
        return {"prefill_work_vs_baseline": None, "prefill_warning": None}
    ratio = mine / theirs
    warning = None
    if abs(ratio - 1) > PREFILL_WORK_TOLERANCE:
        warning = (f"prefill work per request differs from the baseline's by {100 * (ratio - 1):+.0f}% "
                   f"({mine:.1f} against {theirs:.1f} positions per request), so prefill, not speculation, can "
                   f"decide this comparison; cause: {_cause(record, baseline)}")  # type: ignore[arg-type]
    return {"prefill_work_vs_baseline": ratio, "prefill_warning": warning}


__all__ = ["PREFILL_WORK_TOLERANCE", "FIELD_TEXT", "prefill_fields", "prefill_comparison"]
