"""Each request's energy and acceptance while it is served, for its response and for ``/metrics``.

:class:`RequestBook` is an engine observer beside the ledger: every phase event is split among
its requests the moment it is reported, by the same rule and code the session's record uses
afterwards (:func:`refspec.energy.accounting.per_request.split_record`: the phase's energy in the roofline's
proportions of its recorded work), and every commit adds each request's accepted drafts. So a
request's response, sent right after its last step, carries the joules the ledger charges it.

A meter that reads each phase (the roofline model, a direct counter) gives each phase its energy
when it ends. A counter that cannot see a phase (NVML, RAPL, the simulated counter) gives it only
when the session's ledger run ends and the counter windows are attributed
(:mod:`refspec.energy.accounting.phase_energy`); until then a response says ``joules`` null, and the
session's record holds every request's figure.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from typing import Any

from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.ledger.format import phase_record
from refspec.energy.accounting.per_request import RequestAcceptance, split_record
from refspec.energy.ledger.events import PhaseEvent

SPLIT_GATES = "not evaluated"
"""What a response says of the split's gates: the per-request split has its closure check
(the session's record: ``request_energy_closes``) but no per-response gate yet."""


def _host_shape(shape: Any) -> Any:
    """``shape`` with a device-tensor field (a GPU MoE forward's experts count) read to the host."""
    fixes = {f.name: getattr(shape, f.name).item() for f in dataclasses.fields(shape)
             if hasattr(getattr(shape, f.name), "item")}
    return dataclasses.replace(shape, **fixes) if fixes else shape


class RequestBook:
    """Per request: joules by phase and the drafts accepted in each verify step; run totals.

    Args:
        profile: the hardware profile whose modelled parts set each phase's split
            (:func:`refspec.energy.accounting.per_request.split_profile`).
        source: the meter's source string (``measured:...`` / ``modelled:...``).
        speculative: a drafter runs (else the acceptance figures are None, as vLLM's are).
        k: the largest K a step may draft.
    """

    def __init__(self, profile: HardwareProfile, *, source: str, speculative: bool, k: int) -> None:
        self.profile, self.source, self.speculative, self.k = profile, source, speculative, k
        self._lock = threading.Lock()
        self._joules: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._steps: dict[int, list[tuple[int, int]]] = defaultdict(list)  # (k, accepted) per verify step
        self.energy_by_phase_j: dict[str, float] = defaultdict(float)
        self.energy_known = True  # every phase so far came with its energy
        self.totals = {"drafted": 0, "accepted": 0, "verify_rows": 0, "emitted": 0}
        self.rows_active = 0

    @property
    def split_method(self) -> str:
        """How a phase's energy is known (the names of :data:`refspec.energy.accounting.phase_energy.METHODS`)."""
        if not self.energy_known:
            return "attributed when the session's ledger run ends (a counter that cannot see a phase)"
        return "modelled" if self.source.startswith("modelled") else "measured-direct"

    def __call__(self, event: PhaseEvent) -> None:
        """Charge one phase to its requests (an engine observer)."""
        with self._lock:
            self.rows_active = event.rows_active if event.phase != "prefill" else self.rows_active
            self.totals["emitted"] += event.emitted
            if event.phase == "verify":
                self.totals["accepted"] += event.accepted
                self.totals["verify_rows"] += event.rows_active
            if event.phase == "draft":
                self.totals["drafted"] += event.drafted
            if event.phase == "commit":
                for rid, acc in zip(event.slot_requests, event.accepted_per_row):
                    if rid >= 0 and acc >= 0:
                        self._steps[rid].append((event.k, acc))
            energy = event.measurement.energy_j
            if energy is None:
                self.energy_known = False
                return
            self.energy_by_phase_j[event.phase] += energy
            record = phase_record(event, "live", lambda args: 0)
            charges, _ = split_record(record, tuple(_host_shape(s) for s in event.work), self.profile)
            for rid, parts in charges.items():
                self._joules[rid][event.phase] += sum(parts.values())

    def energy(self, rid: int) -> dict[str, Any]:
        """The ``usage.energy`` object of request ``rid`` so far (J; ``joules`` None while unknown)."""
        with self._lock:
            phases = dict(self._joules.get(rid, {})) if self.energy_known else None
        return {"joules": None if phases is None else sum(phases.values()), "joules_by_phase": phases,
                "source": self.source, "split_method": self.split_method, "split_profile": self.profile.name,
                "gates": SPLIT_GATES}

    def acceptance(self, rid: int) -> RequestAcceptance:
        """Request ``rid``'s verify steps so far (:class:`~refspec.energy.accounting.per_request.RequestAcceptance`)."""
        with self._lock:
            steps = list(self._steps.get(rid, ()))
        return RequestAcceptance(id=rid, k_per_step=tuple(k for k, _ in steps),
                                 accepted_per_step=tuple(a for _, a in steps))

    def speculative_decoding(self, rid: int) -> dict[str, Any] | None:
        """vLLM's ``metrics.speculative_decoding`` of request ``rid`` (its ``detailed`` level) plus the
        acceptance rate per draft position; None for plain decoding, as vLLM reports it."""
        if not self.speculative:
            return None
        a = self.acceptance(rid)
        drafted = sum(a.k_per_step)
        accepted, offered = a.position_counts(self.k)
        return {"mean_acceptance_length": a.acceptance_length,
                "draft_acceptance_rate": sum(a.accepted_per_step) / drafted if drafted else None,
                "acceptance_histogram": a.histogram(self.k), "num_spec_steps": a.verify_steps,
                "num_accepted_draft_tokens": sum(a.accepted_per_step), "num_draft_tokens": drafted,
                "num_spec_tokens": self.k, "per_step_accepted": list(a.accepted_per_step),
                "per_step_drafted": list(a.k_per_step),
                "acceptance_per_position": [x / o if o else None for x, o in zip(accepted, offered)]}

    def forget(self, rid: int) -> None:
        """Drop request ``rid``'s running figures (the ledger keeps them)."""
        with self._lock:
            self._joules.pop(rid, None)
            self._steps.pop(rid, None)

    def snapshot(self) -> dict[str, Any]:
        """Run totals for ``/metrics``: counts, active rows and J by phase."""
        with self._lock:
            return {**self.totals, "rows_active": self.rows_active,
                    "energy_by_phase_j": dict(self.energy_by_phase_j) if self.energy_known else None}


__all__ = ["RequestBook", "SPLIT_GATES"]
