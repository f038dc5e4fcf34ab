"""The decode engine: one loop for plain (K = 0) and speculative decoding.

Each step, for a batch of ragged rows with static shapes:

1. **draft**: the drafter proposes K tokens per row (a chain, or a tree);
2. **verify**: one target forward over the pending token and the drafts of every row;
3. **accept**: pure functions (``refspec.verify``) decide each row's accepted count and its
   recovered or bonus token;
4. **commit**: rows advance by accepted + 1, emitted tokens are appended (cut at EOS and at
   the row's budget), tree paths are compacted in the cache, the drafter updates its state;
   one host sync reads the step's counts.

5. **refill**: slots whose request finished are refilled with the next admissible requests of
   the stream, prefilled together in one phase (:mod:`refspec.slots`; the slot, queue and
   clock bookkeeping is :mod:`refspec.scheduler`).

:meth:`Engine.serve` runs the loop over a stream of :class:`~refspec.serving.Request` on B static
slots (continuous batching; ``refill=False`` is the static schedule, a lockstep batch that
drains); :meth:`Engine.generate` is one static batch. Rejected KV entries stay in the cache but
are never attended and are overwritten next step. Finished rows and empty slots keep riding
along (static shapes) but emit nothing and are not counted active. Every phase is bracketed
by an :class:`~refspec.energy.phases.EnergyMeter` through a
:class:`~refspec.energy.phases.MeteredPhase` and reported to observers as a
:class:`~refspec.energy.phases.PhaseEvent`; the work a phase is billed is what the forwards run
inside it recorded (target, draft model, drafter heads), never a declaration beside them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Sequence

import torch

from refspec.drafting import Draft, Drafter
from refspec.energy.meters import TimeMeter
from refspec.energy.phases import EnergyMeter, MeteredPhase, PhaseEvent, PhaseObserver
from refspec.sampling import SamplingConfig
from refspec.scheduler import Scheduler
from refspec.serving import DecodeFigures, Request, ServeResult
from refspec.slots import Batch, fill, new_batch, release
from refspec.step import Committed, commit, decide, verify_forward

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


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Engine:
    """Plain and speculative decoding over a static KV cache.

    Args:
        target: a ``refspec.models.Transformer`` (anything with its forward signature).
        drafter: the drafter, or None for plain decoding.
        config: engine settings.
        meter: energy meter bracketing every phase (default: wall time, synchronising CUDA).
        observers: called with every :class:`PhaseEvent` (the ledger is one).
        eos_token_ids: tokens that end a row.
        verify_fn: callable with the target forward's signature used for verify steps
            (a CUDA-graph runner may replace the eager target here); when it has a
            ``new_cache`` method, the engine's cache comes from it.
        acceptance_fn: replaces chain verification's decision, ``(draft, logits, generator)
            -> Acceptance``; used to inject a recorded acceptance-length distribution when
            timing large random-weight targets (outputs must then say so).
        on_step: called after every step with ``(step, tokens_emitted_so_far)`` (progress bars).
    """

    def __init__(self, target, drafter: Drafter | None = None, *, config: EngineConfig = EngineConfig(),
                 meter: EnergyMeter | None = None, observers: Sequence[PhaseObserver] = (),
                 eos_token_ids: Sequence[int] = (), verify_fn: Callable | None = None,
                 acceptance_fn: Callable | None = None, on_step: Callable[[int, int], None] | None = None) -> None:
        if drafter is None and config.k:
            raise GenerationError(f"k = {config.k} needs a drafter; plain decoding is k = 0")
        if drafter is not None and config.k == 0:
            raise GenerationError(f"drafter {drafter.name!r} needs k >= 1")
        self.target = target
        self.drafter = drafter
        self.config = config
        sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        self.meter = meter if meter is not None else TimeMeter(sync=sync)
        self.observers = list(observers)
        self.eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], dtype=torch.long, device=target.device)
        self.verify_fn = verify_fn if verify_fn is not None else target
        self.acceptance_fn = acceptance_fn
        self.on_step = on_step
        self._cache = None

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.target.dtype).bits // 8

    def _cache_for(self, batch: int, max_len: int):
        c = self._cache
        if c is None or c.batch != batch or c.max_len < max_len:
            # a verify_fn that owns the cache (a CUDA-graph runner's KV pool) provides it
            new_cache = getattr(self.verify_fn, "new_cache", None) or self.target.new_cache
            self._cache = c = new_cache(batch, max_len)
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
        return _round_up(need, self.config.kv_bucket)

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
              max_len: int | None = None, refill: bool = True) -> ServeResult:
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

        Returns:
            Per request its tokens and token times on the engine clock, per step the slots'
            statistics, and every phase event.
        """
        requests = list(requests)
        if batch < 1:
            raise GenerationError(f"batch must be >= 1, got {batch}")
        if not requests:
            raise GenerationError("no requests given")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise GenerationError("request ids must be unique and >= 0")
        if any(r.arrival_s is not None and not 0 <= r.arrival_s < float("inf") for r in requests):
            raise GenerationError("arrival_s must be a finite time >= 0 (or None: closed loop)")
        if not refill and len(requests) > batch:
            raise GenerationError(f"the static schedule serves at most batch={batch} requests, got {len(requests)}; "
                                  f"chunk the stream into batches")
        if self.drafter is not None and not hasattr(self.drafter, "reset_rows") and (refill or len(requests) < batch):
            raise GenerationError(f"drafter {self.drafter.name} has no reset_rows; use --schedule static")
        t_slots = self._validate([r.prompt for r in requests], [r.max_new_tokens for r in requests], max_len)
        return self._serve(Scheduler(requests, batch, refill=refill), t_slots, generator)

    # ---- the loop -----------------------------------------------------------------------------
    def _serve(self, sched: Scheduler, t_slots: int, generator: torch.Generator | None) -> ServeResult:
        """Fill the slots, then step (1 draft, 2 verify, 3 accept, 4 commit, 5 refill) until no
        row generates and nothing is left to admit; every phase is metered and reported."""
        cfg, drafter, dev, b = self.config, self.drafter, self.target.device, sched.batch
        run = new_batch(self, b, t_slots, max(r.max_new_tokens for r in sched.queue))
        state, cache = run.state, run.cache
        step, emitted_total = 0, 0
        while True:
            if all(run.done_host):  # no row generating: refill (the first fill at step -1), else stop
                admitted = self._refill(run, sched, step - 1, generator)
                if not admitted:
                    break
                emitted_total += admitted  # one token each from its prefill
                continue
            if cfg.max_steps is not None and step >= cfg.max_steps:
                log.warning("stopping after max_steps=%d with unfinished rows", cfg.max_steps)
                break
            active, slot_req = b - sum(run.done_host), list(sched.slot_req)
            state.step = step
            state.max_length_bound = max(run.lengths_host) + 1

            # 1. draft: up to K tokens per row (a chain) or N nodes (a tree)
            with MeteredPhase(self.meter, "draft") as draft_phase:
                draft = drafter.propose(state, cfg.k) if drafter is not None else \
                    Draft(tokens=torch.zeros(b, 0, dtype=torch.long, device=dev))
            n = draft.tokens.shape[1]
            # a chain drafter may cut its draft below K for the whole batch (n-gram trimming)
            assert n <= cfg.k or draft.tree is not None, f"drafter returned {n} tokens for k={cfg.k}"
            if n != cfg.k and self.acceptance_fn is not None and draft.tree is None:
                raise GenerationError(f"injected acceptance needs full drafts of K={cfg.k}; the drafter cut its draft "
                                      f"to {n} (turn off the n-gram option trim)")

            # 2. verify: the pending token and the drafts of every row, one target forward
            with MeteredPhase(self.meter, "verify") as verify_phase:
                base = cache.lengths.clone()  # [B] cache length before the step
                logits, hidden = verify_forward(self, run, draft, base)  # logits [B, N+1, V]

            with MeteredPhase(self.meter, "commit") as commit_phase:
                # 3. accept: per row, the longest verified prefix of drafts plus one target token
                acc, chain, hidden = decide(self, run, draft, logits, hidden, base, generator)
                # 4. commit: emit (to the first EOS, within the budget), advance the cache by accepted + 1
                outcome = commit(self, run, acc, chain, hidden, base)

            emitted_total += self._record_step(run, sched, step, active, n, slot_req, outcome,
                                               (draft_phase, verify_phase, commit_phase))

            # 5. refill: slots freed by this step take the next admissible requests, prefilled together
            if sched.refill:
                emitted_total += self._refill(run, sched, step, generator)
            step += 1
            if self.on_step is not None:
                self.on_step(step, emitted_total)
        release(self, run, sched, unfinished=True)
        return sched.result(run.events)

    def _record_step(self, run: Batch, sched: Scheduler, step: int, active: int, n: int, slot_req: list,
                     outcome: Committed, phases: tuple[MeteredPhase, MeteredPhase, MeteredPhase]) -> int:
        """Take the step's outcome onto the host state, advance the clock by each phase and emit
        the three phase events with their work; returns the tokens emitted."""
        run.done_host = outcome.done
        run.lengths_host = [length + a for length, a in zip(run.lengths_host, outcome.advance)]
        n_acc_sum, n_emit_sum = sum(a for a in outcome.accepted if a > 0), sum(outcome.emitted)
        common = dict(step=step, batch=sched.batch, rows_active=active, slot_requests=tuple(slot_req))
        draft_phase, verify_phase, commit_phase = phases
        for phase, extra in ((draft_phase, dict(drafted=active * n)),
                             (verify_phase, dict(verified=active * (n + 1), accepted=n_acc_sum)),
                             (commit_phase, dict(accepted=n_acc_sum, emitted=n_emit_sum,
                                                 emitted_per_row=tuple(outcome.emitted)))):
            clock_s = sched.advance(phase.measurement.time_s)
            self._emit(PhaseEvent(**common, **extra, phase=phase.name, work=phase.work,
                                  measurement=phase.measurement, queued=sched.queued, clock_s=clock_s), run.events)
        sched.stepped(outcome.accepted, outcome.emitted, slot_req)
        return n_emit_sum

    def _refill(self, run: Batch, sched: Scheduler, step: int, generator: torch.Generator | None) -> int:
        """Free the slots whose request finished; admit the admissible requests into free slots
        (after a clock jump when every slot is empty) and prefill them together. Returns how
        many were admitted. The static schedule admits only at the first fill."""
        release(self, run, sched)
        if not sched.refill and step >= 0:
            return 0
        sched.jump()
        pairs = sched.admit()
        if pairs:
            fill(self, run, sched, pairs, step, generator)
        return len(pairs)
