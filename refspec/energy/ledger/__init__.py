"""The ledger: every phase of every step as the engine reported it, the only input of the accounting.

Reading order: :mod:`~refspec.energy.ledger.events` (the phase event the engine hands its
observers); :mod:`~refspec.energy.ledger.format` (the record kinds, their fields and version);
:mod:`~refspec.energy.ledger.writer` (the JSONL writer, an engine observer);
:mod:`~refspec.energy.ledger.counter_records` (a counter meter's reads as ``counter`` records);
:mod:`~refspec.energy.ledger.read` (reading a file back); :mod:`~refspec.energy.ledger.step_groups`
(one run's phase records grouped into steps, what the accounting reads).
"""
