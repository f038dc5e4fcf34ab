"""Latency-preserving DVFS: lock the GPU's SM clock, sweep it, find the headroom.

Locked clocks outlive the process, so :func:`lock_sm_clocks` resets them three ways: in
``finally`` (normal exit and exceptions), in an ``atexit`` handler (interpreter shutdown), and in
a SIGINT handler it installs for the duration of the lock (which resets, then hands the signal
to the previous handler, so Ctrl-C still raises KeyboardInterrupt). A reset that fails while
another error is in flight (a refused lock, a failing workload) never replaces that error: it is
logged and added to it as a note. Setting clocks needs root, CAP_SYS_ADMIN or the ``zeusd``
daemon. An idle GPU runs below any lock, so :func:`dvfs_sweep` verifies each lock by sampling
the SM clock while the workload runs.

Only a user's own GPU is swept: nothing in the paper command (``refspec.eval.paper``) imports
this module, and lent machines' clocks are only read (``refspec.energy.meters.nvml.sm_clock_reader``).

The GPU is reached through a small :class:`GPUBackend` protocol; :class:`ZeusGPUBackend` wraps
``zeus.device.get_gpus()`` (and NVML for the observed clock), and tests inject a fake GPU.
Without a GPU every entry point raises :class:`~refspec.energy.meters.errors.NoGPUError`; the CLI
(``python -m refspec.eval dvfs``) says so and exits 0.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import signal
import statistics
import threading
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from refspec.energy.meters.errors import NoGPUError

logger = logging.getLogger(__name__)


class ClockLockError(RuntimeError):
    """A clock lock could not be set or did not take effect."""


class GPUBackend(Protocol):
    """What DVFS needs from a GPU (clocks in MHz)."""

    def set_locked_clocks(self, gpu: int, min_mhz: int, max_mhz: int) -> None: ...

    def reset_locked_clocks(self, gpu: int) -> None: ...

    def sm_clock_mhz(self, gpu: int) -> int: ...

    def supported_sm_clocks(self, gpu: int) -> list[int]: ...


class ZeusGPUBackend:
    """:class:`GPUBackend` on ``zeus.device.get_gpus()``; the observed SM clock comes from NVML.

    Raises:
        NoGPUError: zeus is missing or finds no NVIDIA GPU.
    """

    def __init__(self) -> None:
        try:
            from zeus.device import get_gpus

            self._gpus = get_gpus()
        except ImportError as exc:
            raise NoGPUError(f"DVFS needs the 'zeus' package (pip install 'zeus>=0.12'): {exc}") from None
        except Exception as exc:  # zeus's ZeusGPUInitError and friends
            raise NoGPUError(f"no NVIDIA GPU for DVFS: zeus could not initialise NVML ({exc})") from None
        if len(self._gpus) == 0:
            raise NoGPUError("no NVIDIA GPU for DVFS: zeus found none")

    def set_locked_clocks(self, gpu: int, min_mhz: int, max_mhz: int) -> None:
        try:
            self._gpus.set_gpu_locked_clocks(gpu, min_mhz, max_mhz)
        except Exception as exc:
            raise ClockLockError(f"cannot lock gpu{gpu} SM clock to {min_mhz}-{max_mhz} MHz ({exc}); locking needs "
                                 "root, CAP_SYS_ADMIN or the zeusd daemon") from exc

    def reset_locked_clocks(self, gpu: int) -> None:
        self._gpus.reset_gpu_locked_clocks(gpu)

    def sm_clock_mhz(self, gpu: int) -> int:
        import pynvml

        return int(pynvml.nvmlDeviceGetClockInfo(self._gpus.gpus[gpu].handle, pynvml.NVML_CLOCK_SM))

    def supported_sm_clocks(self, gpu: int) -> list[int]:
        memory = max(self._gpus.get_supported_memory_clocks(gpu))
        return sorted(self._gpus.get_supported_graphics_clocks(gpu, memory))


# ---- locking with guaranteed reset ------------------------------------------------------------
_LOCKED: dict[tuple[int, int], tuple[GPUBackend, int]] = {}  # (id(backend), gpu) -> (backend, gpu)
_REGISTRY_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def reset_all_locked_clocks() -> None:
    """Reset every clock this process locked and has not reset yet (the atexit handler)."""
    with _REGISTRY_LOCK:
        pending = list(_LOCKED.items())
    for key, (backend, gpu) in pending:
        try:
            backend.reset_locked_clocks(gpu)
            logger.warning("reset locked SM clock of gpu%d on exit/interrupt", gpu)
        except Exception:  # keep resetting the others; this runs at shutdown
            logger.exception("could not reset the SM clock of gpu%d; run `nvidia-smi -rgc -i %d`", gpu, gpu)
        with _REGISTRY_LOCK:
            _LOCKED.pop(key, None)


def _register(backend: GPUBackend, gpu: int) -> None:
    global _ATEXIT_REGISTERED
    with _REGISTRY_LOCK:
        if (id(backend), gpu) in _LOCKED:
            raise ClockLockError(f"gpu{gpu} is already locked by this process; locks do not nest")
        _LOCKED[(id(backend), gpu)] = (backend, gpu)
        if not _ATEXIT_REGISTERED:
            atexit.register(reset_all_locked_clocks)
            _ATEXIT_REGISTERED = True


def _unregister(backend: GPUBackend, gpu: int) -> None:
    with _REGISTRY_LOCK:
        _LOCKED.pop((id(backend), gpu), None)


def _install_sigint() -> Any:
    """Install a SIGINT handler that resets locked clocks first; returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be set from the main thread; finally + atexit still reset
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        reset_all_locked_clocks()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    return previous


