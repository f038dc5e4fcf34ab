"""DVFS with a fake GPU (locks always reset) and operating-point choice under latency targets."""
from __future__ import annotations

import signal
import time

import pytest
import torch

from refspec.energy.accounting.latency import (Targets, choose, choose_config, cost_of_tighter_target, excluded_invalid,
                                               format_targets, valid_window)
from refspec.energy.meters.errors import NoGPUError
from refspec.energy.meters import dvfs
from refspec.energy.meters.dvfs import ClockLockError, dvfs_sweep, lock_sm_clocks, reset_all_locked_clocks
from refspec.eval import dvfs_cli


class FakeGPU:
    """A GPU backend that records calls; ``overshoot`` makes the lock not take effect.

    ``idle_mhz`` set: the clock reads that while not ``loaded`` (a real GPU idles below any
    lock) and ``clock`` under load. ``refuse`` makes locking raise; ``reset_fails`` resetting.
    """

    def __init__(self, default_mhz: int = 1980, overshoot: int = 0, *, idle_mhz: int | None = None,
                 refuse: bool = False, reset_fails: bool = False) -> None:
        self.default_mhz = default_mhz
        self.clock = default_mhz
        self.overshoot = overshoot
        self.idle_mhz = idle_mhz
        self.loaded = False
        self.refuse = refuse
        self.reset_fails = reset_fails
        self.calls: list[tuple] = []

    def set_locked_clocks(self, gpu: int, min_mhz: int, max_mhz: int) -> None:
        self.calls.append(("set", gpu, min_mhz, max_mhz))
        if self.refuse:
            raise ClockLockError(f"cannot lock gpu{gpu}: insufficient permissions (fake)")
        self.clock = max_mhz + self.overshoot

    def reset_locked_clocks(self, gpu: int) -> None:
        self.calls.append(("reset", gpu))
        if self.reset_fails:
            raise RuntimeError("NVML_ERROR_NO_PERMISSION (fake)")
        self.clock = self.default_mhz

    def sm_clock_mhz(self, gpu: int) -> int:
        return self.clock if self.idle_mhz is None or self.loaded else self.idle_mhz

    def supported_sm_clocks(self, gpu: int) -> list[int]:
        return list(range(345, 1981, 15))


def test_lock_and_reset_on_normal_exit():
    gpu = FakeGPU()
    with lock_sm_clocks(0, 1410, backend=gpu) as lock:
        assert (lock.mhz, lock.observed_mhz) == (1410, 1410)
        assert gpu.clock == 1410
    assert gpu.calls == [("set", 0, 1410, 1410), ("reset", 0)]
    assert gpu.clock == 1980


def test_clock_is_reset_when_the_body_raises():
    gpu = FakeGPU()
    with pytest.raises(RuntimeError, match="boom"):
        with lock_sm_clocks(0, 990, backend=gpu):
            raise RuntimeError("boom")
    assert gpu.calls[-1] == ("reset", 0) and gpu.clock == 1980
    assert not dvfs._LOCKED  # nothing left for atexit


def test_lock_that_does_not_apply_raises_and_still_resets():
    gpu = FakeGPU(overshoot=200)
    with pytest.raises(ClockLockError, match="did not apply"):
        with lock_sm_clocks(1, 1200, backend=gpu):
            pytest.fail("the body must not run")
    assert gpu.calls[-1] == ("reset", 1)


@pytest.fixture
def sigint_handler():
    """Runs the test under Python's default SIGINT handler (a background job may start with SIGINT ignored)."""
    saved = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


def test_sigint_handler_resets_then_interrupts_and_is_restored(sigint_handler):
    gpu = FakeGPU()
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with lock_sm_clocks(0, 1200, backend=gpu):
            handler = signal.getsignal(signal.SIGINT)
            assert handler is not before
            handler(signal.SIGINT, None)  # what Ctrl-C would do
    assert ("reset", 0) in gpu.calls and gpu.clock == 1980
    assert signal.getsignal(signal.SIGINT) is before


def test_sigint_ignored_before_stays_ignored_but_still_resets(sigint_handler):
    gpu = FakeGPU()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with lock_sm_clocks(0, 1200, backend=gpu):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # no KeyboardInterrupt: it was ignored
        assert ("reset", 0) in gpu.calls and gpu.clock == 1980
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_atexit_path_resets_pending_locks():
    gpu = FakeGPU()
    ctx = lock_sm_clocks(0, 1100, backend=gpu)
    ctx.__enter__()
    assert dvfs._LOCKED
    reset_all_locked_clocks()  # registered with atexit; simulate interpreter exit
    assert gpu.calls[-1] == ("reset", 0) and not dvfs._LOCKED
    ctx.__exit__(None, None, None)


