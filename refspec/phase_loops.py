"""Phase-isolated loops: each phase of a step run alone, long enough for an energy counter.

A counter that updates every 20-100 ms cannot see a phase of a few milliseconds, so a measured
run's per-phase split needs another source (:mod:`refspec.energy.attribution`, method A): after
the run, each phase is repeated alone at the run's own shapes (B rows, K drafts, the keys the
run's verifies attended, its refill group) for at least ten counter periods, and the counter is
read only at each loop's bounds. Joules per call of each phase then come from loops the counter
resolves; the accounting checks that they add up to the measured run.

The loops use the step functions of :mod:`refspec.step` on a batch of their own:

1. **set-up**: B slots are prefilled with the run's first prompts and decoded with the run's
   drafter until the attended keys reach the run's typical verify (no EOS, unbounded budgets,
   so every row stays active, as in a steady state);
2. **draft**: ``drafter.propose`` on that state (a proposal reads the state, it does not move it);
3. **verify**: the target forward over the same pending tokens and drafts (it rewrites the same
   cache slots);
4. **commit**: acceptance and commit of that verify's logits (each call first puts the rows
   back to their length before the step, so every call commits the same step);
5. **prefill**: the run's refill group (R prompts) prefilled into R slots.

Each iteration is bracketed by the meter as ``loop:<phase>``, so a simulated counter learns the
true energy of what ran; the counter itself is read only at the loop's bounds.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import torch

from refspec.config import round_up
from refspec.drafting import Draft, Drafter
from refspec.energy.attribution import Loop
from refspec.energy.ledger.events import MeteredPhase, PhaseEvent
from refspec.sampling import SamplingConfig
from refspec.step import AcceptFn, Batch, accept_chain, commit, decide, new_batch, prefill, verify_forward

LOOP_PHASES = ("draft", "verify", "commit", "prefill")
MIN_PERIODS = 10
"""A loop lasts at least this many counter periods."""
WALL_CAP = 20
"""A loop never runs longer than this many times its length on the host clock (a slow modelled clock)."""
UNBOUNDED = 1 << 30
"""Budget of a loop row: it never finishes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopShapes:
    """The run's shapes the loops reproduce.

    Attributes:
        batch: B slots (every one active).
        k: drafts per step (0: plain decoding; the draft loop is skipped).
        prompts: at least B prompts from the run's stream (slot i gets prompt i).
        keys: attended keys of a typical verify of the run (the set-up decodes until reached).
        refill: R, the run's typical refill group (prompts 0..R-1 are prefilled into slots 0..R-1).
    """

    batch: int
    k: int
    prompts: Sequence[Sequence[int]]
    keys: int
    refill: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopTarget:
    """What the loops run: the run's target, drafter, verify callable and settings."""

    target: object
    drafter: Drafter | None
    verify_fn: Callable
    sampling: SamplingConfig
    kv_bucket: int = 64
    accept: AcceptFn = accept_chain


def shapes_of(events: Sequence[PhaseEvent], *, batch: int, k: int, prompts: Sequence[Sequence[int]]) -> LoopShapes:
    """The loops' shapes from a run's phase events: the median keys its verifies attended (the
    longest row of each), the median refill group (the first fill when nothing refilled), and
    ``batch`` rows (at most the prompts there are)."""
    verify = [max(e.row_lengths) for e in events if e.phase == "verify" and e.row_lengths]
    refills = [e.rows_active for e in events if e.phase == "prefill" and e.step >= 0]
    first = [e.rows_active for e in events if e.phase == "prefill" and e.step < 0]
    b = min(batch, len(prompts))
    refill = int(statistics.median(refills or first or [b]))
    return LoopShapes(batch=b, k=k, prompts=prompts, keys=int(statistics.median(verify or [1])),
                      refill=max(1, min(refill, b)))


def _cache(t: LoopTarget, batch: int, slots: int):
    new_cache = getattr(t.verify_fn, "new_cache", None) or t.target.new_cache
    cache = new_cache(batch, slots)
    cache.reset()
    return cache


