"""``GET /metrics``: the server's counters in Prometheus' text format (version 0.0.4).

Counters since the server started: requests by finish reason, prompt and generated tokens, draft
tokens proposed and accepted and verify row-steps (vLLM's names for the last three), energy in
joules by phase with the meter's source as a label; gauges: requests in (decoding or queued),
rows decoding in the last step, slots, and tau (accepted + bonus per verify row-step). A counter
meter that cannot see a phase has no per-phase joules until the session ends: the energy lines
are then left out and a comment says why.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric(lines: list[str], name: str, kind: str, text: str, samples: Mapping[str, float]) -> None:
    """One metric family: ``samples`` maps a label set (``'{k="v"}'`` or ``''``) to its value."""
    lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {float(v):.17g}" for labels, v in samples.items()]


def prometheus_text(*, totals: Mapping[str, Any], reasons: Mapping[int, str], running: int, prompt_tokens: int,
                    batch: int, model: str, source: str) -> str:
    """The exposition text.

    Args:
        totals: the book's :meth:`~refspec.serve.book.RequestBook.snapshot`.
        reasons: finish reason of every request that ended.
        running: requests decoding or queued.
        prompt_tokens: prompt tokens of every request submitted.
        batch: the engine's slots.
        model: the served model name (a label on every sample).
        source: the meter's source string.
    """
    m = f'model_name="{_label(model)}"'
    one = {"{" + m + "}": 0.0}
    lines: list[str] = []
    by_reason = Counter(reasons.values())
    _metric(lines, "refspec_requests_total", "counter", "requests that ended, by finish reason (stop, length, abort)",
            {"{" + m + f',finish_reason="{r}"' + "}": float(by_reason.get(r, 0)) for r in ("stop", "length", "abort")})
    _metric(lines, "refspec_requests_running", "gauge", "requests submitted and not ended (decoding or queued)",
            {k: running for k in one})
    _metric(lines, "refspec_rows_active", "gauge", "rows decoding in the last step", {k: totals["rows_active"]
                                                                                      for k in one})
    _metric(lines, "refspec_batch_slots", "gauge", "the engine's slots B", {k: batch for k in one})
    _metric(lines, "refspec_prompt_tokens_total", "counter", "prompt tokens of the requests submitted",
            {k: prompt_tokens for k in one})
    _metric(lines, "refspec_generation_tokens_total", "counter", "tokens emitted (prefill's first token included)",
            {k: totals["emitted"] for k in one})
    _metric(lines, "refspec_spec_decode_num_draft_tokens_total", "counter", "draft tokens proposed to active rows",
            {k: totals["drafted"] for k in one})
    _metric(lines, "refspec_spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted",
            {k: totals["accepted"] for k in one})
    _metric(lines, "refspec_spec_decode_num_drafts_total", "counter", "verify row-steps (rows active in a verify)",
            {k: totals["verify_rows"] for k in one})
    rows = totals["verify_rows"]
    _metric(lines, "refspec_tau", "gauge", "acceptance length: (accepted + verify row-steps) / verify row-steps",
            {k: (totals["accepted"] + rows) / rows if rows else float("nan") for k in one})
    energy = totals["energy_by_phase_j"]
    if energy is None:
        lines.append("# refspec_energy_joules_total: the meter's counter cannot see a phase; the per-phase split is "
                     "attributed when the session ends (GET /v1/energy, the session's record)")
    else:
        _metric(lines, "refspec_energy_joules_total", "counter", "energy of the phases run, J, by phase and source",
                {"{" + m + f',phase="{p}",source="{_label(source)}"' + "}": e for p, e in sorted(energy.items())})
    return "\n".join(lines) + "\n"


__all__ = ["CONTENT_TYPE", "prometheus_text"]
