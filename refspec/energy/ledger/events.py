"""Phase vocabulary shared by the engine, the energy meters and the ledger.

The engine brackets every phase of every step with an :class:`EnergyMeter` and hands one
:class:`PhaseEvent` per phase to its observers (the ledger is one). A phase also describes
the work it did as :class:`ForwardShape` records, so an analytic (roofline) meter can model
its time and energy and the ledger can record modelled FLOPs and bytes beside the measured
figures.

Billing path: the work of a phase is what its forwards recorded, never a declaration beside
them. :class:`MeteredPhase` opens the meter window and a :class:`WorkRecorder`; every forward
that runs inside it (a target, a draft model, a drafter head) calls :func:`record_forward`
with the :class:`ForwardShape` it computed from its own tensors (rows, query tokens, keys
read, LM-head rows of the logits it produced); closing the phase hands exactly that to
``meter.end`` and to the :class:`PhaseEvent`. A forward outside any phase records nothing.

Phases: ``prefill`` (prompt forward of target and drafter), ``draft`` (the drafter proposes),
``verify`` (one target forward over the K+1 positions of each row), ``commit`` (acceptance,
bookkeeping, drafter state update) and ``other`` (anything else a caller wants to bracket).
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Protocol

from refspec.config import ModelArgs

PHASES = ("prefill", "draft", "verify", "commit", "other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardShape:
    """One model forward as the analytic cost model sees it.

    Attributes:
        args: architecture of the model that ran (a drafter head passes its own).
        rows: rows in the forward (B, active or not: static shapes compute them all).
        tokens_per_row: query tokens per row (S).
        context_tokens: keys read by each full-attention layer, summed over rows (refspec's
            dense masked attention reads and multiplies the whole attended prefix Tk per row).
        dtype_bytes: bytes per weight / activation element (4 fp32, 2 bf16).
        sliding_context_tokens: keys read by each sliding-window layer, summed over rows; None
            caps the per-row mean of ``context_tokens`` at the window (an attention that skips
            keys outside it, as predictions assume).
        lm_head_tokens: tokens that go through the LM head (defaults to rows * S).
        lm_head_rows: rows of the LM head matrix (the vocabulary, or a reduced draft vocab).
        layers: number of decoder layers that ran (defaults to ``args.num_layers``).
        extra_weight_bytes: weights outside the decoder stack read once (e.g. an EAGLE ``fc``).
        extra_flops: FLOPs outside the standard decoder accounting.
        matrix_bytes: bytes per element the block matrices and LM head stream in products of
            2 or more rows, when that differs from ``dtype_bytes``: 4 for a bf16 model on a CPU,
            which multiplies several rows through fp32 copies
            (:class:`~refspec.models.cpu_speed.WeightCopy`); one-row products stream
            ``dtype_bytes``.
        experts_touched: distinct experts a mixture-of-experts forward routed to, summed over
            its MoE layers (the expert bytes it read); None for a dense model or a prediction,
            whose expert reads the cost model takes as the expectation over uniform routing. A
            GPU forward hands it on as a 0-dim device tensor (no host sync), read after the step.
        query_tokens: query tokens of a ragged forward (a packed prefill of prompts of
            different lengths), summed over rows; None: ``rows * tokens_per_row``.
        attention_pairs: (query, key) pairs one full-attention layer computes, summed over
            rows; None: ``tokens_per_row * context_tokens`` (every query of a row sees the
            row's whole attended prefix).
        sliding_attention_pairs: the same for a sliding-window layer; None: derived as for
            ``sliding_context_tokens``.
    """

    args: ModelArgs
    rows: int
    tokens_per_row: int
    context_tokens: int
    dtype_bytes: int
    sliding_context_tokens: int | None = None
    lm_head_tokens: int | None = None
    lm_head_rows: int | None = None
    layers: int | None = None
    extra_weight_bytes: int = 0
    extra_flops: int = 0
    matrix_bytes: int | None = None
    experts_touched: int | None = None
    query_tokens: int | None = None
    attention_pairs: int | None = None
    sliding_attention_pairs: int | None = None


class WorkRecorder:
    """The :class:`ForwardShape` of every forward run while it is open (a context manager).

    Recorders nest; a forward records into the innermost open one only, so a phase's work is
    exactly the forwards run inside it.
    """

    def __init__(self) -> None:
        self._shapes: list[ForwardShape] = []
        self._token: contextvars.Token | None = None

    def add(self, shape: ForwardShape) -> None:
        """Append one forward's shape."""
        self._shapes.append(shape)

    @property
    def work(self) -> tuple[ForwardShape, ...]:
        """The shapes recorded so far, in the order the forwards ran."""
        return tuple(self._shapes)

    def __enter__(self) -> "WorkRecorder":
        assert self._token is None, "a WorkRecorder is open already"
        self._token = _OPEN.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None, "__exit__ without __enter__"
        _OPEN.reset(self._token)
        self._token = None


_OPEN: contextvars.ContextVar[WorkRecorder | None] = contextvars.ContextVar("refspec_work_recorder", default=None)


def recording() -> bool:
    """Whether a :class:`WorkRecorder` is open (forwards skip building shapes otherwise)."""
    return _OPEN.get() is not None


def record_forward(shape: ForwardShape) -> None:
    """Called by a forward with the shape it computed: appended to the innermost open recorder."""
    rec = _OPEN.get()
    if rec is not None:
        rec.add(shape)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Time and energy of one metered window.

    Attributes:
        time_s: wall time of the window in seconds.
        energy_j: energy in joules, or None when the meter measures time only.
        source: where the energy came from, e.g. ``"measured:nvml-total-energy(gpu0)"`` or
            ``"modelled:roofline(h200-sxm)"`` or ``"none:time-only"``.
        extra: further figures of the window the meter knows, as ``(field, value)`` pairs the
            ledger copies into the phase record (a simulated counter's ``energy_true_j``).
    """

    time_s: float
    energy_j: float | None
    source: str
    extra: tuple[tuple[str, Any], ...] = ()

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
        step: decode step index; a prefill's is the decode step after which it ran (-1 for the
            first fill).
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
        slot_requests: request id in each slot during the phase (-1 empty), length ``batch``;
            on a prefill, the ids being prefilled in their slots and -1 elsewhere (empty when
            the caller tracks no requests).
        arrivals_s: prefill only, length ``batch``: arrival time of each prefilled request
            (closed loop: its admission time), -1.0 elsewhere.
        queued: requests of the stream not yet admitted, after this phase.
        clock_s: engine clock at the phase's start (s).
        k: drafts asked of the drafter this step (the speculation policy's choice; 0 on a
            prefill and in plain decoding).
        row_lengths: per slot, length ``batch``: the keys of its own sequence the slot's
            queries attend in this phase (a prefill: its prompt length; a decode step: its
            committed length plus the step's positions), 0 for an empty or finished slot;
            what per-row work is charged by (empty when the caller tracks none).
        accepted_per_row: commit only, length ``batch``: drafts each slot accepted in the step,
            -1 where no request was generating (per-request acceptance read from the ledger).
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
    slot_requests: tuple[int, ...] = ()
    arrivals_s: tuple[float, ...] = ()
    queued: int = 0
    clock_s: float = 0.0
    k: int = 0
    row_lengths: tuple[int, ...] = ()
    accepted_per_row: tuple[int, ...] = ()


PhaseObserver = Callable[[PhaseEvent], None]


class MeteredPhase:
    """One metered phase: ``with MeteredPhase(meter, "verify") as phase: ...`` opens the meter
    window and a :class:`WorkRecorder`; on exit the recorded work goes to ``meter.end``.

    Attributes:
        name: the phase name.
        work: forwards recorded inside the phase (set on exit).
        measurement: what the meter returned (set on exit).
    """

    def __init__(self, meter: EnergyMeter, name: str) -> None:
        self.meter, self.name = meter, name
        self._recorder = WorkRecorder()
        self.work: tuple[ForwardShape, ...] = ()
        self.measurement: Measurement | None = None

    def __enter__(self) -> "MeteredPhase":
        self.meter.begin(self.name)
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recorder.__exit__(*exc)
        self.work = self._recorder.work
        self.measurement = self.meter.end(self.name, self.work)  # also on error: no window stays open
