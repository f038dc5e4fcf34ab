"""Slot, queue and clock bookkeeping of continuous batching (host side, no tensors).

:class:`Scheduler` holds the stream of requests not yet admitted (in id order), which request
each of the B slots serves (-1 empty), the engine clock, and what every admitted request has
got so far (token times, accepted drafts per step). The engine asks it which requests to
admit after a step's commit, tells it what each step emitted, and hands it a finished slot's
tokens; :meth:`Scheduler.result` builds the :class:`~refspec.serving.ServeResult`.

The clock starts at 0 and advances by every phase's ``measurement.time_s``; when every slot is
empty and the next request has not arrived, :meth:`Scheduler.jump` moves it to that arrival
(no phase, no energy); the static schedule's one batch starts at its last arrival. A request
is admissible when ``arrival_s is None or arrival_s <= clock``; a closed-loop request
(``arrival_s`` None) counts as arriving at its admission.

Online (a :class:`~refspec.serving.RequestSource`): the engine hands the scheduler the requests
it takes from the source (:meth:`Scheduler.enqueue`, each arriving at the clock it is taken at)
and the ids the source cancelled (:meth:`Scheduler.cancel`).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from refspec.energy.ledger.events import PhaseEvent
from refspec.serving import Request, RequestResult, RequestSource, ServeResult


@dataclasses.dataclass
class _Live:
    """An admitted request's record while it is served."""

    request: Request
    slot: int
    arrival_s: float
    admitted_s: float
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)
    streamed: int = 0  # tokens already handed to the engine's on_tokens listener
    cancelled: bool = False