@dataclasses.dataclass(frozen=True)
class ClockLock:
    """An active lock: requested and observed SM clock in MHz."""

    gpu: int
    mhz: int
    observed_mhz: int


@contextlib.contextmanager
def lock_sm_clocks(gpu: int, mhz: int, *, backend: GPUBackend | None = None,
                   tolerance_mhz: int = 30) -> Iterator[ClockLock]:
    """Lock ``gpu``'s SM clock to ``mhz`` for the ``with`` block; always reset afterwards.

    After locking, the observed SM clock is read: above ``mhz + tolerance_mhz`` the lock did not
    take effect and :class:`ClockLockError` is raised (after resetting); below, the GPU is idle
    and only an INFO line is logged (a locked clock binds under load).

    Args:
        gpu: GPU index.
        mhz: SM clock in MHz (used as both min and max of the locked range).
        backend: GPU backend; :class:`ZeusGPUBackend` when None.
        tolerance_mhz: accepted excess of the observed clock over ``mhz``.

    Yields:
        The :class:`ClockLock`.

    Raises:
        NoGPUError: no GPU (default backend).
        ClockLockError: the lock was refused or not observed.
    """
    backend = backend if backend is not None else ZeusGPUBackend()
    _register(backend, gpu)
    try:
        previous = _install_sigint()
    except BaseException:
        _unregister(backend, gpu)
        raise
    in_flight: BaseException | None = None
    try:
        backend.set_locked_clocks(gpu, mhz, mhz)
        observed = backend.sm_clock_mhz(gpu)
        if observed > mhz + tolerance_mhz:
            raise ClockLockError(f"gpu{gpu} runs at {observed} MHz after locking to {mhz} MHz: the lock did not apply")
        if observed < mhz - tolerance_mhz:
            logger.info("gpu%d idles at %d MHz below the %d MHz lock; the lock binds under load", gpu, observed, mhz)
        logger.info("locked gpu%d SM clock to %d MHz (observed %d MHz)", gpu, mhz, observed)
        yield ClockLock(gpu=gpu, mhz=mhz, observed_mhz=observed)
    except BaseException as exc:
        in_flight = exc
        raise
    finally:
        try:
            _reset(backend, gpu, in_flight)
        finally:
            _unregister(backend, gpu)
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def _reset(backend: GPUBackend, gpu: int, in_flight: BaseException | None) -> None:
    """Reset ``gpu``'s locked clock; a failure raises only when no other error is in flight."""
    try:
        backend.reset_locked_clocks(gpu)
        logger.info("reset gpu%d SM clock", gpu)
    except Exception as exc:
        what = f"could not reset the SM clock of gpu{gpu} ({type(exc).__name__}: {exc}); run `nvidia-smi -rgc -i {gpu}`"
        if in_flight is None:
            raise ClockLockError(what) from exc
        logger.error("%s (while handling %s)", what, type(in_flight).__name__)
        if hasattr(in_flight, "add_note"):  # Python >= 3.11
            in_flight.add_note(what)


# ---- sweep ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ClockPoint:
    """One operating point of a sweep.

    Attributes:
        clock_mhz: locked SM clock, None for the unlocked baseline.
        observed_mhz: SM clock read right after locking (None unlocked); an idle GPU reads below
            the lock, so this proves little.
        energy_per_token_j: J per output token the run reported.
        tpot_p99_s: p99 time per output token the run reported, s.
        load_mhz: (min, median, max) SM clock sampled while the workload ran, MHz; None where
            the run ended before a sample was taken.
    """

    clock_mhz: int | None
    observed_mhz: int | None
    energy_per_token_j: float
    tpot_p99_s: float
    load_mhz: tuple[float, float, float] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DVFSSweep:
    """Result of :func:`dvfs_sweep`.

    Attributes:
        baseline: the unlocked point.
        points: locked points in the order swept.
        tolerance: accepted relative p99 TPOT increase over the baseline.
        headroom_mhz: lowest clock whose p99 TPOT stays within tolerance (None: none does).
        best: lowest-energy point within tolerance (may be the baseline).
        energy_saving: 1 - best / baseline J per token.
    """

    baseline: ClockPoint
    points: tuple[ClockPoint, ...]
    tolerance: float
    headroom_mhz: int | None
    best: ClockPoint
    energy_saving: float


