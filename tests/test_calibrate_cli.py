"""``python -m refspec.eval calibrate``: prints the plan and its timings, caches a quiet
calibration, refuses a busy one (exit 1, nothing cached), rejects bad flags (exit 2)."""
import pytest

from refspec.eval import calibrate_cli
from refspec.models import calibration as C


def _fake_calibrate(spread: float):
    """C.calibrate with injected timings: rounds that differ by ``spread``, column fastest for one row."""
    real = C.calibrate

    def calibrate(dtypes, timer=None):
        rounds = iter(range(10_000))

        def t(dtype, bucket, form):
            slow = 1.0 + spread if (next(rounds) // 12) % 2 else 1.0  # 12 calls per fp32 round
            return slow * (0.5 if (bucket, form) == ("one", "column") else 1.0)
        return real(dtypes, timer=t)
    return calibrate


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    return tmp_path


def test_a_quiet_calibration_is_printed_and_cached(home, monkeypatch, capsys):
    monkeypatch.setattr(C, "calibrate", _fake_calibrate(0.02))
    assert calibrate_cli.main(["--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "fp32: one=column" in out and "measured now" in out and "*500.00" in out
    assert C.plan_path(home, C.machine_key()).exists()
    assert calibrate_cli.main(["--dtype", "fp32"]) == 0 and "(cached;" in capsys.readouterr().out


def test_a_busy_calibration_is_refused_and_not_cached(home, monkeypatch, capsys):
    monkeypatch.setattr(C, "calibrate", _fake_calibrate(0.5))
    assert calibrate_cli.main(["--dtype", "fp32", "--force"]) == 1
    out = capsys.readouterr().out
    assert "fp32: REFUSED, timing rounds differ by 50% (limit 15%)" in out and "--force" in out
    assert not C.plan_path(home, C.machine_key()).exists()


def test_bad_dtype_is_one_line_exit_2(home, capsys):
    assert calibrate_cli.main(["--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dtype 'fp8'") and err.count("\n") == 1