def test_locks_do_not_nest():
    gpu = FakeGPU()
    with lock_sm_clocks(0, 1500, backend=gpu):
        with pytest.raises(ClockLockError, match="already locked"):
            with lock_sm_clocks(0, 1200, backend=gpu):
                pass
        assert gpu.clock == 1500  # the outer lock still holds
    assert gpu.clock == 1980


def test_sweep_finds_latency_preserving_headroom():
    gpu = FakeGPU()

    def run():
        # memory-bound decode: TPOT barely moves until the clock drops below 1400 MHz
        mhz = gpu.clock
        tpot = 0.010 * max(1.0, 1400 / mhz)
        energy = 0.2 * (0.6 + 0.4 * (mhz / 1980) ** 2) * (tpot / 0.010)
        return {"energy_per_token_j": energy, "tpot_p99_s": tpot}

    sweep = dvfs_sweep(run, [1980, 1600, 1400, 1200, 900], backend=gpu, tolerance=0.05)
    assert sweep.baseline.clock_mhz is None and sweep.baseline.tpot_p99_s == pytest.approx(0.010)
    assert [p.clock_mhz for p in sweep.points] == [1980, 1600, 1400, 1200, 900]
    assert sweep.headroom_mhz == 1400
    assert sweep.best.clock_mhz == 1400
    assert sweep.energy_saving == pytest.approx(1 - (0.6 + 0.4 * (1400 / 1980) ** 2))
    assert gpu.clock == 1980 and gpu.calls.count(("reset", 0)) == 5


# ---- errors are never masked by the reset; locks are verified under load -----------------------
def test_refused_lock_raises_the_lock_error_even_when_the_reset_fails_too():
    gpu = FakeGPU(refuse=True, reset_fails=True)
    with pytest.raises(ClockLockError, match="insufficient permissions") as info:
        with lock_sm_clocks(0, 1200, backend=gpu):
            pytest.fail("the body must not run")
    assert gpu.calls == [("set", 0, 1200, 1200), ("reset", 0)]  # the reset was still tried
    assert any("could not reset" in n for n in getattr(info.value, "__notes__", ["could not reset"]))
    assert not dvfs._LOCKED


def test_workload_error_propagates_unchanged_when_the_reset_fails():
    gpu = FakeGPU(reset_fails=True)
    boom = ValueError("workload failed")
    with pytest.raises(ValueError) as info:
        with lock_sm_clocks(0, 1200, backend=gpu):
            raise boom
    assert info.value is boom and gpu.calls[-1] == ("reset", 0)


def test_failed_reset_after_a_clean_body_is_an_error():
    gpu = FakeGPU(reset_fails=True)
    with pytest.raises(ClockLockError, match="could not reset the SM clock of gpu0.*nvidia-smi -rgc"):
        with lock_sm_clocks(0, 1200, backend=gpu):
            pass
    assert not dvfs._LOCKED


def test_sweep_resets_and_reraises_when_a_locked_run_fails():
    gpu = FakeGPU()
    runs = []

    def run():
        runs.append(gpu.clock)
        if len(runs) == 3:  # the second locked point
            raise RuntimeError("CUDA error (simulated)")
        return {"energy_per_token_j": 1.0, "tpot_p99_s": 0.01}

    with pytest.raises(RuntimeError, match="simulated"):
        dvfs_sweep(run, [1600, 1200, 900], backend=gpu, sample_period_s=0.001)
    assert runs == [1980, 1600, 1200] and gpu.clock == 1980
    assert [c for c in gpu.calls if c[0] == "reset"] == [("reset", 0)] * 2 and not dvfs._LOCKED


def _loaded_run(gpu, seconds=0.05):
    def run():
        gpu.loaded = True
        time.sleep(seconds)
        gpu.loaded = False
        return {"energy_per_token_j": 1.0, "tpot_p99_s": 0.01}
    return run


def test_a_lock_that_holds_idle_but_not_under_load_is_caught():
    gpu = FakeGPU(overshoot=780, idle_mhz=345)  # idles at 345 MHz (below the lock), boosts to 1980 under load
    with pytest.raises(ClockLockError, match="did not hold"):
        dvfs_sweep(_loaded_run(gpu), [1200], backend=gpu, sample_period_s=0.002)
    assert gpu.calls[-1] == ("reset", 0) and gpu.clock == 1980


def test_sweep_records_the_clock_sampled_under_load():
    gpu = FakeGPU(idle_mhz=345)
    sweep = dvfs_sweep(_loaded_run(gpu), [1410], backend=gpu, sample_period_s=0.002)
    assert sweep.baseline.load_mhz is not None and sweep.baseline.load_mhz[1] == 1980
    point = sweep.points[0]
    assert point.observed_mhz == 345  # right after locking the GPU idles: that reading proves nothing
    assert point.load_mhz is not None and point.load_mhz[1] == 1410 and point.load_mhz[2] <= 1410


