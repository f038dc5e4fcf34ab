"""The one engine loop: the thread that owns the model and runs the eval's continuous-batching engine.

The HTTP side never calls the model. It submits a request (:meth:`EngineLoop.submit`), which puts
it on a :class:`Intake` queue (the engine's :class:`~refspec.serving.RequestSource`), and reads
what the request's :class:`~refspec.serve.jobs.Job` delivers. The engine thread takes queued
requests between steps, hands each request's new tokens to its job after every step
(``Engine.on_tokens``), and stops the rows of cancelled requests before the next step. Every
phase goes to the session's ledger and to the :class:`~refspec.serve.book.RequestBook`.

Admission: at most ``batch`` requests decode at once; up to ``queue_limit`` more wait; beyond that
:meth:`submit` refuses (HTTP 429). After :meth:`stop_admitting` it refuses every request (503);
:meth:`close` lets the running ones finish within a timeout, cancels the rest, and ends the
engine's run.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Sequence

import torch

from refspec.serve.book import RequestBook
from refspec.serve.jobs import Deliver, Job
from refspec.serve.protocol import ApiError
from refspec.serving import Request, ServeResult

log = logging.getLogger(__name__)


class Intake:
    """The engine's request source: a queue the HTTP side fills and the engine thread drains."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._new: list[Request] = []
        self._cancel: list[int] = []
        self._closed = False

    def put(self, request: Request) -> None:
        with self._cv:
            self._new.append(request)
            self._cv.notify()

    def cancel(self, rid: int) -> None:
        with self._cv:
            self._cancel.append(rid)

    def close(self) -> None:
        """Nothing more will come; a waiting engine wakes and ends once its rows are done."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def take(self, *, wait: bool) -> list[Request] | None:
        with self._cv:
            if wait:
                self._cv.wait_for(lambda: self._new or self._closed)
            out, self._new = self._new, []
            return None if self._closed and not out else out

    def cancelled(self) -> list[int]:
        with self._cv:
            out, self._cancel = self._cancel, []
            return out


class EngineLoop:
    """The engine thread and the requests it serves.

    Args:
        engine: the :class:`~refspec.engine.Engine` (its ledger and the book among its observers).
        book: the per-request energy and acceptance observer.
        batch: B slots.
        max_len: cache slots per row; every request must fit (prompt + budget + look-ahead).
        queue_limit: requests that may wait beyond the B decoding ones.
        decode: ``ids -> text`` (special tokens skipped).
        eos: the model's end-of-sequence token ids.
        generator: the sampling generator (the server's ``--seed``).
    """

    def __init__(self, engine: Any, book: RequestBook, *, batch: int, max_len: int, queue_limit: int,
                 decode: Any, eos: Sequence[int], generator: torch.Generator | None) -> None:
        self.engine, self.book, self.batch, self.max_len = engine, book, batch, max_len
        self.queue_limit, self.decode, self.eos, self.generator = queue_limit, decode, tuple(eos), generator
        self.intake = Intake()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a request ends
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self.reasons: dict[int, str] = {}  # finish reason of every request that ended
        self.submitted: dict[int, Request] = {}  # every request handed to the engine
        self.prompt_tokens = 0
        self.admitting = True
        self.result: ServeResult | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="refspec-engine", daemon=True)
        engine.on_tokens = self._on_tokens

    # ---- the engine thread --------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine on a thread of its own (tests, benchmarks: the caller's thread stays free)."""
        self._thread.start()

    def run_here(self) -> None:
        """Run the engine on the calling thread until :meth:`finish` (``python -m refspec.serve``: the
        main thread, which loaded the model, so torch keeps one OpenMP thread team; a second one,
        even idle, makes the first's workers sleep between parallel regions and slows every step)."""
        self._run()

    def _run(self) -> None:
        try:
            self.result = self.engine.serve([], batch=self.batch, max_len=self.max_len, generator=self.generator,
                                            source=self.intake)
        except BaseException as exc:  # the loop died: every waiting client gets an error, the server says so
            self.error = exc
            log.exception("the engine loop stopped")
            with self._lock:
                self.admitting = False
                jobs, self._jobs = list(self._jobs.values()), {}
                self._idle.notify_all()
            for job in jobs:
                job.deliver(("error", ApiError(500, f"the engine stopped: {exc}", kind="server_error")))

    def _on_tokens(self, new: dict[int, list[int]]) -> None:
        """Each request's new tokens (engine thread, before the next step)."""
        for rid, tokens in new.items():
            job = self._jobs.get(rid)
            if job is None:  # its client left; the engine stops it at the next step
                continue
            reason = job.feed(tokens)
            if reason is not None:
                self._end(job, reason)

    def _end(self, job: Job, reason: str) -> None:
        engine_done = (reason == "length" or (job.tokens and job.tokens[-1] in self.eos and not job.ignore_eos))
        if not engine_done:  # a stop string: the engine's row must stop before the next step
            self.intake.cancel(job.rid)
        with self._lock:
            self._jobs.pop(job.rid, None)
            self.reasons[job.rid] = reason
            self._idle.notify_all()
        job.deliver(("done", job.finish(reason, self.book.energy(job.rid), self.book.speculative_decoding(job.rid))))
        self.book.forget(job.rid)

    # ---- the HTTP side ------------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Requests submitted and not finished (decoding or queued)."""
        return len(self._jobs)

    def submit(self, prompt: Sequence[int], *, budget: int, stop: Sequence[str], ignore_eos: bool, stream: bool,
               deliver: Deliver) -> Job:
        """Queue one request (its prompt and budget already fit ``max_len``).

        Raises:
            ApiError: 503 while not admitting (shutting down or the engine stopped), 429 when
                ``batch + queue_limit`` requests are already in.
        """
        with self._lock:
            if not self.admitting:
                raise ApiError(503, "the server is shutting down and admits no new request", kind="server_error",
                               code="shutting_down")
            if len(self._jobs) >= self.batch + self.queue_limit:
                raise ApiError(429, f"{len(self._jobs)} requests are in ({self.batch} decoding, the queue limit "
                                    f"is {self.queue_limit}); retry later", kind="rate_limit_exceeded",
                               code="queue_full")
            rid = next(self._ids)
            job = Job(rid, prompt, budget, stop=stop, ignore_eos=ignore_eos, eos=self.eos, decode=self.decode,
                      deliver=deliver, stream=stream)
            self._jobs[rid] = job
            self.prompt_tokens += len(prompt)
            self.submitted[rid] = Request(id=rid, prompt=tuple(prompt), max_new_tokens=budget, ignore_eos=ignore_eos)
        self.intake.put(self.submitted[rid])
        return job

    def cancel(self, rid: int) -> None:
        """The client of ``rid`` left: the engine frees its slot before its next step."""
        with self._lock:
            if self._jobs.pop(rid, None) is None:
                return  # it had already ended
            self.reasons[rid] = "abort"
            self._idle.notify_all()
        self.intake.cancel(rid)
        self.book.forget(rid)

    def stop_admitting(self) -> None:
        """Refuse every new request from now on (lock-free: a signal handler on the engine's thread calls it)."""
        self.admitting = False

    def finish(self, timeout_s: float) -> None:
        """Stop admitting, give the running requests ``timeout_s`` to finish, cancel the rest, and
        end the engine's run (it returns once its rows are done)."""
        self.stop_admitting()
        with self._idle:  # an engine loop that died has emptied the jobs and notified
            self._idle.wait_for(lambda: not self._jobs, timeout=timeout_s)
        for rid in list(self._jobs):
            log.warning("request %d did not finish within %.3g s of the shutdown; cancelled", rid, timeout_s)
            self.cancel(rid)
        self.intake.close()

    def close(self, timeout_s: float) -> ServeResult | None:
        """:meth:`finish`, then wait for the engine's thread; returns the run's result (None when the
        engine loop died)."""
        self.finish(timeout_s)
        if self._thread.ident is not None:  # started on its own thread
            self._thread.join()
        return self.result


__all__ = ["EngineLoop", "Intake"]
