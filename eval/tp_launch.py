"""``torchrun --nproc-per-node N -m refspec.eval ... --tp N``: the command line's side of tensor
parallelism (the rest is :mod:`refspec.models.tp`: the group, the sharding, the rank meter).

Every rank runs the whole command on the same flags (SPMD): it loads its share of the target,
serves the same stream and takes the same decisions, since every figure a decision reads is the
same on every rank (tokens after the all-reduces, phase times gathered by
:class:`~refspec.models.tp.rank_meter.RankMeter`). Only rank 0 writes the user's files and prints:
the other ranks write their ledgers and records into a private scratch directory (holding a copy
of ``--out``'s records, so a resumed sweep skips the same configurations on every rank), which is
removed at exit, and print nothing but the line of a collective that failed.

Drafters are replicated, not sharded: each rank runs the same drafter on the same inputs and gets
the same drafts with no communication. A draft model small enough to be a drafter gains little
from sharding, and a replicated one keeps the drafter protocol untouched; a self-draft
(``self:N``) shares the target's sharded layers, so it runs tensor-parallel like the target.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # refspec.models imports torch; the error path of a torch-free usage error must not
    from refspec.models.tp.group import TensorParallel

log = logging.getLogger(__name__)


def _device_type(flag: str) -> str:
    import torch

    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if flag.startswith("cuda") else "cpu"


def check_tp_flags(args: argparse.Namespace) -> None:
    """The flags that do not go with ``--tp N > 1`` (torch-free).

    Raises:
        TPError: ``--compile``, ``--phase-loops-s`` above 0, or a simulated meter with ``--tp``.
    """
    from refspec.models.tp.plan import TPError

    tp = args.tp
    if tp < 1:
        raise TPError(f"--tp {tp}: tensor-parallel ranks must be 1 or more")
    if tp == 1:
        return
    if getattr(args, "compile", False):
        raise TPError(f"--compile with --tp {tp}: the compiled CPU step traces no collectives; drop --compile")
    if (getattr(args, "phase_loops_s", None) or 0) > 0:
        raise TPError(f"--phase-loops-s with --tp {tp}: phase-isolated loops run on one device; drop it (the "
                      f"counter's sub-windows still split the energy)")
    if str(getattr(args, "meter", "")).partition(":")[0].lower() == "simulated":
        raise TPError(f"--meter simulated with --tp {tp}: it models one device's counter; use roofline, time, "
                      f"or a real counter (nvml, zeus, rapl)")


def start(args: argparse.Namespace) -> "TensorParallel | None":
    """Join the group torchrun started (None: no ``--tp`` and no torchrun, or ``--print-sbatch``,
    which only writes the torchrun line). On ranks other than 0 the command is then quiet: no
    progress bars, no prints, logs at ERROR, no ``--export-acceptance`` or
    ``--per-request-metrics`` file. On GPUs ``args.device`` becomes ``cuda``: the rank's GPU
    (``LOCAL_RANK``) is made current, so every rank's configurations keep the same ids.

    Raises:
        TPError: a launch that cannot work (see :func:`refspec.models.tp.group.check_launch`).
        RankLostError: the group did not form.
    """
    from refspec.models.tp.group import init_tensor_parallel, launch_env, shutdown

    tp = getattr(args, "tp", 1)
    if getattr(args, "print_sbatch", False) or (tp == 1 and launch_env() is None):
        return None
    check_tp_flags(args)
    if os.environ.get("RANK", "0") != "0":
        logging.getLogger().setLevel(logging.ERROR)
    kind = _device_type(args.device)
    group = init_tensor_parallel(tp, kind)
    atexit.register(shutdown)
    if kind == "cuda":
        args.device = "cuda"  # the rank's own GPU (set current): the same flag, so the same config ids on every rank
    if group.rank != 0:
        args.no_progress = True
        for name in ("export_acceptance", "per_request_metrics"):
            if hasattr(args, name):
                setattr(args, name, None)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout until it exits
    return group


def rank_out(out: Path | None) -> Path | None:
    """The directory this rank writes: ``out`` on rank 0 (and without tensor parallelism); on
    other ranks a scratch directory holding a copy of ``out``'s records (removed at exit)."""
    from refspec.models.tp.group import active

    tp = active()
    if tp is None or tp.rank == 0:
        return out
    scratch = Path(tempfile.mkdtemp(prefix=f"refspec-tp-rank{tp.rank}-"))
    atexit.register(shutil.rmtree, scratch, True)
    if out is not None and out.is_dir():
        from refspec.eval.record_files import records_files

        for f in records_files(out):
            dest = scratch / f.relative_to(out)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    return scratch


def writes_files() -> bool:
    """Whether this process writes the user's summary and report (rank 0, or no tensor parallelism)."""
    if "refspec.models.tp.group" not in sys.modules:
        return True
    from refspec.models.tp.group import active

    tp = active()
    return tp is None or tp.rank == 0


def prints_error(exc: BaseException) -> bool:
    """Whether this process prints ``exc``'s ``error:`` line: rank 0 (every rank meets the same
    usage errors), or any rank whose collective failed (rank 0 may be the one that died)."""
    if os.environ.get("RANK", "0") == "0":
        return True
    lost = sys.modules.get("refspec.models.tp.group")  # not imported yet: no collective ran
    return lost is not None and isinstance(exc, lost.RankLostError)


def tp_meter(spec: str, dtype_bytes: int) -> Any:
    """This rank's meter (:func:`refspec.models.tp.rank_meter.rank_meter`)."""
    from refspec.energy.meters.make import make_meter
    from refspec.models.tp.group import active
    from refspec.models.tp.plan import TPError
    from refspec.models.tp.rank_meter import rank_meter

    tp = active()
    if tp is None:
        raise TPError("--tp > 1 outside a tensor-parallel group")
    return rank_meter(spec, tp, lambda s: make_meter(s, dtype_bytes=dtype_bytes, gpu_index=tp.local_rank))


__all__ = ["check_tp_flags", "start", "rank_out", "writes_files", "prints_error", "tp_meter"]
