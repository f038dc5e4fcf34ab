"""The one pipeline every measuring command runs: ``run``, ``sweep`` and ``paper``.

1. :func:`open_ledger`: a ledger run, the engine's observer; under a counter meter its reads
   are written beside the phase records (:func:`refspec.energy.ledger.counter_records.counter_ledger`).
2. :func:`serve`: the request stream through :meth:`refspec.engine.Engine.serve`, seeded; each
   further chunk of a stream (static lockstep batches, a paper variant's repeats) is a ledger run
   of its own (``ledger.begin_run``).
3. :func:`phase_loops` and :func:`write_loops`: under a counter meter, each phase alone in a loop
   at the run's shapes, the per-phase split's second source (:mod:`refspec.phase_loops`).
4. :func:`read_back` and :func:`account`: the ledger read back from disk, never the engine's own
   counts, and its runs pooled by :func:`refspec.energy.accounting.headline.pool_runs`.

What a command does around these steps (a configuration's record, a paper variant's figures)
reads the accounting alone. A run whose figures no record will name is marked aborted in the
ledger (:func:`refspec.energy.ledger.writer.mark_aborted`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from refspec.energy.accounting.headline import Accounting, pool_runs
from refspec.energy.accounting.split_gate import GATE
from refspec.energy.ledger.counter_records import counter_ledger
from refspec.energy.ledger.writer import Ledger
from refspec.energy.ledger.read import read_ledger

log = logging.getLogger(__name__)


def open_ledger(meter: Any, path: Path, run_id: str, labels: Mapping[str, Any], *, mode: str = "a",
                source: str | None = None, idle_w: float | None = None) -> Any:
    """A ledger at ``path`` with run ``run_id`` open (a context manager); a counter meter's reads go into it.

    Args:
        meter: the run's meter (its ``source`` labels the records unless ``source`` is given).
        path: the JSONL ledger (appended to with ``mode="a"``).
        run_id: the first run's id.
        labels: the first run's header labels.
        source: the records' meter source (default the meter's).
        idle_w: idle power for net-of-idle figures (default the meter's, when it has one).
    """
    idle = idle_w if idle_w is not None else getattr(meter, "idle_w", None)
    return counter_ledger(meter, Ledger(path, run_id=run_id, labels=dict(labels), mode=mode,
                                        meter_source=source or meter.source, idle_w=idle))


def reads_counter(meter: Any) -> bool:
    """Whether ``meter`` reads an energy counter over windows (its ledger then records the reads)."""
    return callable(getattr(meter, "finish_run", None))


def serve(engine: Any, requests: Sequence[Any], *, batch: int, seed: int, device: torch.device,
          refill: bool = True, max_len: int | None = None) -> Any:
    """Serve ``requests`` on ``batch`` slots (``refill=False``: one lockstep batch that drains), sampling
    from a generator seeded with ``seed``; returns the engine's ``ServeResult``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return engine.serve(list(requests), batch=batch, generator=gen, refill=refill,
                        **({"max_len": max_len} if max_len is not None else {}))


def phase_loops(engine: Any, meter: Any, results: Sequence[Any], *, batch: int, k: int,
                prompts: Sequence[Sequence[int]], min_s: float | None, seed: int, verify_fn: Any = None) -> dict:
    """Each phase of ``engine``'s step alone, at the shapes ``results`` ran, for a counter to resolve.

    Args:
        engine: the engine that served (its target, drafter, sampling, KV bucket and acceptance).
        meter: the counter meter.
        results: the ``ServeResult`` of each served chunk (their phase events give the shapes).
        batch: the run's slots.
        k: drafts per step.
        prompts: the prompts served.
        min_s: seconds per loop (None: the split gate's floor, ten counter periods and at least
            1 s). A shorter loop runs as asked, is logged, and fails the gate: the split is then
            ``measured-total-only`` with that reason.
        seed: the loops' sampling seed.
        verify_fn: the verify callable of the loops (default the engine's).

    Returns:
        Per phase, its loop (:class:`refspec.phase_loops.Loop`).
    """
    from refspec.phase_loops import LoopTarget, run_phase_loops, shapes_of

    floor = GATE.floor_s(getattr(meter, "period_s", None))
    if min_s is not None and min_s < floor:
        log.warning("phase loops of %.3g s are under the split gate's floor %.3g s (max(%d counter periods, %g s)): "
                    "the split will be measured-total-only", min_s, floor, GATE.min_periods, GATE.min_s)
    shapes = shapes_of([e for res in results for e in res.events], batch=batch, k=k, prompts=prompts)
    target = LoopTarget(target=engine.target, drafter=engine.drafter, verify_fn=verify_fn or engine.target,
                        sampling=engine.config.sampling, kv_bucket=engine.config.kv_bucket, accept=engine.acceptance_fn)
    return run_phase_loops(target, shapes, meter, min_s=min_s, seed=seed)


def write_loops(ledger: Any, loops: Mapping[str, Any], source: str) -> None:
    """Write each phase loop into the open ledger run (the loops' records sit beside its phases)."""
    for phase, loop in loops.items():
        ledger.write_loop(phase, loop, source)


def read_back(path: Path, *, offset: int = 0) -> Any:
    """The ledger records from byte ``offset`` on (a ledger's ``start_offset``), as written to disk."""
    return read_ledger(path, offset=offset)


def account(records: Any, run_ids: Sequence[str], *, min_window_s: float | None = None) -> Accounting:
    """The accounting of ``run_ids`` pooled (their steady-state windows at least ``min_window_s`` long to be valid).

    Raises:
        AccountingError: the runs cannot be accounted (:func:`refspec.energy.accounting.headline.pool_runs`).
    """
    extra = {} if min_window_s is None else {"min_window_s": min_window_s}
    return pool_runs(records, list(run_ids), **extra)


__all__ = ["open_ledger", "reads_counter", "serve", "phase_loops", "write_loops", "read_back", "account"]