RunResult = Mapping[str, float]


def _point(clock: int | None, observed: int | None, result: RunResult, samples: Sequence[int]) -> ClockPoint:
    try:
        energy, tpot = float(result["energy_per_token_j"]), float(result["tpot_p99_s"])
    except KeyError as exc:
        raise ValueError(f"run_fn must return a mapping with energy_per_token_j and tpot_p99_s; "
                         f"missing {exc}") from None
    load = (float(min(samples)), float(statistics.median(samples)), float(max(samples))) if samples else None
    return ClockPoint(clock_mhz=clock, observed_mhz=observed, energy_per_token_j=energy, tpot_p99_s=tpot,
                      load_mhz=load)


def _run_sampling_clock(run_fn: Callable[[], RunResult], read: Callable[[], int], period_s: float
                        ) -> tuple[RunResult, list[int]]:
    """``run_fn()`` while a thread samples the SM clock every ``period_s``; its result and the samples."""
    samples: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            samples.append(read())
            stop.wait(period_s)

    thread = threading.Thread(target=loop, name="refspec-dvfs-clock", daemon=True)
    thread.start()
    try:
        result = run_fn()
    finally:
        stop.set()
        thread.join(timeout=1.0)
    return result, samples


def _check_under_load(lock: ClockLock, samples: Sequence[int], tolerance_mhz: int) -> None:
    """The lock held while the workload ran: the median sampled clock is within tolerance."""
    if not samples:
        logger.warning("gpu%d: the workload ended before the SM clock was sampled; the %d MHz lock is unverified "
                       "under load", lock.gpu, lock.mhz)
        return
    median = statistics.median(samples)
    if median > lock.mhz + tolerance_mhz:
        raise ClockLockError(f"gpu{lock.gpu} ran at a median {median:.0f} MHz (max {max(samples)}) under load "
                             f"while locked to {lock.mhz} MHz: the lock did not hold")


def dvfs_sweep(run_fn: Callable[[], RunResult], clocks: Sequence[int], *, gpu: int = 0,
               backend: GPUBackend | None = None, tolerance: float = 0.05, tolerance_mhz: int = 30,
               sample_period_s: float = 0.01) -> DVFSSweep:
    """Run ``run_fn`` unlocked and at each locked SM clock; find the latency-preserving headroom.

    Each run's SM clock is sampled while it runs; a locked run whose median clock exceeds the
    lock is an error (the lock did not hold under load). The clock is reset after every point,
    also when ``run_fn`` raises (that error propagates unchanged).

    Args:
        run_fn: runs one measured workload and returns ``{"energy_per_token_j": J,
            "tpot_p99_s": s}`` (e.g. from :func:`refspec.energy.accounting.headline.account`).
        clocks: SM clocks to lock, MHz.
        gpu: GPU index.
        backend: GPU backend (:class:`ZeusGPUBackend` when None).
        tolerance: accepted relative increase of p99 TPOT over the unlocked run.
        tolerance_mhz: accepted excess of the sampled clock over a lock.
        sample_period_s: period of the clock samples taken during each run.

    Returns:
        The :class:`DVFSSweep`.

    Raises:
        NoGPUError: no GPU (default backend).
        ClockLockError: a lock was refused, or did not hold idle or under load.
    """
    backend = backend if backend is not None else ZeusGPUBackend()
    read = functools.partial(backend.sm_clock_mhz, gpu)
    result, samples = _run_sampling_clock(run_fn, read, sample_period_s)
    baseline = _point(None, None, result, samples)
    points = []
    for mhz in clocks:
        with lock_sm_clocks(gpu, mhz, backend=backend, tolerance_mhz=tolerance_mhz) as lock:
            result, samples = _run_sampling_clock(run_fn, read, sample_period_s)
            _check_under_load(lock, samples, tolerance_mhz)
            points.append(_point(mhz, lock.observed_mhz, result, samples))
    limit = baseline.tpot_p99_s * (1.0 + tolerance)
    ok = [p for p in points if p.tpot_p99_s <= limit]
    headroom = min((p.clock_mhz for p in ok if p.clock_mhz is not None), default=None)
    best = min([baseline, *ok], key=lambda p: p.energy_per_token_j)
    return DVFSSweep(baseline=baseline, points=tuple(points), tolerance=tolerance, headroom_mhz=headroom, best=best,
                     energy_saving=1.0 - best.energy_per_token_j / baseline.energy_per_token_j)
