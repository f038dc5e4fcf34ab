"""Tensor-parallel process groups from torchrun's environment, and the collectives a sharded
target calls (:mod:`refspec.models.tp.shard`).

torchrun starts N processes and tells each its place through the environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``);
:func:`init_tensor_parallel` joins them into one group (NCCL on GPUs, gloo on CPUs) and a gloo
group beside it for host objects (per-phase measurements). Every rank runs the same program on
the same inputs (SPMD, as gpt-fast runs its ``generate.py`` under torchrun): the sharded layers
all-reduce their partial sums and everything else, sampling and drafting included, is computed
identically on every rank, so the ranks take the same decisions without telling each other.

A collective that fails (a rank died, or did not arrive within the timeout) raises
:class:`RankLostError`, one line saying which rank saw it; a launch that cannot work (``--tp``
unlike the group torchrun started, more ranks than devices) raises :class:`TPError` before any
group forms.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import time
from typing import Any, Callable, Mapping

import torch

from refspec.models.tp.plan import TPError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""How long a collective waits for the other ranks (``REFSPEC_TP_TIMEOUT_S`` overrides)."""


class RankLostError(RuntimeError):
    """A collective failed: another rank stopped or did not arrive within the timeout."""


class CommClock:
    """Seconds this rank spent inside collectives.

    On a CPU the host clock around each call (the call returns when the data has arrived, so
    waiting for a slower rank counts). On a GPU a pair of CUDA events around each eager
    collective, resolved after the step's own host sync; collectives recorded into a CUDA graph
    are not timed (a replay has no events to read), so a graph replay's phase reports none.

    Args:
        cuda: time with CUDA events instead of the host clock.
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.host_s = 0.0  # CPU: cumulative seconds
        self.pairs: list[tuple[Any, Any]] = []  # GPU: (start, end) events since the last reset

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        if torch.cuda.is_current_stream_capturing():
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, token: Any) -> None:
        if not self.cuda:
            self.host_s += time.perf_counter() - token
        elif token is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((token, end))

    def mark(self) -> Any:
        """A position to measure from (:meth:`since`)."""
        return self.host_s if not self.cuda else len(self.pairs)

    def since(self, mark: Any) -> float | Callable[[], float]:
        """Collective seconds since ``mark``: a number on a CPU, a resolver on a GPU (call it after
        the step's host sync)."""
        if not self.cuda:
            return self.host_s - mark
        pairs = self.pairs[mark:]
        return lambda: sum(a.elapsed_time(b) for a, b in pairs) / 1e3

    def reset(self) -> None:
        """Forget the GPU events recorded so far (between phases: they are only read per phase)."""
        self.pairs = []


@dataclasses.dataclass(eq=False)
class TensorParallel:
    """One rank's view of its tensor-parallel group.

    Attributes:
        rank: this process's rank, 0..size-1 (rank 0 writes every file and prints).
        size: N, ranks in the group.
        local_rank: rank on this node (its GPU index).
        device: this rank's device (``cuda:<local_rank>`` or ``cpu``).
        group: the process group the sharded layers all-reduce over (None: the default group).
        host_group: a gloo group for host objects (measurements); the default group on CPUs.
        backend: ``nccl`` or ``gloo``.
        comm: this rank's time in collectives.
    """

    rank: int
    size: int
    local_rank: int
    device: torch.device
    group: Any = None
    host_group: Any = None
    backend: str = "gloo"
    comm: CommClock = dataclasses.field(default_factory=CommClock)

    def lost(self, exc: BaseException) -> RankLostError:
        """The error of a failed collective, as one line."""
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # gloo prefixes its source file and line
        first = text.splitlines()[0].split(". ")[0][:160] if text else type(exc).__name__
        return RankLostError(f"tensor-parallel rank {self.rank} of {self.size}: a collective failed ({first}); "
                             f"another rank stopped or did not answer within the timeout, so every rank stops")


_ACTIVE: TensorParallel | None = None


def active() -> TensorParallel | None:
    """The group this process joined (None: a single-device run)."""
    return _ACTIVE


def launch_env(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """``rank``, ``size``, ``local_rank`` and ``local_size`` from torchrun's variables, or None
    when the process was not started by torchrun (no ``WORLD_SIZE``)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        size = int(env["WORLD_SIZE"])
        return {"rank": int(env.get("RANK", "0")), "size": size, "local_rank": int(env.get("LOCAL_RANK", "0")),
                "local_size": int(env.get("LOCAL_WORLD_SIZE", str(size)))}
    except ValueError:
        raise TPError("torchrun's RANK / WORLD_SIZE / LOCAL_RANK are not integers") from None


def check_launch(tp: int, env: Mapping[str, int] | None, *, device_type: str, devices: int) -> None:
    """Whether ``--tp tp`` fits the processes torchrun started and this node's devices.

    Args:
        tp: the ``--tp`` value.
        env: :func:`launch_env` (None: not under torchrun).
        device_type: ``cuda`` or ``cpu``.
        devices: GPUs on this node (CUDA), or CPU cores this process may use.

    Raises:
        TPError: the launch cannot work; the message says how to start it.
    """
    if tp < 1:
        raise TPError(f"--tp {tp}: tensor-parallel ranks must be 1 or more")
    size = 1 if env is None else env["size"]
    if tp > 1 and env is None:
        raise TPError(f"--tp {tp} needs {tp} processes: start it with torchrun --nproc-per-node {tp} -m refspec.eval "
                      f"... --tp {tp}")
    if size != tp:
        raise TPError(f"--tp {tp} but torchrun started {size} processes: every process is one tensor-parallel rank "
                      f"(no data parallelism), so use torchrun --nproc-per-node {tp} with --tp {tp}")
    local = 1 if env is None else env["local_size"]
    if tp > 1 and local > devices:
        kind = ("GPU" if device_type == "cuda" else "CPU core") + ("s" if devices != 1 else "")
        raise TPError(f"--tp {tp}: {local} ranks on this node but only {devices} {kind} (one rank per "
                      f"{'GPU' if device_type == 'cuda' else 'core'}); lower --tp or --nproc-per-node")


def usable_devices(device_type: str) -> int:
    """GPUs this node has (CUDA), or CPU cores this process may run on."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def init_tensor_parallel(tp: int, device_type: str, *, timeout_s: float | None = None) -> TensorParallel:
    """Join the group torchrun started (checked by :func:`check_launch` first).

    Args:
        tp: N, the ``--tp`` value (the whole group).
        device_type: ``cuda`` (NCCL, one GPU per rank: ``cuda:<LOCAL_RANK>``) or ``cpu`` (gloo).
        timeout_s: how long a collective waits (default ``REFSPEC_TP_TIMEOUT_S`` or 600 s).

    Raises:
        TPError: a launch that cannot work.
        RankLostError: the group did not form (another rank never arrived).
    """
    import torch.distributed as dist

    global _ACTIVE
    env = launch_env()
    check_launch(tp, env, device_type=device_type, devices=usable_devices(device_type))
    assert env is not None
    timeout = datetime.timedelta(seconds=float(timeout_s or os.environ.get("REFSPEC_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    cuda = device_type == "cuda"
    device = torch.device("cuda", env["local_rank"]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    try:
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout, **({"device_id": device} if cuda else {}))
        host = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
    except (RuntimeError, ValueError) as exc:
        raise RankLostError(f"tensor-parallel rank {env['rank']} of {tp}: the group did not form "
                            f"({str(exc).strip().splitlines()[0][:160] if str(exc).strip() else exc!r})") from None
    _ACTIVE = TensorParallel(rank=env["rank"], size=tp, local_rank=env["local_rank"], device=device, group=None,
                             host_group=host, backend=backend, comm=CommClock(cuda))
    log.info("tensor-parallel rank %d of %d on %s (%s)", _ACTIVE.rank, tp, device, backend)
    return _ACTIVE


def shutdown() -> None:
    """Leave the group (idempotent)."""
    import torch.distributed as dist

    global _ACTIVE
    _ACTIVE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum ``tensor`` over the group in place (timed into ``tp.comm``); returns it.

    Raises:
        RankLostError: the collective failed.
    """
    import torch.distributed as dist

    token = tp.comm.start()
    try:
        dist.all_reduce(tensor, group=tp.group)
    except RuntimeError as exc:
        raise tp.lost(exc) from None
    tp.comm.stop(token)
    return tensor


def gather_objects(obj: Any, tp: TensorParallel) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (over the host group).

    Raises:
        RankLostError: the collective failed.
    """
    import torch.distributed as dist

    out: list[Any] = [None] * tp.size
    try:
        dist.all_gather_object(out, obj, group=tp.host_group)
    except RuntimeError as exc:
        raise tp.lost(exc) from None
    return out


def broadcast_object(obj: Any, tp: TensorParallel) -> Any:
    """Rank 0's ``obj`` on every rank (over the host group)."""
    import torch.distributed as dist

    box = [obj]
    try:
        dist.broadcast_object_list(box, src=0, group=tp.host_group)
    except RuntimeError as exc:
        raise tp.lost(exc) from None
    return box[0]


__all__ = ["TPError", "RankLostError", "CommClock", "TensorParallel", "active", "launch_env", "check_launch",
           "usable_devices", "init_tensor_parallel", "shutdown", "all_reduce_", "gather_objects", "broadcast_object",
           "DEFAULT_TIMEOUT_S"]
