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
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from refspec.eval.record import Work

PREFILL_WORK_TOLERANCE = 0.10
"""Relative difference in prefill positions per request above which a comparison is flagged."""


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


def _groups_text(w: Work) -> str:
    if not w.refills:
        return "no refills"
    return f"refill groups of median {w.refill_group_p50:g}, max {w.refill_group_max} rows"


def _cause(mine: Work, theirs: Work, same_stream: bool | None) -> str:
    """Why the prefill work per request differs: other requests, other prompt tokens, or padding."""
    if same_stream is False:
        return "the two runs served different request streams (stream_digest differs)"
    tok, base_tok = mine.prefill_tokens_per_request, theirs.prefill_tokens_per_request
    if tok and base_tok and abs(tok / base_tok - 1) > PREFILL_WORK_TOLERANCE:
        return f"they prefilled different prompts ({tok:.1f} against {base_tok:.1f} prompt tokens per request)"
    return (f"padding: prefill forwards padded to the longest prompt of their group compute "
            f"{theirs.prefill_positions_per_token:.2f} positions per prompt token in the baseline "
            f"({_groups_text(theirs)}) against {mine.prefill_positions_per_token:.2f} here ({_groups_text(mine)})")


def prefill_comparison(mine: Work, theirs: Work | None, *, same_stream: bool | None) -> dict[str, Any]:
    """``prefill_work_vs_baseline`` and ``prefill_warning`` of a speculative run's work against its baseline's.

    Args:
        mine: the speculative run's work.
        theirs: the baseline's, or None.
        same_stream: whether the two served the same stream (None: unknown).
    """
    a = mine.prefill_positions_per_request
    b = None if theirs is None else theirs.prefill_positions_per_request
    if not a or not b:
        return {"prefill_work_vs_baseline": None, "prefill_warning": None}
    ratio = a / b
    warning = None
    if abs(ratio - 1) > PREFILL_WORK_TOLERANCE:
        warning = (f"prefill work per request differs from the baseline's by {100 * (ratio - 1):+.0f}% "
                   f"({a:.1f} against {b:.1f} positions per request), so prefill, not speculation, can "
                   f"decide this comparison; cause: {_cause(mine, theirs, same_stream)}")  # type: ignore[arg-type]
    return {"prefill_work_vs_baseline": ratio, "prefill_warning": warning}


__all__ = ["PREFILL_WORK_TOLERANCE", "prefill_fields", "prefill_comparison"]
