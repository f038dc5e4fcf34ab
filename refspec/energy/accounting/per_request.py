"""Energy and acceptance per request: what one request cost in a batch, and what its drafts earned.

Joules per request (:func:`split_energy`)
    Every phase record's energy, as the accounting uses it
    (:func:`~refspec.energy.accounting.phase_energy.phase_energy`: modelled, read, or attributed
    from a counter), is split among the requests that took part in the phase. The phase's
    participants are the slots holding a request whose row did work (``slot_requests >= 0`` and
    ``row_lengths > 0``). The roofline model prices the phase's
    recorded forwards part by part (:func:`forward_parts`), and the phase's energy is divided in
    proportion to those modelled parts:

    * ``shared``: the weights read once per forward and the fixed per-forward overhead, divided
      equally among the participants (a request alone in a step pays all of it);
    * ``tokens`` (projection and MLP FLOPs, KV writes, activations) and ``head`` (LM-head
      FLOPs): per computed row; a packed prefill's tokens in proportion to each prompt's length;
    * ``pairs`` (attention FLOPs) and ``keys`` (KV reads): in proportion to the keys each row
      attended (``row_lengths``; a packed prefill's pairs to the prompt length squared).

    A phase without forwards (commit, an n-gram draft) is all ``shared``. Static power follows
    the roofline's binding resource (bytes when memory-bound, FLOPs when compute-bound).

    **Named items**, each priced from the recorded work, never defined as what is left:

    * ``idle_slots``: the per-row parts of the rows a forward computed beyond its participants
      (a static batch's empty or finished slots: compute the engine really performs);
    * ``no_request``: a phase with energy and no participant;
    * ``host``: under a counter, the time its span holds outside every phase record (the
      engine's host work between phases), priced at the run's idle power as the accounting
      prices it (:attr:`~refspec.energy.accounting.phase_energy.PhaseEnergy.host_j`).

    **Closure** is then a check that can fail: requests + named items against the runs' total
    energy (the counter's, under a counter); what is left is the **residual**, reported apart.
    A direct read closes to :data:`~refspec.energy.accounting.headline.CLOSURE_RTOL`; an attributed split
    within its gate's additivity tolerance (the residual is the additivity residual's joules).
    A split that failed its gate charges no request, so it does not close. Shares
    (:attr:`EnergySplit.shares`) are of the total, the named items and the residual included.

Acceptance per request (:func:`request_acceptance`)
    From the engine's per-request accepted drafts per verify step (``RequestResult.accepted_per_step``,
    what its own verify decisions accepted), checked against the ledger: the request's decode
    steps (where its slot did work) must match in number, each count lie in ``0..k`` of the
    step and equal the commit record's ``accepted_per_row``, and every step but its last emit
    accepted + 1 tokens. Histogram over ``0..K``;
    acceptance rate at draft position i = steps accepting at least i drafts / steps that
    offered position i (k >= i), so with a fixed K, tau = 1 + sum of the rates; acceptance
    length = (accepted + steps) / steps.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

from refspec.energy.accounting.headline import CLOSURE_RTOL
from refspec.energy.ledger.format import phase_work, run_models
from refspec.energy.ledger.step_groups import AccountingError, Record, decode_steps, group_steps
from refspec.energy.model.cost import Cost
from refspec.energy.model.hardware import PICO, HardwareProfile, get_profile
from refspec.energy.model.roofline import forward_cost
from refspec.energy.model.work import ForwardShape
from refspec.energy.accounting.phase_energy import phase_energy
from refspec.energy.accounting.split_gate import GATE, GateRule

PARTS = ("shared", "tokens", "head", "pairs", "keys")
UNATTRIBUTED = ("idle_slots", "no_request", "host")
"""The named items: J no request was charged, each priced from the recorded work."""


class PerRequestError(AccountingError):
    """A ledger, or an engine's per-request log, that cannot be split per request."""


