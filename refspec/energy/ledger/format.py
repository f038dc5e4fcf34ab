"""The ledger's record format: its version, the fields of every record kind, and the two rules
writer and readers share (how a phase event becomes a record, how records group into steps).

A ledger file is JSON lines. One run is: its ``run`` header; a ``model`` record for every
architecture its forwards ran, written before the first phase that used it; one ``phase`` record
per phase of every step; ``counter`` records where a counter meter read its counter; ``loop``
records of phase-isolated loops, where a loop runner ran them; and one ``end`` record.

A phase record holds the work its forwards did as they reported it (the
:class:`~refspec.energy.model.work.ForwardShape` fields, compactly, naming their model record), never
a cost: FLOPs, bytes, time and energy of that work are modelled where a modelled figure is
computed (:func:`phase_work`, then :func:`refspec.energy.model.roofline.total_cost`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from refspec.config import ModelArgs
from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.model.work import ForwardShape

LEDGER_VERSION = 3
"""The format this refspec writes and reads; a file of another version is refused, not converted."""

RUN_SCHEMA: dict[str, str] = {
    "kind": '"run": the header of one run',
    "version": "ledger format version (int)",
    "run_id": "configuration / run id every record of the run repeats (str)",
    "created_unix_s": "wall-clock creation time, seconds since the epoch (float)",
    "meter_source": "the meter's source string, e.g. measured:nvml-total-energy(gpu0) (str or null)",
    "idle_w": "idle power in W for net-of-idle accounting: measured on GPU, the profile's value when "
              "modelled (float or null)",
    "labels": "free-form configuration: model, drafter, k, batch, corpus, dtype, clocks ... (object)",
}
MODEL_SCHEMA: dict[str, str] = {
    "kind": '"model": one architecture the run\'s forwards ran, before the first phase that used it',
    "version": "ledger format version (int)", "run_id": "the run (str)",
    "model": "its id within the run, 0, 1, ... (int)",
    "args": "the refspec.config.ModelArgs fields (object)",
}
SCHEMA: dict[str, str] = {
    "kind": '"phase": one phase of one step',
    "version": "ledger format version (int)",
    "run_id": "run this record belongs to (str)",
    "step": "decode step index; a prefill's is the decode step after which it ran, -1 for the first fill (int)",
    "phase": "prefill | draft | verify | commit | other (str)",
    "k": "drafts the speculation policy asked for in the step (0 on a prefill and in plain decoding) (int)",
    "batch": "rows in the batch, the static shape B (int)",
    "rows_active": "rows still generating when the phase ran (int)",
    "drafted": "draft tokens proposed to active rows in the step (int)",
    "accepted": "draft tokens accepted in the step, summed over rows (int)",
    "emitted": "tokens emitted to users in the step (accepted + bonus/recovered, after EOS and budget "
               "truncation), summed over rows (int)",
    "verified": "target positions computed for active rows, active rows x (K+1) for chains (int)",
    "time_s": "wall (or modelled) time of the phase, s (float)",
    "energy_j": "energy of the phase, J; null for a time-only meter and for a counter that cannot see a phase "
                "(float or null)",
    "source": "where energy_j came from: measured:<counter> | modelled:roofline(<profile>) | none:time-only",
    "work": "the forwards the phase ran, in order: each {model: id of its model record, and the ForwardShape "
            "fields that differ from their defaults} (list of objects)",
    "emitted_per_row": "tokens emitted per row in the step, length batch (list of int)",
    "slot_requests": "request id in each slot during the phase, -1 empty, length batch; on a prefill the ids "
                     "being prefilled, -1 elsewhere (list of int)",
    "arrivals_s": "prefill only: arrival time of each prefilled request (closed loop: its admission), -1.0 "
                  "elsewhere, length batch (list of float)",
    "queued": "requests of the stream not yet admitted after the phase (int)",
    "clock_s": "engine clock at the phase's start, s (float)",
    "row_lengths": "keys each slot's queries attend in the phase (prefill: prompt length; decode: committed "
                   "length plus the step's positions), 0 empty, length batch (list of int)",
    "accepted_per_row": "commit only: drafts each slot accepted in the step, -1 where no request was generating, "
                        "length batch; empty on other phases (list of int)",
}
"""Fields of a phase record, name -> description. A meter may add its own (``Measurement.extra``:
a simulated counter's ``energy_true_j``, the true energy of the phase in J)."""
LOOP_SCHEMA: dict[str, str] = {
    "kind": '"loop": a phase-isolated loop (the phase alone, repeated at the run\'s shapes)',
    "version": "ledger format version (int)", "run_id": "the run whose phases it prices (str)",
    "phase": "the phase the loop repeated (str)",
    "energy_j": "counter energy over the whole loop, J (float)", "time_s": "the loop's duration, s (float)",
    "iterations": "phase calls the loop ran (int)", "source": "the counter read (str)",
    "rows": "rows each call ran, when calls of the phase differ in rows (a refill prefill): a phase record of "
            "rows_active R is priced R / rows calls; null: every call priced as one (int or null)",
    "phase_time_s": "the loop of the whole step (phase \"step\") only: each of its phases' time over the loop, s "
                    "(object; absent on other loops)",
}
END_SCHEMA: dict[str, str] = {
    "kind": '"end": the last record of one run',
    "version": "ledger format version (int)", "run_id": "the run that ended (str)",
    "status": "complete | aborted (str)",
    "reason": "why an aborted run stopped, e.g. KeyboardInterrupt (str or null)",
    "created_unix_s": "wall-clock time of the end, seconds since the epoch (float)",
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "run": ("run_id",), "model": ("run_id", "model", "args"), "end": ("run_id", "status"),
    "phase": ("run_id", "step", "phase", "batch", "rows_active", "time_s", "energy_j", "source", "work",
              "slot_requests", "clock_s"),
    "counter": ("run_id", "clock_s", "wall_s", "energy_j", "source", "reason"),
    "loop": ("run_id", "phase", "energy_j", "time_s", "iterations", "source"),
}
"""Fields each record kind must carry (counter records:
:data:`refspec.energy.ledger.counter_records.COUNTER_SCHEMA`)."""

class LedgerError(ValueError):
    """A ledger file that cannot be read or written as asked."""


_SHAPE_FIELDS = tuple(f for f in dataclasses.fields(ForwardShape) if f.name != "args")


def problem(record: Any) -> str | None:
    """Why ``record`` is not a valid record of this version, or None."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    need = REQUIRED.get(record.get("kind"))  # type: ignore[arg-type]
    if need is None:
        return f"unknown kind {record.get('kind')!r}"
    missing = [f for f in need if f not in record]
    return f"{record['kind']} record missing fields {missing}" if missing else None


def group_key(step: int, phase: str, slot_requests: Sequence[int]) -> tuple[int, str, tuple[int, ...]]:
    """The one grouping rule: a run holds each key once, and records of one key form one group.

    Decode phases key by (step, phase). A prefill also keys by the requests it prefilled: a
    refill runs after decode step ``step``, and two refills after one step (the first's requests
    all finished at their first token) differ in their requests.
    """
    return step, phase, tuple(int(x) for x in slot_requests) if phase == "prefill" else ()


def _forward(shape: ForwardShape, model: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model}
    for f in _SHAPE_FIELDS:
        value = getattr(shape, f.name)
        if hasattr(value, "item"):  # a GPU forward's experts count stays on the device until the step synchronised
            value = value.item()
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = value
    return out


def phase_record(event: PhaseEvent, run_id: str, model_id: Callable[[ModelArgs], int]) -> dict[str, Any]:
    """The JSON-ready phase record of ``event`` (:data:`SCHEMA`); ``model_id`` names each forward's model."""
    m = event.measurement
    return {
        "kind": "phase", "version": LEDGER_VERSION, "run_id": run_id,
        "step": event.step, "phase": event.phase, "k": event.k, "batch": event.batch,
        "rows_active": event.rows_active, "drafted": event.drafted, "accepted": event.accepted,
        "emitted": event.emitted, "verified": event.verified,
        "time_s": m.time_s, "energy_j": m.energy_j, "source": m.source,
        "work": [_forward(s, model_id(s.args)) for s in event.work],
        "emitted_per_row": list(event.emitted_per_row), "slot_requests": list(event.slot_requests),
        "arrivals_s": list(event.arrivals_s), "queued": event.queued, "clock_s": event.clock_s,
        "row_lengths": list(event.row_lengths), "accepted_per_row": list(event.accepted_per_row), **dict(m.extra),
    }


def model_record(args: ModelArgs, model: int, run_id: str) -> dict[str, Any]:
    """The ``model`` record declaring ``args`` as model ``model`` of run ``run_id``."""
    return {"kind": "model", "version": LEDGER_VERSION, "run_id": run_id, "model": model,
            "args": dataclasses.asdict(args)}


def model_args(record: Mapping[str, Any]) -> ModelArgs:
    """The architecture of a ``model`` record (JSON lists back to the tuples ModelArgs holds)."""
    return ModelArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["args"].items()})


