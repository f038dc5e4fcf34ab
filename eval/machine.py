"""Dtype and machine facts a record states: the automatic dtype, library versions, the CPU GEMM plan."""
from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from refspec import __version__

if TYPE_CHECKING:
    from refspec.models.calibration import GemmPlan


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bf16 matrix instructions (``avx512_bf16`` or AMX).

    Args:
        cpuinfo: contents of ``/proc/cpuinfo`` (read when None; False when unreadable).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.split("\n"):
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def auto_dtype(device: torch.device, cpuinfo: str | None = None) -> str:
    """``bf16`` on CUDA and on CPUs with native bf16 (avx512_bf16/AMX), else ``fp32``.

    Without native bf16 a CPU emulates it and runs slower than fp32.
    """
    if device.type == "cuda":
        return "bf16"
    return "bf16" if cpu_has_fast_bf16(cpuinfo) else "fp32"


def gemm_plan_text(plan: GemmPlan) -> str:
    """The CPU GEMM forms a run's products took under ``plan`` (``reference``: F.linear everywhere)."""
    return plan.describe() or "reference"


def library_versions() -> dict[str, str]:
    """refspec, Python and the libraries behind a figure (``not installed`` where absent)."""
    out = {"refspec": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for dist in ("numpy", "tokenizers", "transformers", "safetensors", "zeus", "datasets"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


__all__ = ["cpu_has_fast_bf16", "auto_dtype", "library_versions", "gemm_plan_text"]
