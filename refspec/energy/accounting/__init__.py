"""The accounting: headline figures of ledger runs, and nothing else computes them.

Reading order: :mod:`~refspec.energy.accounting.serving_window` (the steady-state window, its
validity, per-request latencies); :mod:`~refspec.energy.accounting.headline` (J/token, tau,
TPOT, line items and their closure, for one run or pooled runs);
:mod:`~refspec.energy.accounting.text` (the statement a run prints);
:mod:`~refspec.energy.accounting.latency` (an operating point under latency targets). Each phase's
energy, read or attributed, comes from :mod:`~refspec.energy.accounting.phase_energy`: loops and a
fit over sub-windows (:mod:`~refspec.energy.accounting.attribution`), every split behind a gate
(:mod:`~refspec.energy.accounting.split_gate`), a second mix to determine the fit
(:mod:`~refspec.energy.accounting.mix_check`); per request, :mod:`~refspec.energy.accounting.per_request`.
"""