def run_models(records: Sequence[Mapping[str, Any]], run_id: str | None) -> dict[int, ModelArgs]:
    """Model id -> architecture of run ``run_id``."""
    return {int(r["model"]): model_args(r) for r in records if r.get("kind") == "model" and r.get("run_id") == run_id}


def phase_work(record: Mapping[str, Any], models: Mapping[int, ModelArgs]) -> tuple[ForwardShape, ...]:
    """The forwards of a phase record, as the shapes they reported (``models``: :func:`run_models`)."""
    return tuple(ForwardShape(args=models[int(f["model"])], **{k: v for k, v in f.items() if k != "model"})
                 for f in record["work"])


def experts_touched(record: Mapping[str, Any]) -> int | None:
    """Distinct experts the phase's mixture-of-experts forwards routed to, summed (None: no MoE forward)."""
    counts = [f["experts_touched"] for f in record["work"] if f.get("experts_touched") is not None]
    return sum(counts) if counts else None


__all__ = ["LEDGER_VERSION", "LedgerError", "RUN_SCHEMA", "MODEL_SCHEMA", "SCHEMA", "LOOP_SCHEMA", "END_SCHEMA",
           "REQUIRED", "problem", "group_key", "phase_record", "model_record", "model_args", "run_models", "phase_work",
           "experts_touched"]
