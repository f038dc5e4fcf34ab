"""Serving figures of ledger runs: the steady-state window, active rows, and each request's latencies.

Read from ledger records alone (grouped by :func:`refspec.energy.ledger.step_groups.group_steps`);
:mod:`refspec.energy.accounting.headline` puts them in its :class:`~refspec.energy.accounting.headline.Accounting`.
A run written to no ledger (the GPU check's) reads its phase events as those records
(:func:`event_steps`), so every figure below has this one definition.

Steady-state window
    Decode steps ``[s0, s1)``: ``s0`` is the first decode step with every slot busy (no -1 in
    ``slot_requests`` and ``rows_active == batch``); ``s1`` is the first decode step after
    ``s0`` with an empty slot while ``queued == 0`` (the stream could no longer refill it),
    else one past the last step. The window's time, energy and tokens are those of every
    record with ``s0 <= step < s1``: decode phases and the refill prefills that ran after
    those steps. J/token of the window = its energy / its tokens. Without an ``s0`` (never
    every slot busy) the window is empty: its figures are NaN and :attr:`Window.note` says why.
    Runs pool by adding their windows.

    Under a counter that cannot see a phase, the window is what the counter read over it: it
    shrinks to the steps between the first and the last counter read inside it (reads fall at
    step bounds), and its energy is the counter difference between those two reads (host time
    included), not a sum of attributed phase energies. Fewer than two reads inside: the
    window's energy is its records' attributed energy, and the window is invalid.

Validity
    A window is valid (:func:`window_validity`) when it is not empty, its mean active rows reach
    ``min_fill`` (0.85) of the batch, and, when a counter read its energy, it lasts at least
    ``min_s`` (20 s, ML.ENERGY's rule; ``time_s``) and, under a counter that cannot see a phase,
    the counter was read at least twice inside it (a modelled window's energy is exact at any
    length).
    Pooled windows are judged pooled.

Mean active rows
    Time-weighted over decode steps: ``sum(rows_active x step time) / sum(step time)``, the
    step time being its decode phases' (refill prefills excluded); over the whole run, and
    over the window's decode steps.

Per request
    Its slot and arrival come from the prefill that admitted it (``arrivals_s``: the given
    arrival in open loop, the admission time in closed loop). Its emissions, what a streaming
    client sees: the prefill's end (``clock_s + time_s``, the first token), then the end of
    the commit of every decode step that emitted tokens in its slot while the slot held it.
    TTFT = first emission - arrival (queueing included); end-to-end = last emission -
    arrival; TPOT = (last - first emission) / (tokens - 1), none for one token; ITL = the gaps
    between successive emissions (per step, not per token). Percentiles are linear-interpolated
    over requests (ITL: over every gap of every request).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.ledger.format import phase_record
from refspec.energy.ledger.step_groups import AccountingError, Step, decode_steps, group_steps

NAN = math.nan


@dataclasses.dataclass(frozen=True)
class RequestTimes:
    """One request's emissions on the engine clock (s).

    Attributes:
        id: request id.
        slot: the slot that served it.
        arrival_s: its arrival (closed loop: its admission).
        emissions_s: when each emission became visible (prefill end, then commit ends).
        emission_tokens: tokens in each emission.
    """

    id: int
    slot: int
    arrival_s: float
    emissions_s: tuple[float, ...]
    emission_tokens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.emission_tokens)

    @property
    def ttft_s(self) -> float:
        return self.emissions_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.emissions_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        return (self.emissions_s[-1] - self.emissions_s[0]) / (self.tokens - 1) if self.tokens > 1 else None

    @property
    def itl_s(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self.emissions_s, self.emissions_s[1:]))


@dataclasses.dataclass(frozen=True)
class Window:
    """The steady-state window of one run, or of several pooled (figures NaN when empty).

    Attributes:
        bounds: per run, ``(s0, s1)`` with ``s1`` exclusive, or None for an empty window.
        steps: decode steps in the window(s).
        time_s: time of every record in the window (s).
        decode_time_s: time of its decode phases (s), the weight of its mean active rows.
        energy_j: energy of every record in the window (J); None without energy.
        tokens: tokens emitted in the window (refill prefills' first tokens included).
        mean_active_rows: time-weighted mean of ``rows_active`` over its decode steps.
        note: why the window is empty (None when it is not).
        counter_reads: counter reads the window's energy spans (0: summed from its records).
    """

    bounds: tuple[tuple[int, int] | None, ...]
    steps: int
    time_s: float
    decode_time_s: float
    energy_j: float | None
    tokens: float
    mean_active_rows: float
    note: str | None = None
    counter_reads: int = 0

    @property
    def empty(self) -> bool:
        return self.steps == 0

    @property
    def j_per_token(self) -> float | None:
        """Window energy / window tokens (NaN when empty, None without energy)."""
        if self.energy_j is None:
            return None
        return self.energy_j / self.tokens if self.tokens and not self.empty else NAN

    @property
    def first_step(self) -> int | None:
        """``s0`` of the only run (None when empty or pooled)."""
        return self.bounds[0][0] if len(self.bounds) == 1 and self.bounds[0] else None

    @property
    def last_step(self) -> int | None:
        """``s1 - 1``, the last decode step inside the window of the only run (None when empty or pooled)."""
        return self.bounds[0][1] - 1 if len(self.bounds) == 1 and self.bounds[0] else None


def _weighted_rows(decode: Sequence[Step]) -> float:
    time = sum(st.time_s for st in decode)
    return sum(st.rows_active * st.time_s for st in decode) / time if time > 0 else NAN


def mean_active_rows(steps: Sequence[Step]) -> float:
    """Time-weighted mean of ``rows_active`` over every decode step of ``steps`` (NaN without decode time)."""
    return _weighted_rows(decode_steps(steps))


def _full(st: Step) -> bool:
    return bool(st.slot_requests) and -1 not in st.slot_requests and st.rows_active >= len(st.slot_requests)


def window_bounds(steps: Sequence[Step]) -> tuple[int, int] | None:
    """``(s0, s1)`` of one run's steady-state window (``s1`` exclusive), or None when it is empty."""
    decode = decode_steps(steps)
    s0 = next((st.index for st in decode if _full(st)), None)
    if s0 is None:
        return None
    s1 = next((st.index for st in decode if st.index > s0 and not _full(st) and st.queued == 0),
              decode[-1].index + 1)
    return s0, s1


def event_steps(events: Sequence[PhaseEvent]) -> list[Step]:
    """A run's phase events grouped as its ledger's records would be (for a run written to no ledger)."""
    return group_steps(None, [phase_record(e, "events", lambda args: 0) for e in events])  # work is not read here


def _empty(bounds: tuple[None, ...], note: str) -> Window:
    return Window(bounds=bounds, steps=0, time_s=NAN, decode_time_s=NAN, energy_j=NAN, tokens=NAN,
                  mean_active_rows=NAN, note=note)


EPS_S = 1e-9
"""Clock tolerance: a counter read at a phase's end sits on the clock the next phase starts at."""


def _counter_span(inside: list[Step], counters: Sequence[Mapping[str, Any]]) -> tuple[list[Step], float | None, int]:
    """The steps of ``inside`` between the first and last counter read within it, their energy and the reads."""
    start, end = min(float(r["clock_s"]) for st in inside for r in st.records), max(st.end_s for st in inside)
    reads = sorted((float(c["clock_s"]), float(c["energy_j"])) for c in counters
                   if start - EPS_S <= float(c["clock_s"]) <= end + EPS_S)
    if len(reads) < 2:
        return inside, None, len(reads)
    (a, ea), (b, eb) = reads[0], reads[-1]
    span = [st for st in inside if min(float(r["clock_s"]) for r in st.records) >= a - EPS_S and st.end_s <= b + EPS_S]
    return span, eb - ea, len(reads)


def run_window(steps: Sequence[Step], counters: Sequence[Mapping[str, Any]] = ()) -> Window:
    """The steady-state window of one run (see the module docstring); ``counters``: its counter records."""
    bounds = window_bounds(steps)
    if bounds is None:
        return _empty((None,), "no decode step had every slot busy: no steady state, the window is empty")
    inside = [st for st in steps if bounds[0] <= st.index < bounds[1]]
    measured, reads = None, 0
    if counters:
        inside, measured, reads = _counter_span(inside, counters)
    decode = [st for st in inside if st.decode]
    if not decode:
        return _empty((None,), "no whole decode step between two counter reads inside the steady state")
    energies = [st.energy_j for st in inside]
    summed = None if any(e is None for e in energies) else sum(energies)  # type: ignore[arg-type]
    return Window(bounds=((decode[0].index, decode[-1].index + 1),), steps=len(decode),
                  time_s=sum(st.time_s for st in inside), decode_time_s=sum(st.time_s for st in decode),
                  energy_j=summed if measured is None else measured, tokens=sum(st.counts["emitted"] for st in inside),
                  mean_active_rows=_weighted_rows(decode), counter_reads=reads)


def pool_windows(windows: Sequence[Window]) -> Window:
    """Several runs' windows as one: times, energies and tokens add; active rows weighted by decode time."""
    bounds = tuple(b for w in windows for b in w.bounds)
    full = [w for w in windows if not w.empty]
    if not full:
        notes = sorted({w.note for w in windows if w.note})
        return _empty(bounds, "; ".join(notes) or "no window")  # type: ignore[arg-type]
    if len(full) == 1 and len(windows) == 1:
        return full[0]
    decode_time = sum(w.decode_time_s for w in full)
    energies = [w.energy_j for w in full]
    return Window(bounds=bounds, steps=sum(w.steps for w in full), time_s=sum(w.time_s for w in full),
                  decode_time_s=decode_time,
                  energy_j=None if any(e is None for e in energies) else sum(energies),  # type: ignore[arg-type]
                  tokens=sum(w.tokens for w in full),
                  mean_active_rows=(sum(w.mean_active_rows * w.decode_time_s for w in full) / decode_time
                                    if decode_time > 0 else NAN), counter_reads=min(w.counter_reads for w in full))


@dataclasses.dataclass(frozen=True)
class WindowRule:
    """When a steady-state window is long and full enough to trust (ML.ENERGY's defaults).

    Attributes:
        min_s: shortest valid window, s (its ``time_s``).
        min_fill: least valid mean active rows, as a fraction of the batch.
    """

    min_s: float = 20.0
    min_fill: float = 0.85


def window_validity(window: Window, batch: int, rule: WindowRule = WindowRule(), *,
                    counter: bool = False, measured: bool = False) -> tuple[bool, str | None]:
    """Whether ``window`` is valid under ``rule``, and why not (every failed condition, "; "-joined).

    Args:
        window: the (pooled) window.
        batch: the static batch B.
        rule: the thresholds.
        counter: the energy came from a counter that cannot see a phase: the window needs two
            counter reads inside it.
        measured: the energy was read from a counter (the length rule is the counter's: a
            modelled window's energy is exact at any length, so only the fill rule applies).
    """
    if window.empty:
        return False, f"empty window ({window.note})"
    why = []
    if (counter or measured) and window.time_s < rule.min_s:
        why.append(f"window {window.time_s:.3g} s < {rule.min_s:g} s")
    if window.mean_active_rows < rule.min_fill * batch:
        why.append(f"mean active rows {window.mean_active_rows:.3g} < {rule.min_fill:g} x batch {batch}")
    if counter and window.counter_reads < 2:
        why.append("the counter was read fewer than twice inside the window: its energy is attributed, not read")
    return not why, "; ".join(why) or None


def _admit(reqs: dict[int, dict[str, Any]], st: Step, run_id: str | None) -> None:
    for slot, rid in enumerate(st.slot_requests):
        if rid < 0:
            continue
        if rid in reqs:
            raise AccountingError(f"run {run_id!r}: request {rid} is prefilled twice (step {st.index})")
        arrival = st.arrivals_s[slot] if slot < len(st.arrivals_s) else NAN
        reqs[rid] = {"slot": slot, "arrival": float(arrival), "times": [st.end_s], "tokens": [st.emitted(slot) or 1]}


def request_times(steps: Sequence[Step], run_id: str | None = None) -> list[RequestTimes]:
    """Every request of one run, in id order.

    Raises:
        AccountingError: a request prefilled twice, or tokens emitted in a slot for a request
            it never admitted.
    """
    reqs: dict[int, dict[str, Any]] = {}
    for st in sorted(steps, key=lambda s: (s.index, s.prefill)):  # a refill runs after its step's commit
        if st.prefill:
            _admit(reqs, st, run_id)
            continue
        for slot, rid in enumerate(st.slot_requests):
            n = st.emitted(slot)
            if rid < 0 or n <= 0:
                continue
            if rid not in reqs or reqs[rid]["slot"] != slot:
                raise AccountingError(f"run {run_id!r}: step {st.index} emits for request {rid} in slot {slot}, "
                                      f"which no prefill admitted there")
            reqs[rid]["times"].append(st.end_s)
            reqs[rid]["tokens"].append(n)
    return [RequestTimes(id=rid, slot=r["slot"], arrival_s=r["arrival"], emissions_s=tuple(r["times"]),
                         emission_tokens=tuple(r["tokens"])) for rid, r in sorted(reqs.items())]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) of ``values``, linear-interpolated; None when there is none."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def latency_percentiles(requests: Sequence[RequestTimes]) -> dict[str, float | None]:
    """p50 and p99 of TTFT, TPOT, ITL and end-to-end over ``requests`` (None where there is none)."""
    tpot = [t for r in requests if (t := r.tpot_s) is not None]
    series = {"ttft": [r.ttft_s for r in requests], "tpot": tpot,
              "itl": [g for r in requests for g in r.itl_s], "e2e": [r.e2e_s for r in requests]}
    return {f"{name}_p{q}_s": percentile(values, q) for name, values in series.items() for q in (50, 99)}


__all__ = ["RequestTimes", "Window", "WindowRule", "window_validity", "mean_active_rows", "window_bounds",
           "event_steps", "run_window", "pool_windows", "request_times", "percentile", "latency_percentiles"]
