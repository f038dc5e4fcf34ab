"""Energy: what each phase cost, measured or modelled, and the headline figures.

Reading order, from counter to J/token: :mod:`~refspec.energy.phases` (the vocabulary the engine
reports in: a phase event, its forwards' shapes, a measurement with its source),
:mod:`~refspec.energy.meters` (a meter from its ``--meter`` spec, :mod:`~refspec.energy.meter_spec`:
roofline, time and fake meters, and :mod:`~refspec.energy.windowed` over a counter that cannot see
a phase: NVML's (:mod:`~refspec.energy.nvml_meter`, :mod:`~refspec.energy.zeus_meter`), RAPL's
(:mod:`~refspec.energy.rapl`) or a simulated one (:mod:`~refspec.energy.simulated`), each a
:mod:`~refspec.energy.counters` counter; its reads go into the ledger through
:mod:`~refspec.energy.counter_log`),
:mod:`~refspec.energy.ledger` (one JSONL record per step and phase; the record format in
:mod:`~refspec.energy.ledger_format`, reading back in :mod:`~refspec.energy.ledger_read`),
:mod:`~refspec.energy.steps` (records grouped into steps), :mod:`~refspec.energy.phase_energy`
(each phase's energy, as read or attributed from counter windows and loops with
:mod:`~refspec.energy.attribution`), :mod:`~refspec.energy.serving_window` (the steady-state
window, its validity, per-request latencies), :mod:`~refspec.energy.accounting` (the only place
the headline figures are computed; its text in :mod:`~refspec.energy.accounting_text`). Beside them: :mod:`~refspec.energy.roofline`,
:mod:`~refspec.energy.hardware` and :mod:`~refspec.energy.architectures` (the analytic model,
hardware profiles and named targets), :mod:`~refspec.energy.latency` (latency targets),
:mod:`~refspec.energy.dvfs` (clock sweeps on a user's own GPU), :mod:`~refspec.energy.cost` (the
FLOPs and bytes a profile prices); :mod:`~refspec.energy.windows` holds the
window bookkeeping and errors behind ``meters``.

From the core this package imports only :mod:`refspec.config`.
"""
