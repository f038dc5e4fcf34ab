"""Energy: what each phase cost, measured or modelled, and the headline figures.

Four sub-packages, each importing only those listed before it (and, from the core, only
:mod:`refspec.config`):

1. :mod:`refspec.energy.model`: the analytic model. The work a forward reports
   (:mod:`~refspec.energy.model.work`), its FLOPs and bytes (:mod:`~refspec.energy.model.roofline`,
   :mod:`~refspec.energy.model.cost`, :mod:`~refspec.energy.model.experts`), hardware profiles and
   named targets.
2. :mod:`refspec.energy.meters`: the one meter API (:mod:`~refspec.energy.meters.measurement`:
   ``Measurement``, ``EnergyMeter``), the meters, the counters they read (NVML, Zeus, RAPL, and
   the simulated counter of :mod:`refspec.energy.meters.simulated` over its own device law,
   :mod:`refspec.energy.meters.device_law`), :func:`make_meter
   <refspec.energy.meters.make.make_meter>` from a ``--meter`` spec, and SM clock sweeps on a
   user's own GPU (:mod:`~refspec.energy.meters.dvfs`).
3. :mod:`refspec.energy.ledger`: the phase events the engine reports, the JSONL ledger they are
   written to, its format, reading it back and grouping its records into steps.
4. :mod:`refspec.energy.accounting`: the headline figures, computed from ledger records alone
   (:mod:`~refspec.energy.accounting.headline`), with each phase's energy read or attributed from
   counter windows and loops (:mod:`refspec.energy.accounting.phase_energy`,
   :mod:`refspec.energy.accounting.attribution`) behind a gate (:mod:`refspec.energy.accounting.split_gate`,
   :mod:`refspec.energy.accounting.mix_check`), per request
   (:mod:`refspec.energy.accounting.per_request`), and latency targets.

From counter to J/token a reader follows: a counter (``meters.nvml``, ``meters.rapl``) ->
``meters.windowed`` (reads it over windows it resolves) -> ``ledger.events`` and
``ledger.writer`` (phase and counter records) -> ``ledger.step_groups`` ->
``accounting.phase_energy`` -> ``accounting.serving_window`` -> ``accounting.headline``.
A modelled run replaces the first two by ``meters.direct.RooflineMeter`` over ``model.roofline``.
Tensor parallelism's rank meter and interconnect cost are :mod:`refspec.models.tp.rank_meter` and
:mod:`refspec.models.tp.interconnect`.
"""
