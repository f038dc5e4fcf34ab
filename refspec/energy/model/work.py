"""The work a forward did, as the cost model prices it, and how forwards report it.

Billing path: the work of a phase is what its forwards recorded, never a declaration beside
them. A phase opens a :class:`WorkRecorder`; every forward that runs inside it (a target, a
draft model, a drafter head) calls :func:`record_forward` with the :class:`ForwardShape` it
computed from its own tensors (rows, query tokens, keys read, LM-head rows of the logits it
produced); the phase hands exactly that to its meter and to its ledger record. A forward outside
any recorder records nothing. :mod:`refspec.energy.model.roofline` turns a shape into FLOPs,
bytes, time and energy.
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

from refspec.config import ModelArgs


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
