"""A server session on disk: its ledger run, the live run-level figures, and the record written at the end.

A session is one ledger run (``DIR/ledger.jsonl``) that every served request lands in. While the
server runs, ``GET /v1/energy`` accounts the run so far with the eval's accounting
(:func:`refspec.energy.accounting.headline.account`, read from the ledger on disk): the whole run's J/token
and the steady-state window's (all slots busy; ramp-up and drain excluded), with the window's
validity. At shutdown the run ends and the session becomes one record in ``DIR/records.jsonl``,
the eval's :class:`~refspec.eval.record.RunRecord` built by the eval's own
:func:`refspec.eval.run.configuration_record` (per request its tokens, energy, acceptance and
latencies), so ``python -m refspec.eval report DIR`` reads a server session like any run. What
HTTP alone knows, each request's finish reason, goes beside it in ``DIR/finish_reasons.json``.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping

from refspec.energy.accounting.headline import account
from refspec.energy.ledger.read import read_ledger
from refspec.serving import Request, ServeResult

log = logging.getLogger(__name__)

SERVED_CORPUS = "http"
"""The record's ``corpus``: the requests came from HTTP clients."""
FINISH_REASONS = "finish_reasons.json"
"""Beside the record: ``{"run_id": ..., "finish_reasons": {request id: "stop" | "length" | "abort"}}``."""


def _finite(x: Any) -> Any:
    """JSON has no NaN: None in its place."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def live_energy(ledger: Any, *, counter: bool) -> dict[str, Any]:
    """``GET /v1/energy``: the session's run accounted so far.

    Args:
        ledger: the session's ledger (its ``path``, ``run_id``, ``start_offset``).
        counter: the meter is a counter that cannot see a phase (its split waits for the run's end).
    """
    out: dict[str, Any] = {"ledger": str(Path(ledger.path).resolve()), "run_id": ledger.run_id,
                           "status": "so far: the session's record at shutdown holds the final figures"}
    records = [r for r in read_ledger(ledger.path, offset=ledger.start_offset) if r.get("run_id") == ledger.run_id]
    if not any(r.get("kind") == "phase" for r in records):
        return {**out, "run": None, "window": None, "note": "no request served yet"}
    if counter:
        return {**out, "run": None, "window": None,
                "note": "the meter's counter cannot see a phase: the run's energy is attributed over its counter "
                        "windows when the session's ledger run ends (shutdown)"}
    acc = account([*records, {"kind": "end", "run_id": ledger.run_id, "status": "complete", "reason": None}],
                  run_id=ledger.run_id)
    w = acc.window
    return {**out, "source": list(acc.sources), "split_method": acc.phase_energy_method,
            "run": {"energy_j": acc.total_energy_j, "tokens": acc.emitted, "j_per_token": _finite(acc.j_per_token),
                    "time_s": acc.total_time_s, "tau": _finite(acc.tau),
                    "mean_active_rows": _finite(acc.mean_active_rows),
                    "phase_energy_j": acc.phase_energy_j},
            "window": None if w is None else {
                "j_per_token": _finite(acc.window_j_per_token), "valid": acc.window_valid,
                "invalid_reason": acc.window_invalid_reason, "energy_j": _finite(w.energy_j),
                "tokens": _finite(w.tokens), "time_s": _finite(w.time_s), "steps": w.steps,
                "mean_active_rows": _finite(w.mean_active_rows), "first_step": w.first_step,
                "last_step": w.last_step}}


def served_stream(result: ServeResult, submitted: Mapping[int, Request]) -> Any:
    """The requests the engine served (a :class:`~refspec.eval.requests.RequestStream`), each
    arriving when the engine took it; requests cancelled before a slot took them never ran."""
    from refspec.eval.requests import RequestStream

    reqs = tuple(Request(id=r.id, prompt=submitted[r.id].prompt, max_new_tokens=submitted[r.id].max_new_tokens,
                         arrival_s=r.arrival_s, ignore_eos=submitted[r.id].ignore_eos) for r in result.requests)
    budgets = sorted(q.max_new_tokens for q in reqs)
    lengths = {"dist": "client", "min": budgets[0], "p50": budgets[(len(budgets) - 1) // 2], "max": budgets[-1],
               "mean": sum(budgets) / len(budgets), "note": "each request's budget as its client asked (max_tokens)"}
    return RequestStream(requests=reqs, unique=len({q.prompt for q in reqs}), rate=None, lengths=lengths)


def write_session_record(session: Any, cfg: Any, *, drafter: Any, out_dir: Path, ledger: Any, result: ServeResult,
                         submitted: Mapping[int, Request], reasons: Mapping[int, str], started_s: float) -> Any:
    """Write the session's record (``DIR/records.jsonl``), ``summary.json``, ``report.md`` and the
    requests' finish reasons (``DIR/finish_reasons.json``), every file through the eval's writers.

    Args:
        session / cfg: the eval :class:`~refspec.eval.session.Session` and the session's ``RunConfig``.
        drafter: the drafter that served (None for plain decoding).
        ledger: the session's ledger (its run ended).
        result: the engine's result of the whole session.
        submitted: every request handed to the engine, by id.
        reasons: each ended request's finish reason (``stop``, ``length``, ``abort``).
        started_s: ``time.perf_counter()`` at the start.

    Returns:
        The :class:`~refspec.eval.record.RunRecord`, or None when no request was served (nothing to account).
    """
    from refspec.energy.ledger.writer import mark_aborted
    from refspec.eval.outputs import RECORDS, SUMMARY, write_json
    from refspec.eval.record_files import append_record, summary_json
    from refspec.eval.report import write_report
    from refspec.eval.run import configuration_record

    if not result.requests:
        log.info("no request was served: no record written")
        return None
    try:
        record = configuration_record(session, cfg, served_stream(result, submitted), [result],
                                      ledger_path=Path(ledger.path), start_offset=ledger.start_offset,
                                      run_ids=list(ledger.run_ids), drafter=drafter, started_s=started_s)
        append_record(out_dir / RECORDS, record)
    except BaseException as exc:  # its run completed, but no record will name it: the ledger must say so
        mark_aborted(ledger.path, ledger.run_ids, type(exc).__name__)
        raise
    finish = {str(r.id): reasons.get(r.id) or ("abort" if r.cancelled else "stop" if r.finished_by_eos else "length")
              for r in result.requests}
    write_json(out_dir / FINISH_REASONS, {"run_id": ledger.run_id, "finish_reasons": finish})
    write_json(out_dir / SUMMARY, summary_json([record]))
    write_report(out_dir, [record], ledgers=[Path(ledger.path)])
    return record


__all__ = ["SERVED_CORPUS", "FINISH_REASONS", "live_energy", "served_stream", "write_session_record"]