# ---- the modelled parts of one forward --------------------------------------------------------
def forward_parts(shape: ForwardShape, profile: HardwareProfile) -> dict[str, float]:
    """The roofline's modelled energy of one forward by part (J, :data:`PARTS`); they sum to
    ``profile.energy_j(cost, profile.time_s(cost))``."""
    try:
        return dict(zip(PARTS, _cached_parts(shape, profile)))
    except TypeError:  # an architecture read back from a ledger may hold a dict (rope scaling): not hashable
        return dict(zip(PARTS, _parts(shape, profile)))


def _parts(shape: ForwardShape, profile: HardwareProfile) -> tuple[float, ...]:
    c: Cost = forward_cost(shape)
    flops = {"tokens": c.linear_flops + c.extra_flops, "head": c.lm_head_flops, "pairs": c.attention_flops}
    moved = {"shared": c.weight_bytes, "tokens": c.kv_write_bytes + c.activation_bytes, "keys": c.kv_read_bytes}
    t_flops, t_bytes = c.flops / profile.peak_flops, c.bytes / profile.bandwidth_Bps
    bound, bound_total = (moved, c.bytes) if t_bytes >= t_flops else (flops, c.flops)  # what the time waits on
    static = profile.static_w * max(t_flops, t_bytes)
    out = dict.fromkeys(PARTS, 0.0)
    out["shared"] += profile.static_w * profile.overhead_s
    for part, n in flops.items():
        out[part] += PICO * profile.pj_per_flop * n
    for part, n in moved.items():
        out[part] += PICO * profile.pj_per_byte * n
    for part, n in bound.items():
        out[part] += static * n / bound_total if bound_total else 0.0
    return tuple(out[p] for p in PARTS)


_cached_parts = functools.lru_cache(maxsize=4096)(_parts)  # a run repeats a handful of shapes thousands of times


def _weights(shape: ForwardShape, lengths: Sequence[int]) -> tuple[dict[str, list[float]], float]:
    """Per participant, the fraction of each per-row part of ``shape`` it did, and the fraction
    the rows beyond the participants did (idle slots)."""
    n = len(lengths)
    active = min(n, shape.rows) / shape.rows  # rows beyond the participants are idle slots

    def share(w: Sequence[float]) -> list[float]:
        total = sum(w)
        return [active * x / total for x in w] if total else [active / n] * n

    equal = [1.0] * n
    return {"tokens": share(lengths if shape.query_tokens is not None else equal), "head": share(equal),
            "pairs": share([x * x for x in lengths] if shape.attention_pairs is not None else lengths),
            "keys": share(lengths)}, 1.0 - active


def participants(record: Record) -> list[tuple[int, int, int]]:
    """``(slot, request id, keys attended)`` of every slot whose request did work in the phase."""
    lengths = record.get("row_lengths")
    if lengths is None or len(lengths) != len(record["slot_requests"]):
        raise PerRequestError(f"run {record.get('run_id')!r} step {record['step']} {record['phase']}: the record has "
                              f"no row_lengths per slot, so its work cannot be charged per request; re-run with "
                              f"this refspec")
    return [(s, int(r), int(n)) for s, (r, n) in enumerate(zip(record["slot_requests"], lengths)) if r >= 0 and n > 0]


def split_record(record: Record, work: Sequence[ForwardShape], profile: HardwareProfile
                 ) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """One phase record's energy split: per request id its J by part, and the named items' J
    (``idle_slots``: the per-row parts of rows beyond the participants; ``no_request``)."""
    energy = float(record["energy_j"])
    who = participants(record)
    if not who:
        return {}, {"no_request": energy}
    modelled = dict.fromkeys(PARTS, 0.0)
    per_row = [dict.fromkeys(PARTS, 0.0) for _ in who]
    idle = 0.0  # modelled J of the idle rows' per-row parts
    for shape in work:
        parts = forward_parts(shape, profile)
        for part, e in parts.items():
            modelled[part] += e
        fractions, idle_fraction = _weights(shape, [n for _, _, n in who])
        for part, row_fractions in fractions.items():
            idle += parts[part] * idle_fraction
            for row, f in zip(per_row, row_fractions):
                row[part] += parts[part] * f
    total = sum(modelled.values())
    scale = energy / total if total > 0 else 0.0  # the record's energy, in the model's proportions
    out: dict[int, dict[str, float]] = {}
    shared = (modelled["shared"] * scale if total > 0 else energy) / len(who)
    for (_, rid, _), row in zip(who, per_row):
        mine = {part: row[part] * scale for part in PARTS}
        mine["shared"] = shared
        out[rid] = mine
    return out, {"idle_slots": idle * scale}


