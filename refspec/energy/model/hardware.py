"""Hardware profiles of the roofline model: peak FLOP/s, bandwidth and energy coefficients.

The GPU profiles' peak and bandwidth are data-sheet numbers; their energy coefficients are
priors from the paper's range, to be calibrated on a real GPU. The CPU profile times this
machine's bandwidth and peak at first use; its energy coefficients are uncalibrated priors (no
RAPL counter is readable here), so every CPU energy figure is modelled. The cost of a forward
is :mod:`refspec.energy.model.roofline`'s.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

from refspec.energy.model.cost import Cost

logger = logging.getLogger(__name__)

PICO = 1e-12


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Roofline and energy coefficients of one device.

    Attributes:
        name: short id used in energy sources, e.g. ``"h200-sxm"``.
        peak_flops: dense peak in FLOP/s for the modelled dtype (bf16 on GPUs).
        bandwidth_Bps: main-memory bandwidth in bytes/s.
        static_w: power drawn while a forward runs, independent of the work done, in W.
        pj_per_flop: dynamic energy per FLOP in pJ.
        pj_per_byte: dynamic energy per byte moved from/to main memory in pJ.
        idle_w: power of the idle device in W (what "net of idle" subtracts).
        overhead_s: fixed time per forward (launch / dispatch) in s.
        benchmarked: whether peak and bandwidth were timed on this machine by benchmarks (not the
            data sheet); its energy coefficients stay modelled either way.
        link_Bps: GPU-to-GPU bandwidth per GPU in one direction, bytes/s (NVLink), for
            tensor-parallel collectives (:mod:`refspec.models.tp.interconnect`); None: no link modelled.
        link_latency_s: fixed time of one collective on that link, s.
        link_pj_per_byte: dynamic energy per byte a GPU sends over the link, pJ.
    """

    name: str
    peak_flops: float
    bandwidth_Bps: float
    static_w: float
    pj_per_flop: float
    pj_per_byte: float
    idle_w: float
    overhead_s: float = 0.0
    benchmarked: bool = False
    link_Bps: float | None = None
    link_latency_s: float = 0.0
    link_pj_per_byte: float = 0.0

    @property
    def ridge(self) -> float:
        """Balance point in FLOP/byte: above it a forward is compute-bound."""
        return self.peak_flops / self.bandwidth_Bps

    def time_s(self, cost: Cost, forwards: int = 1) -> float:
        """Roofline time of ``cost`` spread over ``forwards`` sequential forwards, in s."""
        return max(cost.flops / self.peak_flops, cost.bytes / self.bandwidth_Bps) + forwards * self.overhead_s

    def energy_j(self, cost: Cost, time_s: float) -> float:
        """Energy in J of ``cost`` done in ``time_s`` seconds: static + per-FLOP + per-byte."""
        return self.static_w * time_s + PICO * (self.pj_per_flop * cost.flops + self.pj_per_byte * cost.bytes)


# GPU energy coefficients are the midpoints of the paper's priors (static 60-100 W,
# 0.4-0.8 pJ/FLOP, 30-50 pJ/B); idle ~70 W is typical of an idle SXM board. Overhead 30 us per
# forward assumes CUDA-graph replay. Calibrate with refspec.energy.accounting.attribution on a real GPU.
# NVLink 4 on H100/H200 SXM: 900 GB/s per GPU with both directions together, so 450 GB/s each
# way; ~10 us per small NCCL all-reduce inside one node and ~10 pJ per link byte are priors.
_NVLINK4 = dict(link_Bps=450e9, link_latency_s=10e-6, link_pj_per_byte=10.0)
H100_SXM = HardwareProfile(name="h100-sxm", peak_flops=989e12, bandwidth_Bps=3.35e12, static_w=80.0,
                           pj_per_flop=0.6, pj_per_byte=40.0, idle_w=70.0, overhead_s=30e-6, **_NVLINK4)