def test_sweep_rejects_results_without_the_metrics():
    with pytest.raises(ValueError, match="tpot_p99_s"):
        dvfs_sweep(lambda: {"energy_per_token_j": 1.0}, [1000], backend=FakeGPU())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_without_gpu_a_clear_error_and_cli_exits_zero(capsys):
    with pytest.raises(NoGPUError):
        with lock_sm_clocks(0, 1200):
            pass
    assert dvfs_cli.main([]) == 0
    assert "no GPU" in capsys.readouterr().out


# ---- latency targets --------------------------------------------------------------------------
SWEEP = [
    dict(batch=64, drafter="none", k=0, tpot_p99_s=0.030, energy_per_token_j=0.10),
    dict(batch=16, drafter="none", k=0, tpot_p99_s=0.018, energy_per_token_j=0.16),
    dict(batch=16, drafter="eagle", k=3, tpot_p99_s=0.012, energy_per_token_j=0.14),
    dict(batch=4, drafter="eagle", k=3, tpot_p99_s=0.008, energy_per_token_j=0.30),
    dict(batch=1, drafter="eagle", k=7, tpot_p99_s=0.006, energy_per_token_j=0.90),
]


def test_choose_lowest_energy_meeting_target():
    assert choose_config(SWEEP, 0.050)["batch"] == 64
    assert choose_config(SWEEP, 0.015)["drafter"] == "eagle"
    assert choose_config(SWEEP, 0.007)["k"] == 7
    assert choose_config(SWEEP, 0.005) is None
    with pytest.raises(ValueError, match="lacks"):
        choose_config([{"batch": 1}], 1.0)


def test_an_invalid_window_is_never_ranked_and_is_named():
    invalid = dict(batch=128, drafter="none", k=0, tpot_p99_s=0.040, energy_per_token_j=0.05, window_valid=False,
                   window_invalid_reason="window 3 s < 20 s")
    sweep = SWEEP + [invalid]
    assert choose_config(sweep, 0.050)["batch"] == 64, "the cheaper configuration has an invalid window"
    assert choose(sweep, Targets(0.050)) is choose_config(sweep, 0.050)
    assert excluded_invalid(sweep, Targets(0.050)) == [invalid] and excluded_invalid(sweep, Targets(0.035)) == []
    assert valid_window({**invalid, "window_valid": True}) and valid_window(SWEEP[0])
    rows = cost_of_tighter_target(sweep, [0.050, 0.035])
    assert [r["invalid_excluded"] for r in rows] == [1, 0] and rows[0]["batch"] == 64
    assert "not ranked: up to 1 configuration(s)" in format_targets(rows)
    assert "not ranked" not in format_targets(cost_of_tighter_target(SWEEP, [0.050]))


def test_choice_and_premiums_rank_by_the_energy_figure_given():
    """``energy=`` picks which J/token is ranked and reported; a record it gives no figure is infeasible."""
    run_j = {64: 0.50, 16: 0.20}
    energy = lambda r: run_j.get(r["batch"]) if r["k"] == 0 else r["energy_per_token_j"]  # noqa: E731
    assert choose_config(SWEEP, 0.050, energy=energy)["drafter"] == "eagle"  # 0.14 beats 0.20 and 0.50
    assert choose_config(SWEEP, 0.050)["batch"] == 64
    rows = cost_of_tighter_target(SWEEP, [0.050, 0.020], energy=energy)
    assert rows[0]["energy_per_token_j"] == 0.14 and rows[0]["plain_energy_per_token_j"] == 0.20
    assert rows[0]["speculation_premium"] == pytest.approx(0.14 / 0.20 - 1)
    assert choose_config(SWEEP, 0.007, energy=lambda r: None) is None


def test_cost_of_tighter_target_table():
    rows = cost_of_tighter_target(SWEEP, [0.012, 0.050, 0.005, 0.020])
    assert [r["target_s"] for r in rows] == [0.050, 0.020, 0.012, 0.005]
    assert rows[0]["extra_vs_loosest"] == 0.0 and rows[0]["speculation_premium"] == 0.0
    assert rows[1]["batch"] == 16 and rows[1]["drafter"] == "eagle"
    assert rows[1]["extra_vs_loosest"] == pytest.approx(0.4)
    assert rows[1]["speculation_premium"] == pytest.approx(0.14 / 0.16 - 1)  # beats plain batch 16
    assert rows[2]["plain_energy_per_token_j"] is None and rows[2]["speculation_premium"] is None
    assert not rows[3]["feasible"]
    text = format_targets(rows)
    assert "infeasible" in text and "+40.0%" in text
