"""Phase-isolated loops: each phase of a step run alone, long enough for an energy counter, and
the whole step interleaved as the run ran it.

A counter that updates every 20-100 ms cannot see a phase of a few milliseconds, so a measured
run's per-phase split needs another source (:mod:`refspec.energy.accounting.attribution`, method A): after
the run, each phase is repeated alone at the run's own shapes (B rows, K drafts, the keys the
run's verifies attended, its refill group) for at least ten counter periods and one second
(:data:`refspec.energy.accounting.split_gate.GATE`), and the counter is read only at each loop's bounds.
The accounting prices each phase of the run at its loop's power, and checks the split
(:mod:`refspec.energy.accounting.phase_energy`).

The loops use the step functions of :mod:`refspec.step` on a batch of their own, and each call
does the work the run's phase does (``tests/test_phase_loops.py`` compares them forward by
forward):

1. **set-up**: B slots are prefilled with the run's first prompts and decoded with the run's
   drafter until the attended keys reach the run's typical verify (no EOS, unbounded budgets,
   so every row stays active, as in a steady state);
2. **draft**: ``drafter.commit`` of the last step, then ``drafter.propose``: the commit hands the
   drafter that step's features again, so every call catches them up as the run's draft does
   (EAGLE's head forwards over the verified positions); the commit runs no forward (the
   drafter protocol), only its bookkeeping moves from the commit loop to this one;
3. **verify**: the target forward over the same pending tokens and drafts (it rewrites the same
   cache slots);
4. **commit**: acceptance and the engine's commit of that verify's logits (each call first puts
   the rows back to their length before the step, so every call commits the same step);
5. **step**: the run's whole step, interleaved as the engine runs it (draft, verify, then
   acceptance, commit and ``drafter.commit``), rows put back before each call, for
   :data:`STEP_LOOP_SPANS` loop lengths; its phases' times are kept, so the accounting can compare its energy with the isolated loops' (the
   interaction check: phases that change each other's power show there);
6. **prefill**: the run's refill group (R prompts) prefilled into R slots (last: it overwrites
   the set-up's rows).

Each phase call is bracketed by the meter as ``loop:<phase>`` (``loop:step:<phase>`` inside the
step loop), so a simulated counter learns the true energy of what ran; the counter itself is
read only around each loop's bounds, which fall on its updates where it has them (:func:`_loop`).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import torch

from refspec.config import round_up
from refspec.drafting import Draft, Drafter
from refspec.energy.accounting.attribution import Loop
from refspec.energy.accounting.split_gate import GATE, STEP_LOOP_SPANS
from refspec.energy.ledger.events import MeteredPhase, PhaseEvent
from refspec.energy.meters.counters import CounterRead
from refspec.sampling import SamplingConfig
from refspec.step import AcceptFn, Batch, accept_chain, commit, decide, new_batch, prefill, verify_forward

LOOP_PHASES = ("draft", "verify", "commit", "step", "prefill")
"""The loops, in the order they run (``step``: the whole step interleaved; ``prefill`` last)."""
WALL_CAP = 20
"""A loop never runs longer than this many times its length on the host clock (a slow modelled clock)."""
POLL_S = 2e-4
"""Sleep between two reads of a counter awaited for its update, s."""
UNBOUNDED = 1 << 30
"""Budget of a loop row: it never finishes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopShapes:
    """The run's shapes the loops reproduce.

    Attributes:
        batch: B slots (every one active).
        k: drafts per step (0: plain decoding, whose draft phase only makes the empty draft).
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


def set_up_batch(t: LoopTarget, shapes: LoopShapes, no_eos: torch.Tensor, gen: torch.Generator | None,
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


def _await_update(read: Callable[[], CounterRead], period_s: float,
                  wait: Callable[[float], None]) -> CounterRead | None:
    """Poll the counter, running nothing (``wait`` lets time pass), until its value changes: the
    read just after an update (None when it does not change within three periods, or its clock
    stands still: unaligned)."""
    first = read()
    deadline = time.perf_counter() + 3 * period_s + 0.5
    while time.perf_counter() < deadline:
        wait(POLL_S)
        now = read()
        if now.energy_j != first.energy_j:
            return now
        if now.wall_s == first.wall_s or now.wall_s - first.wall_s > 3 * period_s:
            return None  # a clock that stands still while nothing runs, or a counter that does not step
    return None


def _aligned_end(read: Callable[[], CounterRead], period_s: float, last: CounterRead,
                 wait: Callable[[float], None]) -> float | None:
    """The time of the last update ``last`` holds: the next update seen idle, less the period
    between it and the one after (the counter's own period, however regular it claims to be)."""
    a = _await_update(read, period_s, wait)
    b = _await_update(read, period_s, wait) if a is not None else None
    if b is None:
        return None
    return min(a.wall_s - (b.wall_s - a.wall_s), last.wall_s)


def _loop(meter, body: Callable[[], Sequence[MeteredPhase]], min_s: float, sync: Callable[[], None], *,
          rows: int | None = None, keep_times: bool = False) -> Loop:
    """Repeat ``body`` (one call, bracketing its own phases) for at least ``min_s`` seconds of the
    counter's clock; the counter is read only around the loop's bounds. ``keep_times``: sum each
    phase's time (the step loop, whose commit holds the host sync, so no read waits on the device).

    A counter that updates once a period holds, at any read, the periods completed by then, so a
    loop read at arbitrary bounds is off by up to a period at each end (a tenth of a loop at the
    gate's floor). Where the counter's clock moves while nothing runs (a real counter's; a
    simulated one's through ``meter.wait``), the loop starts just after an update and ends at its
    last update, found from the next two updates seen with the device idle.
    """
    clock = getattr(meter, "clock", time.perf_counter)  # the counter's time base (modelled under a GPU profile)
    period = float(getattr(meter, "period_s", 0.0) or 0.0)
    sync()
    wait = getattr(meter, "wait", time.sleep)
    aligned = _await_update(meter.counter.read, period, wait) if period > 0 else None
    first = aligned or meter.counter.read()
    run_s = min_s + (period if aligned else 0.0)  # the last update before the end lies within a period of it
    t0, wall0, iterations = clock(), time.perf_counter(), 0
    times: dict[str, float] = {}
    while True:
        for phase in body():
            if keep_times:
                name = phase.name.rpartition(":")[2]
                times[name] = times.get(name, 0.0) + phase.measurement.time_s
        iterations += 1
        if iterations % 8 == 0:
            sync()  # a GPU's queue stays short, so the host clock tracks the work
        wall = time.perf_counter() - wall0
        # a modelled clock stands still over a phase without forwards: the wall clock ends it
        if clock() - t0 >= run_s or (clock() == t0 and wall >= run_s) or wall >= WALL_CAP * run_s:
            break
    sync()
    last = meter.counter.read()
    end = _aligned_end(meter.counter.read, period, last, wait) if aligned else None
    span = last.wall_s - first.wall_s
    # no whole period counted: the unaligned span, which the gate's floor then refuses by name
    time_s = span if end is None or end - first.wall_s < period / 2 else end - first.wall_s
    scale = time_s / span if span > 0 else 1.0  # the phases' times within the counted span
    return Loop(energy_j=last.energy_j - first.energy_j, time_s=time_s, iterations=iterations, rows=rows,
                phase_time_s={p: t * scale for p, t in times.items()} if keep_times else None)


def _phase(meter, name: str, fn: Callable[[], object]) -> MeteredPhase:
    """``fn()`` inside one metered phase ``name``; returns the closed phase."""
    with MeteredPhase(meter, name) as phase:
        fn()
    return phase


class _Loops:
    """The loop bodies over one set-up batch: each call does what the run's phase does."""

    def __init__(self, t: LoopTarget, shapes: LoopShapes, meter, gen: torch.Generator) -> None:
        self.t, self.shapes, self.meter, self.gen = t, shapes, meter, gen
        dev = t.target.device
        self.no_eos = torch.tensor([-1], dtype=torch.long, device=dev)
        self.hidden_layers = tuple(t.drafter.hidden_layers) if t.drafter is not None else ()
        self.window = getattr(t.target.args, "sliding_window", None)
        self.run, self.draft, self.base = set_up_batch(t, shapes, self.no_eos, gen)
        self.logits, self.hidden = self.verify(self.draft, self.base)
        self.base_host = list(self.run.lengths_host)
        self.refill = [list(p) for p in shapes.prompts[:shapes.refill]]

    def verify(self, draft: Draft, base: torch.Tensor):
        return verify_forward(self.t.verify_fn, self.run, draft, base, kv_bucket=self.t.kv_bucket,
                              hidden_layers=self.hidden_layers, sliding_window=self.window)

    def rows_back(self) -> None:
        """Every row back to its length before the step, so each call repeats the same step."""
        self.run.cache.lengths.copy_(self.base)
        self.run.lengths_host = list(self.base_host)

    def commit(self, logits: torch.Tensor, hidden, draft: Draft, base: torch.Tensor) -> None:
        """Acceptance and the engine's commit of one verify."""
        acc, chain, kept = decide(draft, logits, hidden, base, self.run.cache, sampling=self.t.sampling,
                                  generator=self.gen, accept=self.t.accept)
        commit(self.run, acc, chain, kept, base, self.no_eos)

    def propose(self) -> Draft:
        """The run's draft: the drafter's proposal, or (plain decoding) the empty draft the engine makes."""
        if self.shapes.k and self.t.drafter is not None:
            return self.t.drafter.propose(self.run.state, self.shapes.k)
        return Draft(tokens=self.run.state.pending.new_zeros(self.shapes.batch, 0))

    def draft_call(self) -> list[MeteredPhase]:
        if self.shapes.k and self.t.drafter is not None:
            self.t.drafter.commit(self.run.state)  # the last step's features, again: this call catches them up
        return [_phase(self.meter, "loop:draft", self.propose)]

    def verify_call(self) -> list[MeteredPhase]:
        return [_phase(self.meter, "loop:verify", lambda: self.verify(self.draft, self.base))]

    def commit_call(self) -> list[MeteredPhase]:
        self.rows_back()
        return [_phase(self.meter, "loop:commit", lambda: self.commit(self.logits, self.hidden, self.draft, self.base))]

    def step_call(self) -> list[MeteredPhase]:
        """One step as the engine runs it (its draft takes the features the previous call committed)."""
        self.rows_back()
        drafter, out = self.t.drafter, {}
        phases = [_phase(self.meter, "loop:step:draft", lambda: out.update(draft=self.propose()))]

        def verify() -> None:
            out["base"] = self.run.cache.lengths.clone()
            out["logits"], out["hidden"] = self.verify(out["draft"], out["base"])

        def step_commit() -> None:
            self.commit(out["logits"], out["hidden"], out["draft"], out["base"])
            if drafter is not None:
                drafter.commit(self.run.state)

        phases.append(_phase(self.meter, "loop:step:verify", verify))
        phases.append(_phase(self.meter, "loop:step:commit", step_commit))
        return phases

    def prefill_call(self) -> list[MeteredPhase]:
        return [_phase(self.meter, "loop:prefill", lambda: prefill(
            self.t.target, self.run, list(range(self.shapes.refill)), self.refill, [UNBOUNDED] * len(self.refill),
            drafter=self.t.drafter, sampling=self.t.sampling, eos=self.no_eos, generator=self.gen))]


def run_phase_loops(t: LoopTarget, shapes: LoopShapes, meter, *, min_s: float | None = None,
                    phases: Sequence[str] = LOOP_PHASES, seed: int = 0) -> dict[str, Loop]:
    """Each phase of the run's step alone, and the whole step, in loops the meter's counter resolves.

    Args:
        t: the run's target, drafter, verify callable and settings.
        shapes: the run's shapes.
        meter: a counter meter (``counter.read()``, ``period_s``, ``begin``/``end``); the loops
            leave it with no run open.
        min_s: seconds per loop on the counter's clock (the step loop runs
            :data:`STEP_LOOP_SPANS` times it); default the split gate's floor (ten counter
            periods, at least one second). A shorter loop runs, and fails the gate.
        phases: which loops to run, in order (the prefill loop overwrites the set-up's rows, so
            it comes last).
        seed: the sampling generator's seed.

    Returns:
        phase -> :class:`~refspec.energy.accounting.attribution.Loop` (energy over the loop, its duration,
        iterations; the ``step`` loop also its phases' times).
    """
    if len(shapes.prompts) < shapes.batch or not 1 <= shapes.refill <= shapes.batch:
        raise ValueError(f"loops need {shapes.batch} prompts and a refill group of 1..{shapes.batch}, got "
                         f"{len(shapes.prompts)} prompts and {shapes.refill}")
    dev = t.target.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    min_s = GATE.floor_s(meter.period_s) if min_s is None else min_s
    out: dict[str, Loop] = {}
    with torch.inference_mode():
        loops = _Loops(t, shapes, meter, torch.Generator(device=dev).manual_seed(seed))
        bodies = {"draft": loops.draft_call, "verify": loops.verify_call, "commit": loops.commit_call,
                  "step": loops.step_call, "prefill": loops.prefill_call}
        try:
            for name in phases:
                if name == "step" and t.drafter is not None:
                    t.drafter.commit(loops.run.state)  # as after a step: the first call catches it up
                rows = shapes.refill if name == "prefill" else None  # refills differ in rows: priced per row
                span = min_s * (STEP_LOOP_SPANS if name == "step" else 1)
                out[name] = _loop(meter, bodies[name], span, sync, rows=rows, keep_times=name == "step")
        finally:
            meter.abandon_run()  # the loops' phases opened a counter run the ledger never closes
    return out


__all__ = ["LOOP_PHASES", "LoopShapes", "LoopTarget", "run_phase_loops", "set_up_batch", "shapes_of"]
