"""The decode engine: one loop for plain (K = 0) and speculative decoding.

Each step, for B static slots holding ragged rows (the loop in :meth:`Engine._serve`, its
steps in :mod:`refspec.step`):

1. **draft**: the speculation policy picks K (:mod:`refspec.policy`); the drafter proposes
   up to K tokens per row (a chain) or a tree;
2. **verify**: one target forward over the pending token and the drafts of every row;
3. **accept**: pure functions (:mod:`refspec.verify`) decide each row's accepted count and its
   recovered or bonus token;
4. **commit**: rows advance by accepted + 1, emitted tokens are appended (cut at EOS and at
   the row's budget), tree paths are compacted in the cache; one host sync reads the step's
   counts; the drafter updates its state;
5. **refill**: slots whose request finished take the next admissible requests of the stream,
   prefilled together in one packed forward (the slot, queue and clock bookkeeping is
   :mod:`refspec.scheduler`).

:meth:`Engine.serve` runs the loop over a stream of :class:`~refspec.serving.Request` on B slots
(continuous batching; ``refill=False`` is the static schedule, a lockstep batch that drains; a
:class:`~refspec.serving.RequestSource` feeds a server's requests as they arrive, and the engine
waits on it while every slot is empty); :meth:`Engine.generate` is one static batch. Rejected KV
entries stay in the cache but are never attended and are overwritten next step. Finished rows
and empty slots keep riding along (static shapes) but emit nothing and are not counted active.
Every phase is bracketed by an :class:`~refspec.energy.meters.measurement.EnergyMeter` through a
:class:`~refspec.energy.ledger.events.MeteredPhase` and reported to observers as a
:class:`~refspec.energy.ledger.events.PhaseEvent`; the work a phase is billed is what the forwards run
inside it recorded (target, draft model, drafter heads), never a declaration beside them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch

from refspec.config import round_up
from refspec.drafter_check import check_draft
from refspec.drafting import Draft, Drafter
from refspec.energy.ledger.events import MeteredPhase, PhaseEvent, PhaseObserver
from refspec.energy.meters.direct import TimeMeter
from refspec.energy.meters.measurement import EnergyMeter
from refspec.policy import FixedK
from refspec.policy_protocol import SpeculationPolicy, StepView
from refspec.sampling import SamplingConfig
from refspec.scheduler import Scheduler
from refspec.serving import Generation, Request, RequestSource, ServeResult
from refspec.step import AcceptFn, Batch, Committed, accept_chain, commit, decide, new_batch, prefill, verify_forward
from refspec.target import TargetForward

log = logging.getLogger(__name__)


class GenerationError(ValueError):
    """Bad generation input (empty prompt, budget beyond the context, bad K)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of one engine.

    Attributes:
        k: drafts per row per step (0 = plain decoding; a tree drafter's K is its node count).
        sampling: greedy or sampled decoding.
        kv_bucket: attend to a prefix of the cache rounded up to this many slots.
        max_steps: safety cap on decode steps (None: budget-driven).
    """

    k: int = 0
    sampling: SamplingConfig = SamplingConfig()
    kv_bucket: int = 64
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.k < 0:
            raise GenerationError(f"k must be >= 0, got {self.k}")
        if self.kv_bucket < 1:
            raise GenerationError("kv_bucket must be >= 1")


class Engine:
    """Plain and speculative decoding over a static KV cache.

    Args:
        target: what runs the verify forwards and the prefills and makes the cache
            (:class:`~refspec.target.TargetForward`): a ``refspec.models.Transformer``, or one
            readied for a run by ``refspec.models.prepare_target`` (its steps through a compiled
            step or CUDA graphs, its cache from the graphs' pool).
        drafter: the drafter, or None for plain decoding.
        config: engine settings.
        meter: energy meter bracketing every phase (default: wall time, synchronising CUDA).
        observers: called with every :class:`PhaseEvent` (the ledger is one).
        eos_token_ids: tokens that end a row.
        acceptance_fn: decides a chain, ``(draft, logits, sampling, generator) -> Acceptance``
            (:data:`refspec.step.AcceptFn`); default :func:`refspec.step.accept_chain`. Timing
            large random-weight targets wraps it to inject a recorded acceptance distribution
            (:mod:`refspec.eval.injection`; outputs must then say so).
        policy: K per step (default :class:`~refspec.policy.FixedK` of ``config.k``); every K
            it may return is at most ``config.k``.
        on_step: called after every step with ``(step, tokens_emitted_so_far)`` (progress bars).
        on_tokens: called after every step's commit and every prefill with each request's tokens
            emitted since the previous call, ``{request id: [token ids]}`` (a server streams them);
            a request's last tokens come after every phase it took part in was reported.
    """

    def __init__(self, target: TargetForward, drafter: Drafter | None = None, *, config: EngineConfig = EngineConfig(),
                 meter: EnergyMeter | None = None, observers: Sequence[PhaseObserver] = (),
                 eos_token_ids: Sequence[int] = (), acceptance_fn: AcceptFn | None = None,
                 policy: SpeculationPolicy | None = None, on_step: Callable[[int, int], None] | None = None,
                 on_tokens: Callable[[dict[int, list[int]]], None] | None = None) -> None:
        if drafter is None and config.k:
            raise GenerationError(f"k = {config.k} needs a drafter; plain decoding is k = 0")
        if drafter is not None and config.k == 0:
            raise GenerationError(f"drafter {drafter.name!r} needs k >= 1")
        self.policy = policy if policy is not None else FixedK(config.k)
        if any(not 0 <= k <= config.k for k in self.policy.ks):
            raise GenerationError(f"policy {self.policy.name} may choose K in {self.policy.ks}, outside 0..{config.k}")
        self.target = target
        self.drafter = drafter
        self.config = config
        sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        self.meter = meter if meter is not None else TimeMeter(sync=sync)
        self.observers = list(observers)
        self.eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], dtype=torch.long, device=target.device)
        self.acceptance_fn = acceptance_fn if acceptance_fn is not None else accept_chain
        self.on_step = on_step
        self.on_tokens = on_tokens
        self._cache = None

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.target.dtype).bits // 8

    def _cache_for(self, batch: int, max_len: int):
        c = self._cache
        if c is None or c.batch != batch or c.max_len < max_len:
            self._cache = c = self.target.new_cache(batch, max_len)
        c.reset()
        return c

    def _emit(self, event: PhaseEvent, events: list[PhaseEvent]) -> None:
        events.append(event)
        for obs in self.observers:
            obs(event)

    def required_slots(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots one row needs: prompt, budget and one step of look-ahead."""
        lookahead = self.config.k + 1 + int(getattr(self.drafter, "extra_slots", 0) or 0)
        return prompt_len + max_new_tokens + lookahead

    def _validate(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], max_len: int | None) -> int:
        if not prompts:
            raise GenerationError("no prompts given")
        for b in budgets:
            if b < 1:
                raise GenerationError(f"max_new_tokens must be >= 1, got {b}")
        v = self.target.args.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise GenerationError(f"prompt {i} is empty; every row needs at least one token")
            if min(p) < 0 or max(p) >= v:
                raise GenerationError(f"prompt {i} has token ids outside 0..{v - 1}")
        need, at = max((self.required_slots(len(p), n), i) for i, (p, n) in enumerate(zip(prompts, budgets)))
        ctx = self.target.args.max_position_embeddings
        if need > ctx:
            raise GenerationError(
                f"prompt {at} ({len(prompts[at])} tokens) + max_new_tokens ({budgets[at]}) + look-ahead "
                f"needs {need} positions, beyond the model's context of {ctx}")
        if max_len is not None:
            if need > max_len:
                raise GenerationError(f"the cache holds {max_len} slots per row but this batch needs {need} "
                                      f"(prompt + max_new_tokens + k + 1); raise max_len or lower k / the budget")
            return max_len
        return round_up(need, self.config.kv_bucket)

    # ---- entry points ---------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 generator: torch.Generator | None = None, max_len: int | None = None) -> Generation:
        """Decode a batch of ragged prompts (one static batch: :meth:`serve` without refills).

        Args:
            prompts: token ids per row (lengths may differ).
            max_new_tokens: budget per row, including the first token from prefill.
            generator: random generator for sampling (on the target's device).
            max_len: cache slots per row (default: just enough, rounded to ``kv_bucket``).

        Returns:
            The emitted tokens and per-step statistics.
        """
        t_slots = self._validate(prompts, [max_new_tokens] * len(prompts), max_len)
        reqs = [Request(id=i, prompt=tuple(int(x) for x in p), max_new_tokens=max_new_tokens)
                for i, p in enumerate(prompts)]
        res = self._serve(Scheduler(reqs, len(reqs), refill=False), t_slots, generator)
        return Generation(tokens=[r.tokens for r in res.requests], prompt_lengths=[r.prompt_length for r in res.requests],
                          finished_by_eos=[r.finished_by_eos for r in res.requests], steps=res.steps,
                          accepted_per_step=res.accepted_per_step, emitted_per_step=res.emitted_per_step,
                          events=res.events)

    @torch.inference_mode()
    def serve(self, requests: Sequence[Request], *, batch: int, generator: torch.Generator | None = None,
              max_len: int | None = None, refill: bool = True, source: RequestSource | None = None) -> ServeResult:
        """Serve a stream of requests on ``batch`` static slots (continuous batching).

        Args:
            requests: the stream; admitted in id order, each when a slot is free and it has
                arrived (``arrival_s`` None: closed loop, it arrives when a slot frees for it).
            batch: B slots.
            generator: random generator for sampling (on the target's device).
            max_len: cache slots per row (default: enough for the longest request, rounded).
            refill: refill freed slots (continuous); False is the static schedule: one lockstep
                batch of at most ``batch`` requests that drains, started when its last request
                has arrived.
            source: online serving: requests also arrive from here while the engine runs (each
                must fit ``max_len``, which is then required), and the engine waits on it while
                every slot is empty, until it closes; ``requests`` may then be empty.

        Returns:
            Per request its tokens and token times on the engine clock, per step the slots'
            statistics, and every phase event.
        """
        requests = list(requests)
        if batch < 1:
            raise GenerationError(f"batch must be >= 1, got {batch}")
        if source is not None and (max_len is None or not refill):
            raise GenerationError("serving from a source needs max_len (every request must fit) and refill")
        if not requests and source is None:
            raise GenerationError("no requests given")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids) or min(ids, default=0) < 0:
            raise GenerationError("request ids must be unique and >= 0")
        if any(r.arrival_s is not None and not 0 <= r.arrival_s < float("inf") for r in requests):
            raise GenerationError("arrival_s must be a finite time >= 0 (or None: closed loop)")
        if not refill and len(requests) > batch:
            raise GenerationError(f"the static schedule serves at most batch={batch} requests, got {len(requests)}; "
                                  f"chunk the stream into batches")
        if self.drafter is not None and not hasattr(self.drafter, "reset_rows") and (refill or len(requests) < batch):
            raise GenerationError(f"drafter {self.drafter.name} has no reset_rows; use --schedule static")
        t_slots = (self._validate([r.prompt for r in requests], [r.max_new_tokens for r in requests], max_len)
                   if requests else max_len)
        return self._serve(Scheduler(requests, batch, refill=refill, source=source), t_slots, generator)

    # ---- the loop -----------------------------------------------------------------------------
    def _serve(self, sched: Scheduler, t_slots: int, generator: torch.Generator | None) -> ServeResult:
        """Fill the slots, then step (1 draft, 2 verify, 3 accept, 4 commit, 5 refill) until no
        row generates and nothing is left to admit; every phase is metered and reported."""
        cfg, drafter, meter = self.config, self.drafter, self.meter
        budget = t_slots if sched.source is not None else max(r.max_new_tokens for r in sched.queue)
        run = new_batch(self._cache_for(sched.batch, t_slots), sched.batch, t_slots, budget, cfg.k,
                        sampling=cfg.sampling, target_args=self.target.args, dtype_bytes=self.dtype_bytes)
        hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        drafter_name = getattr(drafter, "name", type(drafter).__name__)  # for DrafterError messages
        window = getattr(self.target.args, "sliding_window", None)
        state, events = run.state, []
        step, emitted_total = 0, 0
        while True:
            if sched.source is not None:  # online: take what arrived, stop what was cancelled
                self._intake(run, sched, t_slots, wait=False)
            if all(run.done_host):  # no row generating: refill (the first fill at step -1), else wait or stop
                admitted = self._refill(run, sched, step - 1, generator, events)
                if admitted:
                    emitted_total += admitted  # one token each from its prefill
                    continue
                if sched.source is not None and self._intake(run, sched, t_slots, wait=True):
                    continue
                break
            if cfg.max_steps is not None and step >= cfg.max_steps:
                log.warning("stopping after max_steps=%d with unfinished rows", cfg.max_steps)
                break
            slot_req, before = list(sched.slot_req), (list(run.done_host), list(run.lengths_host))
            state.step, state.max_length_bound = step, max(run.lengths_host) + 1

            # 1. draft: the policy picks K; the drafter proposes up to K tokens per row (or a tree)
            k = self.policy.choose(StepView(step=step, batch=sched.batch, active=run.active, max_k=cfg.k,
                                            length_bound=state.max_length_bound, slot_requests=tuple(slot_req)))
            with MeteredPhase(meter, "draft") as draft_phase:
                if k:  # a plug-in's mistake is a DrafterError naming it, never a torch error further on
                    draft = check_draft(drafter.propose(state, k), name=drafter_name, batch=sched.batch, k=k,
                                        vocab_size=self.target.args.vocab_size, sampling=not cfg.sampling.greedy)
                else:
                    draft = Draft(tokens=state.pending.new_zeros(sched.batch, 0))
            n = draft.tokens.shape[1]

            # 2. verify: the pending token and the drafts of every row, one target forward
            with MeteredPhase(meter, "verify") as verify_phase:
                base = run.cache.lengths.clone()  # [B] committed length before the step
                logits, hidden = verify_forward(self.target, run, draft, base, kv_bucket=cfg.kv_bucket,
                                                hidden_layers=hidden_layers, sliding_window=window)  # [B, N+1, V]

            with MeteredPhase(meter, "commit") as commit_phase:
                # 3. accept: per row, the longest verified prefix of drafts plus one target token
                acc, chain, hidden = decide(draft, logits, hidden, base, run.cache, sampling=cfg.sampling,
                                            generator=generator, accept=self.acceptance_fn)
                # 4. commit: emit (to the first EOS, within the budget), advance the cache by accepted + 1
                outcome = commit(run, acc, chain, hidden, base, self.eos)
                if drafter is not None:
                    drafter.commit(state)

            self.policy.observe(k, outcome.accepted, slot_req)
            emitted_total += self._record_step(sched, step, k, n, slot_req, before, outcome,
                                               (draft_phase, verify_phase, commit_phase), events)
            self._stream(run, sched)

            # 5. refill: slots freed by this step take the next admissible requests, prefilled together
            if sched.refill:
                emitted_total += self._refill(run, sched, step, generator, events)
            step += 1
            if self.on_step is not None:
                self.on_step(step, emitted_total)
        self._release(run, sched, unfinished=True)
        return sched.result(events)

    def _record_step(self, sched: Scheduler, step: int, k: int, n: int, slot_req: list,
                     before: tuple[list[bool], list[int]], outcome: Committed,
                     phases: tuple[MeteredPhase, MeteredPhase, MeteredPhase], events: list[PhaseEvent]) -> int:
        """Advance the clock by each phase and emit the step's three phase events with their
        work; returns the tokens emitted. ``before``: each slot's done flag and length before the step."""
        done, lengths = before
        active = len(done) - sum(done)
        n_acc, n_emit = sum(a for a in outcome.accepted if a > 0), sum(outcome.emitted)
        row_lengths = tuple(0 if d else length + n + 1 for d, length in zip(done, lengths))
        common = dict(step=step, batch=sched.batch, rows_active=active, slot_requests=tuple(slot_req), k=k,
                      row_lengths=row_lengths)
        draft_phase, verify_phase, commit_phase = phases
        for phase, extra in ((draft_phase, dict(drafted=active * n)),
                             (verify_phase, dict(verified=active * (n + 1), accepted=n_acc)),
                             (commit_phase, dict(accepted=n_acc, emitted=n_emit, emitted_per_row=tuple(outcome.emitted),
                                                 accepted_per_row=tuple(outcome.accepted)))):
            clock_s = sched.advance(phase.measurement.time_s)
            self._emit(PhaseEvent(**common, **extra, phase=phase.name, work=phase.work,
                                  measurement=phase.measurement, queued=sched.queued, clock_s=clock_s), events)
        sched.stepped(outcome.accepted, outcome.emitted, slot_req)
        return n_emit

    def _refill(self, run: Batch, sched: Scheduler, step: int, generator: torch.Generator | None,
                events: list[PhaseEvent]) -> int:
        """Free the slots whose request finished; admit the admissible requests into free slots
        (after a clock jump when every slot is empty) and prefill them together in one metered
        ``prefill`` phase, reported with ``step`` the decode step after which it ran (-1: the
        first fill). Returns how many were admitted. The static schedule admits only at the first fill."""
        self._release(run, sched)
        if not sched.refill and step >= 0:
            return 0
        sched.jump()
        pairs = sched.admit()
        if not pairs:
            return 0
        rows, reqs = [slot for slot, _ in pairs], [q for _, q in pairs]
        with MeteredPhase(self.meter, "prefill") as phase:
            prefill(self.target, run, rows, [q.prompt for q in reqs], [q.max_new_tokens for q in reqs],
                    drafter=self.drafter, sampling=self.config.sampling, eos=self.eos, generator=generator,
                    ignore_eos=[q.ignore_eos for q in reqs])
        clock_s = sched.advance(phase.measurement.time_s)
        sched.first_tokens(pairs)
        b = sched.batch
        per_slot = [0] * b
        for slot, q in pairs:
            per_slot[slot] = len(q.prompt)
        self._emit(PhaseEvent(step=step, phase="prefill", batch=b, rows_active=len(pairs), emitted=len(pairs),
                              work=phase.work, measurement=phase.measurement,
                              emitted_per_row=tuple(int(x > 0) for x in per_slot),
                              slot_requests=Scheduler.prefill_slots(b, pairs), arrivals_s=sched.arrivals(pairs),
                              queued=sched.queued, clock_s=clock_s, row_lengths=tuple(per_slot)), events)
        self._stream(run, sched)
        return len(pairs)

    def _intake(self, run: Batch, sched: Scheduler, t_slots: int, *, wait: bool) -> bool:
        """Queue what the source has (``wait``: block until something arrives), and stop the rows
        of cancelled requests, freeing their slots now. Returns False once the source has closed."""
        new = sched.source.take(wait=wait)
        if new:
            self._validate([r.prompt for r in new], [r.max_new_tokens for r in new], t_slots)
            sched.enqueue(new)
        slots = sched.cancel(sched.source.cancelled(), run.done_host)
        if slots:
            run.state.done[torch.tensor(slots, dtype=torch.long, device=run.out.device)] = True
            for slot in slots:
                run.done_host[slot] = True
            self._release(run, sched)
        return new is not None

    def _stream(self, run: Batch, sched: Scheduler) -> None:
        """Hand ``on_tokens`` each request's tokens emitted since the last call (one host copy)."""
        if self.on_tokens is None:
            return
        marks = sched.unstreamed()
        if not marks:
            return
        idx = torch.tensor([slot for slot, _, _ in marks], dtype=torch.long, device=run.out.device)
        counts = run.n_out[idx].tolist()
        lo, hi = min(sent for _, _, sent in marks), max(counts)
        rows = run.out[idx, lo:hi].tolist()
        new = {}
        for (_, rid, sent), n, row in zip(marks, counts, rows):
            if n > sent:
                new[rid] = row[sent - lo:n - lo]
                sched.streamed(rid, n)
        if new:
            self.on_tokens(new)

    def _release(self, run: Batch, sched: Scheduler, *, unfinished: bool = False) -> None:
        """Free every slot whose request finished (and, with ``unfinished``, every busy slot: the
        end of a run cut by ``max_steps``), handing its tokens to the scheduler (one host sync)."""
        slots = [i for i, rid in enumerate(sched.slot_req) if rid >= 0 and (unfinished or run.done_host[i])]
        if not slots:
            return
        idx = torch.tensor(slots, dtype=torch.long, device=run.out.device)
        eos = set(self.eos.tolist())
        for slot, row, n in zip(slots, run.out[idx].tolist(), run.n_out[idx].tolist()):
            sched.finish(slot, row[:n], eos)
