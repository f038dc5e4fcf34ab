"""The GPU check's parts, imported by ``scripts/gpu_check.py`` (run that, not these).

``results`` (the JSON rewritten after every point, the $OUT limits), ``ceilings`` (copy and
GEMM ceilings measured in the run), ``bench`` (the target, runners, meter and roofline the
points share), ``point`` (one (batch, k) point), ``outputs`` (plots and the summary table),
``gpu_tests`` (the GPU-marked pytest run).
"""