H200_SXM = HardwareProfile(name="h200-sxm", peak_flops=989e12, bandwidth_Bps=4.8e12, static_w=80.0,
                           pj_per_flop=0.6, pj_per_byte=40.0, idle_w=70.0, overhead_s=30e-6, **_NVLINK4)
GPU_PROFILES: dict[str, HardwareProfile] = {"h100": H100_SXM, "h100-sxm": H100_SXM,
                                            "h200": H200_SXM, "h200-sxm": H200_SXM}

# CPU energy priors (uncalibrated: no RAPL here): two cores' share of package static power,
# AVX-512 FMA energy per FLOP, DRAM + controller energy per byte.
CPU_STATIC_W = 15.0
CPU_IDLE_W = 5.0
CPU_PJ_PER_FLOP = 10.0
CPU_PJ_PER_BYTE = 100.0


def _bench(fn: Any, reps: int = 5, budget_s: float = 0.15) -> float:
    """Best wall time of up to ``reps`` calls of ``fn`` (stopping after ``budget_s``), after a warm-up."""
    fn()
    best = math.inf
    spent = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best


@functools.lru_cache(maxsize=None)
def cpu_profile(dtype_bytes: int = 2, weight_mib: int = 64) -> HardwareProfile:
    """Profile of this CPU, with bandwidth and peak timed now (~0.5 s, cached per process).

    Bandwidth is what a decode forward sees: ``F.linear`` of one token against a ``weight_mib`` MiB
    weight matrix (larger than the last-level cache), bytes of the matrix / best time. Peak is
    ``F.linear`` of 512 tokens against a 512 x 512 matrix, 2 x 512^3 FLOPs / best time (the
    model's own GEMM path; plain ``a @ b`` in bf16 is far slower on CPUs without AVX512_BF16).
    Both use the current torch thread count.

    Args:
        dtype_bytes: 2 measures bf16 kernels, 4 fp32.
        weight_mib: size of the streamed matrix in MiB; keep it above the last-level cache.

    Returns:
        A profile named ``cpu-<dtype>-<threads>t`` with ``benchmarked=True`` and the CPU energy
        priors (modelled: there is no energy counter on this machine).
    """
    import torch

    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16) or 4 (fp32), got {dtype_bytes}")
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    w = torch.full(((weight_mib << 20) // (4096 * dtype_bytes), 4096), 0.5, dtype=dtype)  # values do not matter
    x = torch.full((1, 4096), 0.5, dtype=dtype)
    with torch.inference_mode():
        bandwidth = w.numel() * dtype_bytes / _bench(lambda: torch.nn.functional.linear(x, w))
        n = 512
        a = torch.full((n, n), 0.5, dtype=dtype)
        b = torch.full((n, n), 0.25, dtype=dtype)
        peak = 2 * n**3 / _bench(lambda: torch.nn.functional.linear(a, b))
    threads = torch.get_num_threads()
    name = f"cpu-{'bf16' if dtype_bytes == 2 else 'fp32'}-{threads}t"
    logger.info("benchmarked %s: %.1f GB/s matrix-vector, %.1f GFLOP/s matmul", name, bandwidth / 1e9, peak / 1e9)
    return HardwareProfile(name=name, peak_flops=peak, bandwidth_Bps=bandwidth, static_w=CPU_STATIC_W,
                           pj_per_flop=CPU_PJ_PER_FLOP, pj_per_byte=CPU_PJ_PER_BYTE, idle_w=CPU_IDLE_W,
                           overhead_s=0.0, benchmarked=True)


def get_profile(name: str, dtype_bytes: int = 2) -> HardwareProfile:
    """Profile by name: ``h100``/``h100-sxm``, ``h200``/``h200-sxm``, or ``cpu`` (benchmarked now)."""
    if name == "cpu" or name.startswith("cpu-"):
        return cpu_profile(dtype_bytes)
    try:
        return GPU_PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; choose cpu, {', '.join(sorted(GPU_PROFILES))}") from None
