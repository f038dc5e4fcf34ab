"""What every (batch, k) point shares: the random-weight target, its runners, the meter and the
two rooflines (data sheet, and the ceilings measured in this run)."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time
from typing import Any

import torch

from gpucheck.ceilings import DRY_SHAPES, GPU_SHAPES, measure_ceilings, profile_with_ceilings

log = logging.getLogger("gpu_check")


class ModelledEnergyOnly(RuntimeError):
    """--require-measured-energy was given and no energy counter can be read."""


@dataclasses.dataclass
class Bench:
    """Everything the points share: the meter and rooflines for the whole run, the current target.

    ``profile`` is the run's roofline (measured ceilings), ``datasheet`` the device's data sheet
    (or, in a dry run, this CPU's calibrated profile). :func:`load_target` swaps the target
    between blocks; the per-target caches (drafter heads, phase loops, warmed points) go with it.
    """

    device: torch.device
    dtype: torch.dtype
    meter: Any
    meter_note: str
    profile: Any
    datasheet: Any
    ceilings: dict[str, Any]
    idle_w: float | None
    sm_clock: Any = None  # () -> SM clock in MHz, read passively; None where NVML cannot (a CPU)
    arch: str | None = None
    arch_label: str = ""
    target: Any = None
    target_runner: Any = None
    eager_runner: Any = None  # the same bucketing and padding without capture, for graphs vs eager
    max_len: int = 0
    heads: dict[str, Any] = dataclasses.field(default_factory=dict)  # drafter name -> its random head
    loops: dict[tuple, Any] = dataclasses.field(default_factory=dict)  # phase-loop shape -> its loop
    warmed: set = dataclasses.field(default_factory=set)  # (batch, drafter label, runner mode) warmed up

    @property
    def energy_measured(self) -> bool:
        return str(self.meter.source).startswith("measured:")


def _datasheet(dry: bool, dtype: torch.dtype) -> tuple[Any, str]:
    from refspec.energy.roofline import cpu_profile, get_profile

    if dry:
        return cpu_profile(torch.finfo(dtype).bits // 8), "this CPU's calibrated profile (cpu_profile)"
    name = torch.cuda.get_device_name(0)
    key = "h200" if "h200" in name.lower() else "h100" if "h100" in name.lower() else None
    prof = get_profile(key or "h200")
    return prof, f"data sheet {prof.name}" + ("" if key else f" (no profile for {name!r}; H200 assumed)")


def _measured_meter(dry: bool) -> tuple[Any, str, float | None] | str:
    """A measured meter on a GPU (zeus, pynvml counter, power integral) with the idle power it
    read, measured first while the GPU idles; else why there is none."""
    from refspec.energy.meters import NoGPUError, measured_gpu_meter

    if dry:
        return "dry run: no energy counter on a CPU"
    try:
        meter = measured_gpu_meter(0, sync=torch.cuda.synchronize)
    except NoGPUError as exc:
        return str(exc)
    idle_w = meter.measure_idle_w(3.0)
    return meter, f"MEASURED: {meter.source} read by {getattr(meter, 'reader', 'zeus')}", idle_w


def _modelled_meter(dry: bool, profile: Any, reason: str) -> tuple[Any, str, float | None]:
    from refspec.energy.meters import RooflineMeter

    meter = RooflineMeter(profile, time_source="wall_time", sync=None if dry else torch.cuda.synchronize)
    return meter, f"MODELLED by {meter.source} ({reason})", profile.idle_w


def build_bench(args: argparse.Namespace) -> Bench:
    """Measure the ceilings, then pick the meter; no target yet (:func:`load_target`)."""
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    datasheet, sheet_note = _datasheet(dry, dtype)
    measured = _measured_meter(dry)
    if isinstance(measured, str) and args.require_measured_energy:
        raise ModelledEnergyOnly(f"--require-measured-energy: only modelled energy is available ({measured})")
    t0 = time.perf_counter()
    ceilings = measure_ceilings(device, dtype, DRY_SHAPES if dry else GPU_SHAPES)
    ceilings["note"] = f"measured in this run; beside {sheet_note}"
    log.info("ceilings: copy %.3g B/s, gemm %.3g FLOP/s in %.1f s", ceilings["copy"]["best"],
             ceilings["gemm"]["best"], time.perf_counter() - t0)
    profile = profile_with_ceilings(datasheet, ceilings)
    meter, note, idle_w = _modelled_meter(dry, profile, measured) if isinstance(measured, str) else measured
    from refspec.energy.nvml_meter import sm_clock_reader

    clock = None if dry else sm_clock_reader(0)
    return Bench(device=device, dtype=dtype, meter=meter, meter_note=note, profile=profile, datasheet=datasheet,
                 ceilings=ceilings, idle_w=idle_w, sm_clock=clock)


def load_target(bench: Bench, args: argparse.Namespace, arch: str, *, max_batch: int, max_k: int,
                eager_batch: int = 0) -> None:
    """Replace ``bench``'s target by a random-weight ``arch`` with its runners (the old one is freed first)."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.models.random_models import random_model, shrunk_config

    if bench.arch == arch:
        return
    bench.target = bench.target_runner = bench.eager_runner = None
    bench.heads, bench.loops, bench.warmed = {}, {}, set()
    gc.collect()  # graphs, caches and heads of the old target may sit in reference cycles
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
    dry = args.dry_run
    config: Any = shrunk_config(arch) if dry else arch
    label = f"{arch} (toy: hidden 256, 2 layers, vocab 2048)" if dry else arch
    t0 = time.perf_counter()
    target = random_model(config, device=bench.device, dtype=bench.dtype, seed=args.seed)
    log.info("built random %s in %.1f s", label, time.perf_counter() - t0)
    if getattr(target.args, "num_experts", 0):
        target.set_moe_dispatch("grouped")  # capturable and routed experts only (a graph of `gather` runs dense)
    longest = (3 * args.new_tokens) // 2 + 1  # a serving stream's longest budget (gpucheck.serving.stream)
    max_len = -(-(args.prompt_len + longest + max_k + 1) // args.kv_bucket) * args.kv_bucket
    runner = GraphRunner(target, capture=not dry, max_tokens_per_row=max_k + 1)
    runner.reserve(max_batch, max_len)
    eager = None
    if eager_batch:
        eager = GraphRunner(target, capture=False, max_tokens_per_row=max_k + 1)
        eager.reserve(eager_batch, max_len)
    bench.arch, bench.arch_label, bench.target, bench.target_runner = arch, label, target, runner
    bench.eager_runner, bench.max_len = eager, max_len
