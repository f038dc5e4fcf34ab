"""The analytic model: what a forward costs on a given machine, from its shape alone.

Reading order: :mod:`~refspec.energy.model.work` (the shape a forward reports while a phase
records); :mod:`~refspec.energy.model.cost` (FLOPs and bytes); :mod:`~refspec.energy.model.hardware`
(profiles: peak, bandwidth, energy coefficients); :mod:`~refspec.energy.model.architectures` (named
targets); :mod:`~refspec.energy.model.experts` (mixture-of-experts reads);
:mod:`~refspec.energy.model.roofline` (a forward's cost, time and energy, and predictions of a
step).
"""
