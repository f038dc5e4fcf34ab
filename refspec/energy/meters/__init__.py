"""Energy meters: bracket a named window and say what it cost, and where the figure came from.

Reading order: :mod:`~refspec.energy.meters.measurement` (``Measurement``, the ``EnergyMeter``
protocol) and :mod:`~refspec.energy.meters.errors`; :mod:`~refspec.energy.meters.timers` (how a
window is timed); :mod:`~refspec.energy.meters.direct` (time-only, fake and roofline meters, which
give every window its figures); :mod:`~refspec.energy.meters.counters` (cumulative counters of
one or more devices) and the hardware behind them, :mod:`~refspec.energy.meters.nvml`,
:mod:`~refspec.energy.meters.zeus`, :mod:`~refspec.energy.meters.rapl`;
:mod:`~refspec.energy.meters.windowed` (a run's meter over a counter that cannot see a phase);
:mod:`~refspec.energy.meters.simulated` (a simulated counter over the device law of
:mod:`~refspec.energy.meters.device_law`);
:mod:`~refspec.energy.meters.spec` (the ``--meter`` grammar) and
:mod:`~refspec.energy.meters.make` (a meter from a spec). :mod:`~refspec.energy.meters.dvfs` locks and
sweeps a user's own GPU's SM clock.
"""
