"""The batch's device state between steps, and filling slots with new requests (prefill).

The engine keeps B static slots (rows). :func:`new_batch` allocates their state with every
slot empty (``done``); :func:`fill` prefills admitted requests into their slots in one metered
``prefill`` phase: one target forward over only those R rows, writing their keys and values
into the slots' own cache rows (a :class:`~refspec.cache.RowView`; the whole cache when all B
slots fill at once), then the drafter's reset: ``reset(state)`` for a whole batch,
``reset_rows(state, rows, hidden)`` for some of its rows.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from refspec.drafting import DecodeState
from refspec.energy.phases import MeteredPhase, PhaseEvent
from refspec.sampling import choose
from refspec.scheduler import Scheduler
from refspec.serving import Request


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass
class Batch:
    """What the loop carries between steps (device tensors, and the host copies of one sync)."""

    state: DecodeState
    cache: object  # the target's StaticKVCache (or a CUDA-graph runner's view of its pool)
    slots: int  # T, cache slots per row
    out: torch.Tensor  # [B, max budget + K + 1] emitted tokens
    n_out: torch.Tensor  # [B] tokens emitted so far
    budget: torch.Tensor  # [B] max_new_tokens of each slot's request
    done_host: list[bool]
    lengths_host: list[int]
    events: list[PhaseEvent]


def new_batch(engine, batch: int, t_slots: int, max_budget: int) -> Batch:
    """B empty slots (``done``) with a cache of ``t_slots`` slots per row."""
    dev = engine.target.device
    cache = engine._cache_for(batch, t_slots)
    zeros = torch.zeros(batch, dtype=torch.long, device=dev)
    state = DecodeState(tokens=torch.zeros(batch, t_slots, dtype=torch.long, device=dev), lengths=cache.lengths,
                        prev_lengths=zeros.clone(), pending=zeros.clone(), prompt_lengths=zeros.clone(),
                        done=torch.ones(batch, dtype=torch.bool, device=dev), hidden=[], num_accepted=zeros.clone(),
                        sampling=engine.config.sampling, generator=None, step=0, max_length_bound=1,
                        target_args=engine.target.args, dtype_bytes=engine.dtype_bytes)
    out = torch.zeros(batch, max_budget + engine.config.k + 1, dtype=torch.long, device=dev)
    return Batch(state=state, cache=cache, slots=t_slots, out=out, n_out=zeros.clone(), budget=zeros.clone(),
                 done_host=[True] * batch, lengths_host=[0] * batch, events=[])


def fill(engine, run: Batch, sched: Scheduler, pairs: Sequence[tuple[int, Request]], step: int,
         generator: torch.Generator | None) -> None:
    """Prefill the requests ``pairs`` (``(slot, request)``, slots ascending) into their slots:
    the whole prompt in one target forward over those R rows (the first token comes from its
    last logits), then the drafter's reset; one metered ``prefill`` phase, reported as an event
    whose ``step`` is the decode step after which it ran."""
    cfg, drafter, dev, state = engine.config, engine.drafter, engine.target.device, run.state
    b, r = state.batch, len(pairs)
    whole = r == b  # every slot at once: the plain batch prefill and reset(state)
    rows = torch.tensor([slot for slot, _ in pairs], dtype=torch.long, device=dev)  # [R]
    plens = torch.tensor([len(q.prompt) for _, q in pairs], dtype=torch.long, device=dev)  # [R]
    budgets = torch.tensor([q.max_new_tokens for _, q in pairs], dtype=torch.long, device=dev)  # [R]
    s_max = int(max(len(q.prompt) for _, q in pairs))
    tokens = torch.zeros(r, run.slots, dtype=torch.long, device=dev)  # [R, T]
    for i, (_, q) in enumerate(pairs):
        tokens[i, : len(q.prompt)] = torch.tensor(q.prompt, dtype=torch.long)
    hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    state.generator = generator
    with MeteredPhase(engine.meter, "prefill") as phase:
        positions = torch.arange(s_max, device=dev)[None].expand(r, s_max)  # [R, S]
        logits, hidden = engine.target(tokens[:, :s_max], positions, run.cache if whole else run.cache.rows(rows),
                                       num_keys=min(run.slots, _round_up(s_max, cfg.kv_bucket)),
                                       logits_at=(plens - 1)[:, None], hidden_layers=hidden_layers)
        first = choose(logits[:, 0], cfg.sampling, generator)  # [R]
        tokens.scatter_(1, plens[:, None], first[:, None])
        state.tokens[rows] = tokens
        run.cache.lengths[rows] = plens  # state.lengths is the cache's
        state.prev_lengths[rows] = torch.zeros_like(plens) if whole else plens
        state.prompt_lengths[rows] = plens
        state.pending[rows] = first
        state.num_accepted[rows] = 0
        state.done[rows] = torch.isin(first, engine.eos) | (budgets <= 1)
        run.out.index_fill_(0, rows, 0)
        run.out[rows, 0] = first
        run.n_out[rows] = 1
        run.budget[rows] = budgets
        for slot, q in pairs:
            run.lengths_host[slot] = len(q.prompt)
        state.max_length_bound = max(run.lengths_host) + 1
        if whole:
            state.hidden = hidden
        elif not state.hidden:  # no step yet: one column of zero features per slot until the first verify
            state.hidden = [h.new_zeros(b, 1, h.shape[-1]) for h in hidden]
        if drafter is not None:
            drafter.reset(state) if whole else drafter.reset_rows(state, rows, hidden)
        done = state.done[rows].tolist()  # host sync
    for (slot, _), d in zip(pairs, done):
        run.done_host[slot] = bool(d)
    clock_s = sched.advance(phase.measurement.time_s)
    sched.first_tokens(pairs)
    emitted_per_row = [0] * b
    for slot, _ in pairs:
        emitted_per_row[slot] = 1
    engine._emit(PhaseEvent(step=step, phase="prefill", batch=b, rows_active=r, emitted=r, work=phase.work,
                            measurement=phase.measurement, emitted_per_row=tuple(emitted_per_row),
                            slot_requests=Scheduler.prefill_slots(b, pairs), arrivals_s=sched.arrivals(pairs),
                            queued=sched.queued, clock_s=clock_s), run.events)


def release(engine, run: Batch, sched: Scheduler, *, unfinished: bool = False) -> None:
    """Free every slot whose request finished (and, with ``unfinished``, every busy slot: the
    end of a run cut by ``max_steps``), handing its tokens to the scheduler (one host sync)."""
    slots = [i for i, rid in enumerate(sched.slot_req) if rid >= 0 and (unfinished or run.done_host[i])]
    if not slots:
        return
    idx = torch.tensor(slots, dtype=torch.long, device=run.out.device)
    outs, counts = run.out[idx].tolist(), run.n_out[idx].tolist()
    eos = set(engine.eos.tolist())
    for slot, row, n in zip(slots, outs, counts):
        sched.finish(slot, row[:n], eos)


__all__ = ["Batch", "new_batch", "fill", "release"]
