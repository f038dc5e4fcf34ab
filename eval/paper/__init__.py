"""``python -m refspec.eval paper`` (:func:`refspec.eval.paper.cli.main`): the seven claims of "Only
Accepted Tokens Count" (arXiv 2610.40287) answered on the hardware at hand, each with a verdict and
the source of every number.

Reading order: :mod:`~refspec.eval.paper.cli` (flags, checks, the plan), :mod:`.grid` (blocks,
shapes, variants, windows, the plan's seconds), :mod:`.acceptance` (the injected levels and the
recorded taus), :mod:`.bench` (meter, counter period, ceilings), :mod:`.targets` (random-weight
targets, drafters, the CPU's real-shape pricing), :mod:`.point` and :mod:`.run` (one shape's
runs, the grid under the budget), :mod:`.claims` (the verdicts), :mod:`.report` and
:mod:`.plots` (what is written). docs/gpu.md says how to run it on a lent GPU.
"""
