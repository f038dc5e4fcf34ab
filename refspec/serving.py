"""Serving types: a stream of requests, what each one got, and what a served run did.

:meth:`refspec.engine.Engine.serve` keeps ``batch`` static slots busy: when a slot's request
finishes (EOS or budget), the next admissible request of the stream is prefilled into it.
Times are on the engine clock: 0 at the start of ``serve``, advanced by every phase's
measured (or modelled) time, and jumped forward to the next arrival when every slot is
empty in an open-loop stream (see ``docs/serving.md``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Protocol, Sequence

from refspec.energy.ledger.events import PhaseEvent


class DecodeFigures:
    """``tau`` and ``num_emitted`` of a decode result: one definition for
    :class:`Generation` and :class:`ServeResult`.

    A subclass holds ``accepted_per_step`` (``[steps][B]``, -1 where the row held no live
    request) and returns its emitted tokens, per row or per request, from ``_token_lists``.
    """

    def _token_lists(self) -> Iterable[Sequence[int]]:
        raise NotImplementedError

    @property
    def tau(self) -> float:
        """Mean accepted + 1 over the slot-steps that carried a live request (NaN without one), as the
        accounting defines it."""
        from refspec.energy.accounting.headline import tau_of_steps

        return tau_of_steps(self.accepted_per_step)  # type: ignore[attr-defined]

    @property
    def num_emitted(self) -> int:
        """Tokens emitted over every row or request (the first token, from prefill, included)."""
        return sum(len(t) for t in self._token_lists())


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a stream.

    Attributes:
        id: unique, >= 0; requests are admitted in id order.
        prompt: prompt token ids (at least one).
        max_new_tokens: budget, including the first token from prefill.
        arrival_s: engine-clock arrival (open loop); None = closed loop: the request arrives
            when a slot frees for it (its admission), or, from a :class:`RequestSource`, when
            the engine takes it.
        ignore_eos: keep generating past an end-of-sequence token until the budget (a
            benchmark client asking for a fixed output length).
    """

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float | None = None
    ignore_eos: bool = False


class RequestSource(Protocol):
    """Requests that arrive while the engine runs (a server's queue): the engine takes them
    between steps and waits on it when every slot is empty."""

    def take(self, *, wait: bool) -> list[Request] | None:
        """The requests that arrived since the last call, in increasing id order.

        Args:
            wait: block until at least one arrives or the source closes.

        Returns:
            The new requests (possibly none without ``wait``); None once the source is closed
            and holds nothing more.
        """
        ...

    def cancelled(self) -> list[int]:
        """Ids of requests whose client no longer wants them, since the last call (queued ones
        are dropped, running ones freed before the next step)."""
        ...


@dataclasses.dataclass
class RequestResult:
    """What one request got.

    Attributes:
        id: the request's id.
        slot: the batch row that served it.
        prompt_length: tokens in its prompt.
        tokens: emitted tokens (including a final EOS).
        finished_by_eos: whether it stopped at EOS (else at its budget or ``max_steps``).
        arrival_s: open loop: the given arrival; closed loop: its admission time.
        admitted_s: engine clock at the start of its prefill phase.
        token_times_s: engine clock at which each emitted token became visible (end of the
            prefill for the first, end of the commit phase of the step that emitted it for
            the others); ``len(token_times_s) == len(tokens)``.
        accepted_per_step: its accepted drafts in each decode step it rode.
        cancelled: its source cancelled it while it ran (``tokens`` are what it got until then).
    """

    id: int
    slot: int
    prompt_length: int
    tokens: list[int]
    finished_by_eos: bool
    arrival_s: float
    admitted_s: float
    token_times_s: list[float]
    accepted_per_step: list[int]
    cancelled: bool = False

    @property
    def ttft_s(self) -> float:
        """Arrival to first token (queueing included)."""
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """Arrival to last token."""
        return self.token_times_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (NaN for one token)."""
        n = len(self.tokens)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else math.nan


@dataclasses.dataclass
class ServeResult(DecodeFigures):
    """What one :meth:`~refspec.engine.Engine.serve` call did.

    Attributes:
        requests: per request, ordered by request id.
        batch: B slots.
        steps: decode steps run.
        accepted_per_step: ``[steps][B]`` accepted drafts per slot, -1 where the slot was empty
            or its request done.
        emitted_per_step: ``[steps][B]`` tokens emitted per slot.
        slot_requests_per_step: ``[steps][B]`` request id in each slot during the step, -1 empty.
        events: every phase event, in order.
    """

    requests: list[RequestResult]
    batch: int
    steps: int
    accepted_per_step: list[list[int]]
    emitted_per_step: list[list[int]]
    slot_requests_per_step: list[list[int]]
    events: list[PhaseEvent]

    def _token_lists(self) -> Iterable[Sequence[int]]:
        return (r.tokens for r in self.requests)


@dataclasses.dataclass
class Generation(DecodeFigures):
    """Result of one batch.

    Attributes:
        tokens: emitted tokens per row (including a final EOS if one was produced).
        prompt_lengths: prompt length per row.
        finished_by_eos: whether each row stopped at EOS (else at its budget).
        steps: decode steps run (verify forwards).
        accepted_per_step: per step, accepted drafts per row (-1 where the row was done).
        emitted_per_step: per step, emitted tokens per row.
        events: every phase event of the batch.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    finished_by_eos: list[bool]
    steps: int
    accepted_per_step: list[list[int]]
    emitted_per_step: list[list[int]]
    events: list[PhaseEvent]

    def _token_lists(self) -> Iterable[Sequence[int]]:
        return self.tokens


__all__ = ["DecodeFigures", "Generation", "Request", "RequestResult", "RequestSource", "ServeResult"]