class Scheduler:
    """Which request each slot serves, the queue and the clock.

    Args:
        requests: the stream (any order; admitted by id).
        batch: B slots.
        refill: refill freed slots (continuous batching); False admits once (static).
        source: where further requests arrive while the engine runs (None: ``requests`` is the stream).
    """

    def __init__(self, requests: Sequence[Request], batch: int, *, refill: bool,
                 source: RequestSource | None = None) -> None:
        self.batch, self.refill, self.source = batch, refill, source
        self.queue = collections.deque(sorted(requests, key=lambda r: r.id))
        self.slot_req = [-1] * batch  # request id per slot, -1 empty
        self.clock = 0.0
        self._live: dict[int, _Live] = {}
        self._done: dict[int, RequestResult] = {}
        self.accepted_log: list[list[int]] = []
        self.emitted_log: list[list[int]] = []
        self.slot_log: list[list[int]] = []

    # ---- admission --------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests of the stream not yet admitted."""
        return len(self.queue)

    def jump(self) -> None:
        """Every slot empty: move the clock to the next arrival if it lies ahead (the static
        schedule's one batch starts when its last request has arrived)."""
        if not self.queue or any(r >= 0 for r in self.slot_req):
            return
        ahead = [r.arrival_s for r in (self.queue if not self.refill else [self.queue[0]]) if r.arrival_s is not None]
        if ahead and max(ahead) > self.clock:
            self.clock = float(max(ahead))

    def admit(self) -> list[tuple[int, Request]]:
        """Pop admissible requests, in id order, into free slots (lowest slot first).

        Returns:
            ``(slot, request)`` pairs; the slots now hold those requests (admitted now).
        """
        free = [i for i, r in enumerate(self.slot_req) if r < 0]
        pairs: list[tuple[int, Request]] = []
        while free and self.queue and (self.queue[0].arrival_s is None or self.queue[0].arrival_s <= self.clock):
            req, slot = self.queue.popleft(), free.pop(0)
            self.slot_req[slot] = req.id
            arrival = self.clock if req.arrival_s is None else float(req.arrival_s)
            self._live[req.id] = _Live(request=req, slot=slot, arrival_s=arrival, admitted_s=self.clock)
            pairs.append((slot, req))
        return pairs

    def enqueue(self, requests: Sequence[Request]) -> None:
        """Requests taken from the source now: queued after the others, arriving at the clock."""
        self.queue.extend(r if r.arrival_s is not None else dataclasses.replace(r, arrival_s=self.clock)
                          for r in requests)

    def cancel(self, ids: Sequence[int], done: Sequence[bool]) -> list[int]:
        """Drop the queued requests of ``ids`` and mark the running ones cancelled.

        Args:
            ids: request ids to cancel (unknown or finished ones are ignored).
            done: per slot, its row has stopped generating (a request that finished is not cancelled).

        Returns:
            The slots of the running ones, whose rows the engine stops.
        """
        drop = set(ids)
        self.queue = collections.deque(r for r in self.queue if r.id not in drop)
        slots = []
        for rid in drop & set(self._live):
            live = self._live[rid]
            if not done[live.slot]:
                live.cancelled = True
                slots.append(live.slot)
        return sorted(slots)

    def arrivals(self, pairs: Sequence[tuple[int, Request]]) -> tuple[float, ...]:
        """Per slot: arrival of the request being prefilled there, -1.0 elsewhere (a prefill event's)."""
        out = [-1.0] * self.batch
        for slot, req in pairs:
            out[slot] = self._live[req.id].arrival_s
        return tuple(out)

    @staticmethod
    def prefill_slots(batch: int, pairs: Sequence[tuple[int, Request]]) -> tuple[int, ...]:
        """Per slot: the request being prefilled there, -1 elsewhere."""
        out = [-1] * batch
        for slot, req in pairs:
            out[slot] = req.id
        return tuple(out)

    # ---- progress ---------------------------------------------------------------------------
    def advance(self, time_s: float) -> float:
        """Add one phase's time to the clock; returns the clock at the phase's start."""
        start = self.clock
        self.clock += float(time_s)
        return start

    def first_tokens(self, pairs: Sequence[tuple[int, Request]]) -> None:
        """The prefill of ``pairs`` ended now: each got its first token."""
        for _, req in pairs:
            self._live[req.id].token_times_s.append(self.clock)

    def stepped(self, accepted: list[int], emitted: list[int], slots: list[int]) -> None:
        """A decode step's commit ended now: per slot, accepted drafts (-1 done) and tokens emitted."""
        self.accepted_log.append(accepted)
        self.emitted_log.append(emitted)
        self.slot_log.append(slots)
        for slot, rid in enumerate(slots):
            if rid < 0:
                continue
            live = self._live[rid]
            live.token_times_s.extend([self.clock] * emitted[slot])
            if accepted[slot] >= 0:
                live.accepted_per_step.append(accepted[slot])

    def unstreamed(self) -> list[tuple[int, int, int]]:
        """``(slot, request id, tokens handed to the listener so far)`` of every slot holding a request."""
        return [(slot, rid, self._live[rid].streamed) for slot, rid in enumerate(self.slot_req) if rid >= 0]

    def streamed(self, rid: int, n: int) -> None:
        """The listener has got the first ``n`` tokens of request ``rid``."""
        self._live[rid].streamed = n

    def finish(self, slot: int, tokens: list[int], eos: set[int]) -> None:
        """The request in ``slot`` is done with ``tokens``: record it and free the slot."""
        live = self._live.pop(self.slot_req[slot])
        self.slot_req[slot] = -1
        req = live.request
        by_eos = bool(tokens) and tokens[-1] in eos and not req.ignore_eos and not live.cancelled
        self._done[req.id] = RequestResult(
            id=req.id, slot=slot, prompt_length=len(req.prompt), tokens=tokens,
            finished_by_eos=by_eos, arrival_s=live.arrival_s,
            admitted_s=live.admitted_s, token_times_s=live.token_times_s[: len(tokens)],
            accepted_per_step=live.accepted_per_step, cancelled=live.cancelled)

    def result(self, events: list[PhaseEvent]) -> ServeResult:
        """The served run (every slot must have been finished)."""
        assert not self._live, f"requests {sorted(self._live)} were never finished"
        return ServeResult(requests=[self._done[i] for i in sorted(self._done)], batch=self.batch,
                           steps=len(self.accepted_log), accepted_per_step=self.accepted_log,
                           emitted_per_step=self.emitted_log, slot_requests_per_step=self.slot_log, events=events)


__all__ = ["Scheduler"]
