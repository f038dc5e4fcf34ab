"""Energy: what each phase cost, measured or modelled, and the headline figures.

Reading order, from counter to J/token: :mod:`~refspec.energy.phases` (the vocabulary the engine
reports in: a phase event, its forwards' shapes, a measurement with its source),
:mod:`~refspec.energy.meters` (Zeus/NVML, roofline, time and fake meters),
:mod:`~refspec.energy.ledger` (one JSONL record per step and phase),
:mod:`~refspec.energy.accounting` (the only place the headline figures are computed; its text
in :mod:`~refspec.energy.accounting_text`). Beside them: :mod:`~refspec.energy.roofline`,
:mod:`~refspec.energy.hardware` and :mod:`~refspec.energy.architectures` (the analytic model,
hardware profiles and named targets), :mod:`~refspec.energy.latency` (latency targets),
:mod:`~refspec.energy.dvfs` (clock sweeps on a user's own GPU), :mod:`~refspec.energy.attribution`
(phase energy from isolated loops and window regression); :mod:`~refspec.energy.zeus_meter` and
:mod:`~refspec.energy.windows` hold the Zeus meter and window bookkeeping behind ``meters``.

From the core this package imports only :mod:`refspec.config`.
"""
