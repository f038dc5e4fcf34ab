"""Phase vocabulary shared by the engine, the energy meters and the ledger.

The engine brackets every phase of every step with an :class:`EnergyMeter` and hands one
:class:`PhaseEvent` per phase to its observers (the ledger is one). A phase also describes
the work it did as :class:`ForwardShape` records, so an analytic (roofline) meter can model
its time and energy and the ledger can record modelled FLOPs and bytes beside the measured
figures.

Phases: ``prefill`` (prompt forward of target and drafter), ``draft`` (the drafter proposes),
``verify`` (one target forward over the K+1 positions of each row), ``commit`` (acceptance,
bookkeeping, drafter state update) and ``other`` (anything else a caller wants to bracket).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from refspec.config import ModelArgs

PHASES = ("prefill", "draft", "verify", "commit", "other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardShape:
    """One model forward as the analytic cost model sees it.

    Attributes:
        args: architecture of the model that ran (a drafter head passes its own).
        rows: rows in the forward (B, active or not: static shapes compute them all).
        tokens_per_row: query tokens per row (S).
        context_tokens: keys attended, summed over rows (sum of per-row T actually read).
        dtype_bytes: bytes per weight / activation element (4 fp32, 2 bf16).
        lm_head_tokens: tokens that go through the LM head (defaults to rows * S).
        lm_head_rows: rows of the LM head matrix (the vocabulary, or a reduced draft vocab).
        layers: number of decoder layers that ran (defaults to ``args.num_layers``).
        extra_weight_bytes: weights outside the decoder stack read once (e.g. an EAGLE ``fc``).
        extra_flops: FLOPs outside the standard decoder accounting.
        matrix_bytes: bytes per element the block matrices and LM head stream in products of
            2 or more rows, when that differs from ``dtype_bytes``: 4 for a bf16 model on a CPU,
            which multiplies several rows through fp32 copies
            (:class:`~refspec.models.ops.WeightCopy`); one-row products stream
            ``dtype_bytes``.
    """

    args: ModelArgs
    rows: int
    tokens_per_row: int
    context_tokens: int
    dtype_bytes: int
    lm_head_tokens: int | None = None
    lm_head_rows: int | None = None
    layers: int | None = None
    extra_weight_bytes: int = 0
    extra_flops: int = 0
    matrix_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Time and energy of one metered window.

    Attributes:
        time_s: wall time of the window in seconds.
        energy_j: energy in joules, or None when the meter measures time only.
        source: where the energy came from, e.g. ``"measured:nvml-total-energy(gpu0)"`` or
            ``"modelled:roofline(h200-sxm)"`` or ``"none:time-only"``.
    """

    time_s: float
    energy_j: float | None
    source: str

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


class EnergyMeter(Protocol):
    """Brackets a named window; ``end`` returns what the window cost."""

    source: str

    def begin(self, name: str) -> None: ...

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseEvent:
    """What one phase of one step did and cost (one ledger record).

    Attributes:
        step: decode step index (-1 for prefill).
        phase: one of :data:`PHASES`.
        batch: rows in the batch (static shape).
        rows_active: rows still generating when the phase ran.
        drafted: draft tokens proposed to active rows in this step (K per active row).
        accepted: draft tokens accepted in this step, summed over rows.
        emitted: tokens emitted to users in this step (accepted + bonus/recovered, after
            EOS and budget truncation), summed over rows.
        verified: target positions computed for active rows (active rows x (K+1)).
        work: forwards that ran in the phase, for the analytic model.
        measurement: time and energy of the phase.
        emitted_per_row: tokens emitted per row in this step (for TPOT), length ``batch``.
    """

    step: int
    phase: str
    batch: int
    rows_active: int
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    verified: int = 0
    work: tuple[ForwardShape, ...] = ()
    measurement: Measurement
    emitted_per_row: tuple[int, ...] = ()


PhaseObserver = Callable[[PhaseEvent], None]