# ---- joules per request -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestEnergy:
    """What one request was charged (J).

    Attributes:
        id: the request.
        energy_j: its total.
        by_phase_j: per phase (prefill, draft, verify, commit, other).
        by_part_j: per part (:data:`PARTS`).
    """

    id: int
    energy_j: float
    by_phase_j: dict[str, float]
    by_part_j: dict[str, float]


@dataclasses.dataclass(frozen=True)
class EnergySplit:
    """The runs' energy split among their requests and named items, and its closure.

    Attributes:
        requests: per request id, its charges.
        unattributed_j: per named item (:data:`UNATTRIBUTED`), J, each priced from the recorded work.
        total_j: the runs' energy as the accounting counts it (the counter's under a counter).
        closure_error_j: the residual, requests + named items - total, J.
        closes: the residual is within ``tolerance`` of the total.
        profile: the hardware profile whose modelled parts set the proportions.
        method: how the phases' energy was known (modelled, measured-direct, attributed-...).
        tolerance: the relative residual closure allows (exact for a direct read, the gate's
            additivity tolerance for an attributed split).
        split_gate_reasons: why the phase split failed its gate (empty when it passed or was read).
    """

    requests: dict[int, RequestEnergy]
    unattributed_j: dict[str, float]
    total_j: float
    closure_error_j: float
    closes: bool
    profile: str
    method: str | None
    tolerance: float = CLOSURE_RTOL
    split_gate_reasons: tuple[str, ...] = ()

    @property
    def unattributed_share(self) -> float:
        """The named items' share of the total."""
        return sum(self.unattributed_j.values()) / self.total_j if self.total_j else math.nan

    @property
    def shares(self) -> dict[str, float]:
        """Shares of the total: ``requests`` (all of them), each named item, and ``residual``
        (total - requests - items); they add up to 1."""
        if not self.total_j:
            return {}
        out = {"requests": sum(r.energy_j for r in self.requests.values()) / self.total_j}
        out.update({name: e / self.total_j for name, e in self.unattributed_j.items()})
        out["residual"] = -self.closure_error_j / self.total_j
        return out


def _runs(records: Sequence[Record], run_ids: Sequence[str]) -> list[tuple[list[Record], list[Record], list[Record]]]:
    out = []
    for rid in run_ids:
        mine = [r for r in records if r.get("run_id") == rid]
        out.append(tuple([r for r in mine if r.get("kind") == kind] for kind in ("phase", "counter", "loop")))
    if not any(p for p, _, _ in out):
        raise PerRequestError(f"no phase records for runs {list(run_ids)}")
    return out  # type: ignore[return-value]


def _idle_w(records: Sequence[Record], run_ids: Sequence[str]) -> float | None:
    """The runs' idle power from their headers, the host time's price (as the accounting takes it)."""
    values = {r.get("idle_w") for r in records if r.get("kind") == "run" and r.get("run_id") in set(run_ids)}
    if len(values) > 1:
        raise PerRequestError(f"runs {list(run_ids)} disagree on idle power {sorted(values, key=str)}")
    return values.pop() if values else None


