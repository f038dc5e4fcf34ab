"""Ceilings measured on the GPU at start: a large device-to-device copy and a large GEMM.

A data sheet's bandwidth and peak are not what a GPU reaches (an H200 copies at about 4.3 of its
4.8 TB/s and multiplies at 770-800 of its 989 TFLOP/s), so predictions beside measured figures
use these; the data sheet's stay beside them. Operands are normal random data: a GEMM on zeros
runs faster (less switching) and would overstate the ceiling.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class CeilingShapes:
    """Sizes of the two ceiling kernels.

    Attributes:
        copy_bytes: bytes of the copied buffer (the copy reads and writes this many).
        gemm_n: the GEMM is ``[n, n] @ [n, n]``.
        repeats: kernels per timed trial.
        trials: timed trials; the best trial is the ceiling, the median is reported beside it.
    """

    copy_bytes: int
    gemm_n: int
    repeats: int
    trials: int


GPU_SHAPES = CeilingShapes(copy_bytes=2 << 30, gemm_n=8192, repeats=20, trials=5)
SMALL_SHAPES = CeilingShapes(copy_bytes=8 << 20, gemm_n=256, repeats=3, trials=2)  # tests


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """A function that times ``fn()`` in seconds: CUDA events on a GPU, perf_counter on a CPU."""
    if device.type == "cuda":
        def gpu_time(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return gpu_time

    def cpu_time(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return cpu_time


def _rate(work: float, fn: Callable[[], None], shapes: CeilingShapes, device: torch.device) -> dict[str, float]:
    """Work per second of ``fn`` repeated: best and median over trials, after one warm-up."""
    timer = _timer(device)
    fn()

    def many() -> None:
        for _ in range(shapes.repeats):
            fn()

    rates = [work * shapes.repeats / timer(many) for _ in range(shapes.trials)]
    return {"best": max(rates), "median": statistics.median(rates)}


def _copy_rate(device: torch.device, dtype: torch.dtype, shapes: CeilingShapes, g: torch.Generator
               ) -> dict[str, float]:
    """Device-to-device copy of ``copy_bytes`` of random data, in B/s counting read + write."""
    n_elem = shapes.copy_bytes * 8 // torch.finfo(dtype).bits
    src = torch.randn(n_elem, generator=g, device=device, dtype=torch.float32).to(dtype)
    dst = torch.empty_like(src)
    return _rate(2.0 * src.numel() * src.element_size(), lambda: dst.copy_(src), shapes, device)


def _gemm_rate(device: torch.device, dtype: torch.dtype, shapes: CeilingShapes, g: torch.Generator
               ) -> dict[str, float]:
    """``[n, n] @ [n, n]`` on normal random operands, in FLOP/s."""
    n = shapes.gemm_n
    a = torch.randn(n, n, generator=g, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=torch.float32).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    assert bool(a.abs().sum() > 0) and bool(b.abs().sum() > 0), "ceiling operands must not be zeros"
    return _rate(2.0 * n ** 3, lambda: torch.mm(a, b, out=c), shapes, device)


def measure_ceilings(device: torch.device, dtype: torch.dtype, shapes: CeilingShapes) -> dict[str, Any]:
    """Copy bandwidth (read + write, B/s) and GEMM throughput (FLOP/s) of ``device``.

    Returns:
        ``{"copy": {...}, "gemm": {...}}``, each with ``best`` and ``median`` rates, its shape
        and its unit, measured on random data.
    """
    g = torch.Generator(device=device).manual_seed(1234)
    copy = _copy_rate(device, dtype, shapes, g)
    gemm = _gemm_rate(device, dtype, shapes, g)  # the copy's buffers are freed by now
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy": {**copy, "unit": "B/s (read + write)", "bytes": shapes.copy_bytes, "dtype": str(dtype)},
            "gemm": {**gemm, "unit": "FLOP/s", "n": shapes.gemm_n, "dtype": str(dtype), "data": "randn"},
            "repeats": shapes.repeats, "trials": shapes.trials}


def profile_with_ceilings(profile: Any, ceilings: dict[str, Any]) -> Any:
    """``profile`` with the measured copy bandwidth and GEMM peak (best trials) in place of its own."""
    return dataclasses.replace(profile, name=f"{profile.name}@run-ceilings", peak_flops=ceilings["gemm"]["best"],
                               bandwidth_Bps=ceilings["copy"]["best"], benchmarked=True)
