"""What every (batch, k) point shares: the random-weight target, its runners, the meter and the
two rooflines (data sheet, and the ceilings measured in this run)."""
from __future__ import annotations

import argparse
import dataclasses
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
    """Everything the (batch, k) points share.

    ``profile`` is the run's roofline (measured ceilings), ``datasheet`` the device's data sheet
    (or, in a dry run, this CPU's calibrated profile).
    """

    device: torch.device
    dtype: torch.dtype
    arch_label: str
    target: Any
    target_runner: Any
    draft_runner: Any
    meter: Any
    meter_note: str
    profile: Any
    datasheet: Any
    ceilings: dict[str, Any]
    idle_w: float | None
    max_len: int
    eager_runners: tuple[Any, Any] | None = None  # (target, draft) without capture, for graphs vs eager
    sm_clock: Any = None  # () -> SM clock in MHz, read passively; None where NVML cannot (a CPU)
    prefill_loops: dict[int, Any] = dataclasses.field(default_factory=dict)  # batch -> its prefill loop

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

    meter = RooflineMeter(profile, time_source="measured", sync=None if dry else torch.cuda.synchronize)
    return meter, f"MODELLED by {meter.source} ({reason})", profile.idle_w


def build_bench(args: argparse.Namespace) -> Bench:
    """Build the target and runners, measure the ceilings, then pick the meter."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.models.random_models import random_model, shrunk_config

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

    arch: Any = shrunk_config(args.arch) if dry else args.arch
    label = f"{args.arch} (toy: hidden 256, 2 layers, vocab 2048)" if dry else args.arch
    t0 = time.perf_counter()
    target = random_model(arch, device=device, dtype=dtype, seed=args.seed)
    log.info("built random %s in %.1f s", label, time.perf_counter() - t0)
    max_k = max(args.ks)
    target_runner = GraphRunner(target, capture=not dry, max_tokens_per_row=max_k + 1)
    draft_runner = GraphRunner(target.truncated(1), capture=not dry, max_tokens_per_row=2)
    max_len = -(-(args.prompt_len + args.new_tokens + max_k + 1) // args.kv_bucket) * args.kv_bucket
    for r in (target_runner, draft_runner):
        r.reserve(max(args.batches), max_len)
    eager = None
    if args.eager_batches:  # same bucketing and padding, no capture: what the graphs save, alone
        eager = (GraphRunner(target, capture=False, max_tokens_per_row=max_k + 1),
                 GraphRunner(target.truncated(1), capture=False, max_tokens_per_row=2))
        for r in eager:
            r.reserve(max(args.eager_batches), max_len)
    from refspec.energy.nvml_meter import sm_clock_reader

    clock = None if dry else sm_clock_reader(0)
    return Bench(device=device, dtype=dtype, arch_label=label, target=target, target_runner=target_runner,
                 draft_runner=draft_runner, meter=meter, meter_note=note, profile=profile, datasheet=datasheet,
                 ceilings=ceilings, idle_w=idle_w, max_len=max_len, eager_runners=eager,
                 sm_clock=clock)
