"""The GPU check's parts, imported by ``scripts/gpu_check.py`` (run that, not these).

``grid`` (the blocks of the paper's grid and their planned seconds), ``runner`` (block by block,
point by point, within the budget), ``bench`` (the meter, rooflines and current target the
points share), ``point`` (one batch x drafter x corpus point, static schedule), ``serving`` (the
same under continuous batching, steady-state window), ``drafting`` (the random-weight EAGLE and
block drafters, injected acceptance), ``phase_loops`` (measured per-phase energy), ``claims``
(a table per claim of the paper, the crossover), ``outputs`` (plots and tables), ``ceilings``
(copy and GEMM ceilings measured in the run), ``results`` (the JSON rewritten after every
point, the $OUT limits), ``gpu_tests`` (the GPU-marked pytest run).
"""