def split_energy(records: Sequence[Record], run_ids: Sequence[str], profile: HardwareProfile, *,
                 rule: GateRule = GATE) -> EnergySplit | None:
    """Split the energy of ``run_ids`` among their requests (rule: the module docstring).

    Args:
        records: ledger records holding the runs (``read_ledger``).
        run_ids: the runs of one configuration (request ids are unique across them).
        profile: the hardware profile whose modelled parts set the proportions (:func:`split_profile`).
        rule: the phase split's gate (the accounting's by default).

    Returns:
        The :class:`EnergySplit`, or None when the ledger holds no energy (time-only meter).

    Raises:
        PerRequestError: a phase record without ``row_lengths``, no phase records, or runs whose
            headers disagree on idle power.
    """
    runs = _runs(records, run_ids)
    pe = phase_energy(runs, host_w=_idle_w(records, run_ids), rule=rule)
    if pe.total_j is None:
        return None
    by_phase: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_part: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PARTS, 0.0))
    items = dict.fromkeys(UNATTRIBUTED, 0.0)
    items["host"] = pe.host_j or 0.0
    for rid, phases in zip(run_ids, pe.records):
        models = run_models(records, rid)
        for rec in phases:
            charges, named = split_record(rec, phase_work(rec, models), profile)
            for req, parts in charges.items():
                by_phase[req][str(rec["phase"])] += sum(parts.values())
                for part, e in parts.items():
                    by_part[req][part] += e
            for name, e in named.items():
                items[name] += e
    reqs = {q: RequestEnergy(id=q, energy_j=sum(by_part[q].values()), by_phase_j=dict(by_phase[q]),
                             by_part_j=dict(by_part[q])) for q in sorted(by_part)}
    total = float(pe.total_j)
    error = sum(r.energy_j for r in reqs.values()) + sum(items.values()) - total
    direct = pe.split_gate is None  # read per phase: exact; attributed: within the gate's additivity
    tolerance = CLOSURE_RTOL if direct else rule.additivity
    bound = tolerance * (max(1.0, abs(total)) if direct else abs(total))
    return EnergySplit(requests=reqs, unattributed_j=items, total_j=total, closure_error_j=error,
                       closes=abs(error) <= bound, profile=profile.name, method=pe.method, tolerance=tolerance,
                       split_gate_reasons=() if direct else pe.split_gate.reasons)


def split_profile(profile: HardwareProfile | None, sources: Iterable[str]) -> HardwareProfile:
    """The profile that sets a split's proportions: ``profile`` when given, else the roofline
    profile a ``modelled:roofline(<name>)`` source names, else this CPU's (benchmarked once)."""
    if profile is not None:
        return profile
    for source in sources:
        if m := re.match(r"modelled:roofline\(([^,)]+)", source):
            return get_profile(m.group(1))
    return get_profile("cpu")


# ---- acceptance per request -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestAcceptance:
    """One request's verify steps: drafts offered (k) and accepted in each.

    Attributes:
        id: the request.
        k_per_step: drafts the policy asked for in each decode step it rode.
        accepted_per_step: drafts its own verify decision accepted in each (before any EOS or
            budget cut of the emitted tokens).
    """

    id: int
    k_per_step: tuple[int, ...]
    accepted_per_step: tuple[int, ...]

    @property
    def verify_steps(self) -> int:
        return len(self.accepted_per_step)

    def histogram(self, k_max: int) -> list[int]:
        """Steps that accepted 0, 1, ..., ``k_max`` drafts."""
        out = [0] * (k_max + 1)
        for a in self.accepted_per_step:
            out[a] += 1
        return out

    def position_counts(self, k_max: int) -> tuple[list[int], list[int]]:
        """Per draft position 1..``k_max``: steps accepting at least that many drafts, steps offering it."""
        accepted = [sum(a >= i for a in self.accepted_per_step) for i in range(1, k_max + 1)]
        offered = [sum(k >= i for k in self.k_per_step) for i in range(1, k_max + 1)]
        return accepted, offered

    @property
    def acceptance_length(self) -> float | None:
        """(accepted + steps) / steps: tokens per verify step, the bonus included (None without a step)."""
        n = self.verify_steps
        return (sum(self.accepted_per_step) + n) / n if n else None


