"""Energy of every rank of a tensor-parallel run, one phase at a time.

Each rank meters its own device; :class:`RankMeter` wraps that meter. Closing a phase also
takes the phase's time in collectives (:class:`~refspec.models.tp.group.CommClock`). When the
engine first reads the phase's measurement (after the step's host sync) every rank's figures
are gathered over the host group (one small collective per phase), so every rank holds the
same :class:`RankMeasurement`:

- ``time_s``: the slowest rank's time (the step waits for it; every rank's scheduler clock then
  advances alike, so open-loop admissions stay the same on every rank);
- ``energy_j``: the sum over ranks (None where the meter reads no per-phase energy);
- ``extra`` fields copied into the ledger's phase record: :data:`RANK_FIELDS`.

Counters (NVML, RAPL) cannot see a phase and are read over windows
(:class:`~refspec.energy.meters.windowed.WindowedMeter`). In a tensor-parallel run rank 0 reads them for
the whole node: NVML's counter of every GPU of the group (per GPU in the counter records'
``devices``, so per rank), RAPL's package counter (which both CPU ranks share: it cannot be split
per rank). The other ranks time their phases only (:func:`rank_meter`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from refspec.energy.meters.measurement import Measurement, Windows
from refspec.energy.meters.timers import default_timer
from refspec.energy.model.work import ForwardShape
from refspec.models.tp.group import TensorParallel, TPError, broadcast_object, gather_objects

log = logging.getLogger(__name__)

RANK_FIELDS: dict[str, str] = {
    "ranks": "tensor-parallel ranks N that ran the phase; time_s is the slowest rank's, energy_j the sum over "
             "ranks (int)",
    "rank_time_s": "each rank's time of the phase, s, in rank order (list of float)",
    "rank_energy_j": "each rank's energy of the phase, J, in rank order; absent where the meter reads none per "
                     "phase (a counter: see the counter records' devices) (list of float)",
    "rank_comm_s": "each rank's time inside collectives during the phase, s (list of float; null on a GPU replaying "
                   "a CUDA graph, whose collectives are not timed)",
    "comm_share": "sum of rank_comm_s / sum of rank_time_s: the share of the ranks' time spent in collectives "
                  "(float or null)",
}
"""Fields a tensor-parallel phase record carries beside the usual ones, name -> description."""


class RankMeasurement(Measurement):
    """A phase's measurement over every rank, gathered when first read (see the module docstring).

    Args:
        local: this rank's measurement.
        comm_s: this rank's seconds in collectives (or a resolver of them, on a GPU).
        tp: the group.
    """

    def __init__(self, local: Measurement, comm_s: float | Callable[[], float] | None, tp: TensorParallel) -> None:
        object.__setattr__(self, "_local", local)
        object.__setattr__(self, "_comm", comm_s)
        object.__setattr__(self, "_tp", tp)
        object.__setattr__(self, "_done", None)

    def _resolve(self) -> tuple[float, float | None, str, tuple]:
        if self._done is None:
            local, comm = self._local, self._comm
            comm_s = comm() if callable(comm) else comm
            mine = (float(local.time_s), local.energy_j, local.source, comm_s)
            ranks = gather_objects(mine, self._tp)
            times = [r[0] for r in ranks]
            energies = [r[1] for r in ranks]
            comms = [r[3] for r in ranks]
            energy = sum(energies) if all(e is not None for e in energies) else None
            extra = dict(local.extra)
            extra.update(ranks=len(ranks), rank_time_s=times, rank_comm_s=comms)
            if energy is not None:
                extra["rank_energy_j"] = energies
            total = sum(times)
            extra["comm_share"] = sum(comms) / total if None not in comms and total > 0 else None
            object.__setattr__(self, "_done", (max(times), energy, ranks[0][2], tuple(extra.items())))
        return self._done

    @property
    def time_s(self) -> float:  # type: ignore[override]
        return self._resolve()[0]

    @property
    def energy_j(self) -> float | None:  # type: ignore[override]
        return self._resolve()[1]

    @property
    def source(self) -> str:  # type: ignore[override]
        return self._resolve()[2]

    @property
    def extra(self) -> tuple[tuple[str, Any], ...]:  # type: ignore[override]
        return self._resolve()[3]

    @property
    def marks(self) -> tuple:
        """The counter reads taken at the phase's bounds (rank 0's counter meter; none elsewhere)."""
        self._resolve()
        return tuple(getattr(self._local, "marks", ()))


class TimerMeter:
    """Phase times without synchronising and no energy (a rank whose device rank 0's counter reads)."""

    source = "none:time-only"

    def __init__(self) -> None:
        self._timer = default_timer()
        self._windows = Windows()

    def begin(self, name: str) -> None:
        self._windows.push(name, self._timer.start())

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        return Measurement(self._timer.stop(self._windows.pop(name), work), None, self.source)


class RankMeter:
    """One rank's :class:`~refspec.energy.meters.measurement.EnergyMeter` in a tensor-parallel run.

    Everything but ``begin`` and ``end`` is the wrapped meter's (``idle_w``, a counter meter's
    ``finish_run`` ...).

    Args:
        inner: this rank's own meter.
        tp: the group.
    """

    def __init__(self, inner: Any, tp: TensorParallel) -> None:
        self.inner = inner
        self.tp = tp
        self._windows = Windows()

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "tp", "_windows"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def source(self) -> str:
        return self.inner.source

    def begin(self, name: str) -> None:
        """Open ``name`` on this rank's meter and mark its collective time."""
        if not self._windows.names():
            self.tp.comm.reset()  # GPU events of finished phases are read already
        self._windows.push(name, self.tp.comm.mark())
        self.inner.begin(name)

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> RankMeasurement:
        """Close ``name``; the measurement gathers every rank's figures when first read."""
        local = self.inner.end(name, work)
        return RankMeasurement(local, self.tp.comm.since(self._windows.pop(name)), self.tp)


def _counter_spec(spec: str, tp: TensorParallel) -> str:
    """``spec`` reading every GPU of the group on rank 0 (NVML kinds without ``gpus=``)."""
    kind = spec.partition(":")[0].lower()
    if tp.device.type == "cuda" and kind in ("auto", "zeus", "nvml") and "gpus=" not in spec:
        return f"{spec}:gpus={','.join(str(i) for i in range(tp.size))}"
    return spec


def rank_meter(spec: str, tp: TensorParallel, make: Callable[[str], Any]) -> RankMeter:
    """This rank's meter for a ``--meter`` spec (``make`` builds a meter from a spec, as
    :func:`~refspec.energy.meters.make.make_meter` does).

    Rank 0 builds the spec's meter (a counter kind over every GPU of the node); when that meter
    reads a counter, the other ranks time their phases only, else each builds its own.

    Raises:
        TPError: a simulated counter (its truth would be one rank's share).
    """
    if spec.partition(":")[0].lower() == "simulated":
        raise TPError("--meter simulated models one device's counter; with --tp use roofline, time, or a real "
                      "counter (nvml, zeus, rapl)")
    meter = make(_counter_spec(spec, tp)) if tp.rank == 0 else None
    counter = broadcast_object(callable(getattr(meter, "finish_run", None)), tp)
    if tp.rank != 0:
        meter = TimerMeter() if counter else make(spec)
    if counter and tp.rank == 0:
        log.info("tensor parallelism: rank 0 reads %s for all %d ranks; the other ranks time their phases", meter.source,
                 tp.size)
    return RankMeter(meter, tp)


__all__ = ["RANK_FIELDS", "RankMeasurement", "RankMeter", "TimerMeter", "rank_meter"]