def _set_up(t: LoopTarget, shapes: LoopShapes, no_eos: torch.Tensor, gen: torch.Generator | None,
            max_steps: int = 256) -> tuple[Batch, Draft, torch.Tensor]:
    """A batch of B active rows decoded to the run's keys; returns it, a draft and its base."""
    b, k = shapes.batch, shapes.k
    prompts = [list(p) for p in shapes.prompts[:b]]
    # each step advances a row by at least one, so the set-up ends within the run's keys plus a step
    slots = round_up(max(shapes.keys, max(map(len, prompts))) + 2 * (k + 1) + 1, t.kv_bucket)
    max_steps = min(max_steps, slots)
    run = new_batch(_cache(t, b, slots), b, slots, slots, k, sampling=t.sampling,
                    target_args=t.target.args, dtype_bytes=torch.finfo(t.target.dtype).bits // 8)
    prefill(t.target, run, list(range(b)), prompts, [UNBOUNDED] * b, drafter=t.drafter, sampling=t.sampling,
            eos=no_eos, generator=gen)
    hidden_layers = tuple(t.drafter.hidden_layers) if t.drafter is not None else ()
    window = getattr(t.target.args, "sliding_window", None)
    for step in range(max_steps):
        run.state.step, run.state.max_length_bound = step, max(run.lengths_host) + 1
        draft = t.drafter.propose(run.state, k) if k else Draft(tokens=run.state.pending.new_zeros(b, 0))
        base = run.cache.lengths.clone()
        if max(run.lengths_host) + k + 1 >= shapes.keys or step == max_steps - 1:
            return run, draft, base
        logits, hidden = verify_forward(t.verify_fn, run, draft, base, kv_bucket=t.kv_bucket,
                                        hidden_layers=hidden_layers, sliding_window=window)
        acc, chain, hidden = decide(draft, logits, hidden, base, run.cache, sampling=t.sampling, generator=gen,
                                    accept=t.accept)
        commit(run, acc, chain, hidden, base, no_eos)
        if t.drafter is not None:
            t.drafter.commit(run.state)
    raise AssertionError("unreachable: the set-up returns at its last step")


def _loop(meter, name: str, body: Callable[[], None], min_s: float, sync: Callable[[], None],
          rows: int | None = None) -> Loop:
    """Repeat ``body`` for at least ``min_s`` seconds; the counter is read at the loop's bounds only."""
    clock = getattr(meter, "clock", time.perf_counter)  # the counter's time base (modelled under a GPU profile)
    sync()
    first = meter.counter.read()
    t0, wall0, iterations = clock(), time.perf_counter(), 0
    while True:
        with MeteredPhase(meter, f"loop:{name}"):
            body()
        iterations += 1
        if iterations % 8 == 0:
            sync()  # a GPU's queue stays short, so the host clock tracks the work
        wall = time.perf_counter() - wall0
        # a modelled clock stands still over a phase without forwards (commit): the wall clock ends it
        if clock() - t0 >= min_s or (clock() == t0 and wall >= min_s) or wall >= WALL_CAP * min_s:
            break
    sync()
    last = meter.counter.read()
    return Loop(energy_j=last.energy_j - first.energy_j, time_s=last.wall_s - first.wall_s, iterations=iterations,
                rows=rows)


def run_phase_loops(t: LoopTarget, shapes: LoopShapes, meter, *, min_s: float | None = None,
                    phases: Sequence[str] = LOOP_PHASES, seed: int = 0) -> dict[str, Loop]:
    """Each phase of the run's step, alone in a loop the meter's counter resolves.

    Args:
        t: the run's target, drafter, verify callable and settings.
        shapes: the run's shapes.
        meter: a counter meter (``counter.read()``, ``period_s``, ``begin``/``end``); the loops
            leave it with no run open.
        min_s: seconds per loop; default ten counter periods, at least one second.
        phases: which loops to run (the draft loop needs K >= 1).
        seed: the sampling generator's seed.

    Returns:
        phase -> :class:`~refspec.energy.attribution.Loop` (energy over the loop, its duration, iterations).
    """
    if len(shapes.prompts) < shapes.batch or not 1 <= shapes.refill <= shapes.batch:
        raise ValueError(f"loops need {shapes.batch} prompts and a refill group of 1..{shapes.batch}, got "
                         f"{len(shapes.prompts)} prompts and {shapes.refill}")
    dev = t.target.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    min_s = max(MIN_PERIODS * meter.period_s, 1.0) if min_s is None else min_s
    gen = torch.Generator(device=dev).manual_seed(seed)
    no_eos = torch.tensor([-1], dtype=torch.long, device=dev)
    hidden_layers = tuple(t.drafter.hidden_layers) if t.drafter is not None else ()
    window = getattr(t.target.args, "sliding_window", None)
    with torch.inference_mode():
        run, draft, base = _set_up(t, shapes, no_eos, gen)
        logits, hidden = verify_forward(t.verify_fn, run, draft, base, kv_bucket=t.kv_bucket,
                                        hidden_layers=hidden_layers, sliding_window=window)

        base_host = list(run.lengths_host)

        def step_commit() -> None:
            run.cache.lengths.copy_(base)  # every call commits the same step: rows stay inside the cache
            run.lengths_host = list(base_host)
            acc, chain, kept = decide(draft, logits, hidden, base, run.cache, sampling=t.sampling, generator=gen,
                                      accept=t.accept)
            commit(run, acc, chain, kept, base, no_eos)
            if t.drafter is not None:
                t.drafter.commit(run.state)

        refill = [list(p) for p in shapes.prompts[:shapes.refill]]
        bodies: dict[str, Callable[[], None]] = {
            "draft": lambda: t.drafter.propose(run.state, shapes.k),
            "verify": lambda: verify_forward(t.verify_fn, run, draft, base, kv_bucket=t.kv_bucket,
                                             hidden_layers=hidden_layers, sliding_window=window),
            "commit": step_commit,
            "prefill": lambda: prefill(t.target, run, list(range(shapes.refill)), refill, [UNBOUNDED] * len(refill),
                                       drafter=t.drafter, sampling=t.sampling, eos=no_eos, generator=gen),
        }
        out: dict[str, Loop] = {}
        try:
            for name in phases:  # the prefill loop last: it overwrites the set-up's rows
                if name == "draft" and (t.drafter is None or not shapes.k):
                    continue
                rows = shapes.refill if name == "prefill" else None  # refills differ in rows: priced per row
                out[name] = _loop(meter, name, bodies[name], min_s, sync, rows)
        finally:
            meter.abandon_run()  # the loops' phases opened a counter run the ledger never closes
    return out


__all__ = ["LOOP_PHASES", "LoopShapes", "LoopTarget", "run_phase_loops", "shapes_of"]