def rates(accepted: Sequence[int], offered: Sequence[int]) -> list[float | None]:
    """Acceptance rate per draft position (None where no step offered the position)."""
    return [a / o if o else None for a, o in zip(accepted, offered)]


def _ledger_rows(records: Sequence[Record], run_ids: Sequence[str]
                 ) -> dict[int, list[tuple[int, int, int, int | None]]]:
    """Per request, ``(step, k, emitted, accepted)`` of each decode step its slot did work in, from
    the ledger (``accepted`` from the commit record's ``accepted_per_row``, None where absent)."""
    out: dict[int, list[tuple[int, int, int, int | None]]] = defaultdict(list)
    for run in run_ids:
        phases = [r for r in records if r.get("run_id") == run and r.get("kind") == "phase"]
        for st in decode_steps(group_steps(run, phases)):
            k = max(int(r.get("k", 0) or 0) for r in st.records)
            per_row = next((r["accepted_per_row"] for r in st.records if r.get("accepted_per_row")), None)
            for slot, rid, _ in participants(st.records[0]):
                out[rid].append((st.index, k, st.emitted(slot), None if per_row is None else int(per_row[slot])))
    return out


def request_acceptance(records: Sequence[Record], run_ids: Sequence[str],
                       accepted: Mapping[int, Sequence[int]]) -> dict[int, RequestAcceptance]:
    """Each request's acceptance, the engine's per-request counts checked against the ledger.

    Args:
        records: ledger records holding ``run_ids``.
        run_ids: the runs of one configuration.
        accepted: per request id, the drafts its verify decisions accepted in each decode step
            it rode (``RequestResult.accepted_per_step``).

    Returns:
        Per request id (those of ``accepted``), its :class:`RequestAcceptance`.

    Raises:
        PerRequestError: the two disagree: a request the engine does not know, another number
            of steps, a count outside ``0..k``, or a step before the last that did not emit
            accepted + 1 tokens.
    """
    rows = _ledger_rows(records, run_ids)
    if unknown := sorted(set(rows) - set(accepted)):
        raise PerRequestError(f"runs {list(run_ids)}: the ledger has decode steps of requests {unknown[:5]} that the "
                              f"engine's per-request counts lack")
    out = {}
    for rid, counts in sorted(accepted.items()):
        steps = rows.get(rid, [])
        if len(steps) != len(counts):
            raise PerRequestError(f"request {rid}: the engine counted {len(counts)} verify steps, the ledger shows its "
                                  f"slot working in {len(steps)} decode steps")
        for i, ((step, k, emitted, logged), a) in enumerate(zip(steps, counts)):
            last = i == len(steps) - 1
            if not 0 <= a <= k or (emitted != a + 1 if not last else emitted > a + 1) or logged not in (None, a):
                raise PerRequestError(f"request {rid}, step {step}: {a} drafts accepted of k={k}, but the ledger "
                                      f"records {emitted} tokens emitted in its slot and {logged} accepted")
        out[rid] = RequestAcceptance(id=rid, k_per_step=tuple(k for _, k, _, _ in steps),
                                     accepted_per_step=tuple(int(a) for a in counts))
    return out


def pooled_acceptance(requests: Iterable[RequestAcceptance], k_max: int) -> dict[str, Any]:
    """The configuration's acceptance over its requests: histogram over ``0..k_max``, rate per
    position (pooled counts), and tau = 1 + accepted / steps."""
    reqs = list(requests)
    hist = [sum(col) for col in zip(*(r.histogram(k_max) for r in reqs))] if reqs else [0] * (k_max + 1)
    pairs = [r.position_counts(k_max) for r in reqs]
    acc = [sum(p[0][i] for p in pairs) for i in range(k_max)]
    offered = [sum(p[1][i] for p in pairs) for i in range(k_max)]
    steps = sum(hist)
    tau = (sum(i * n for i, n in enumerate(hist)) + steps) / steps if steps else None
    return {"histogram": hist, "per_position": rates(acc, offered), "tau": tau}
