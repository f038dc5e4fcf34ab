"""The ``--meter`` spec's parse-time limits: values that would hang, grow memory or print NaN are refused."""
from __future__ import annotations

import pytest

from refspec.energy.meters.spec import MeterSpecError, parse_meter_spec


@pytest.mark.parametrize("spec", [
    "simulated:period_ms=1e308",  # never completes a period: hangs waiting for the first update
    "simulated:period_ms=1e-300",  # one entry per period: memory without bound
    "simulated:sample_ms=1e-300:period_ms=1",
    "simulated:noise=1e6",  # gains clipped at zero: NaN shares
    "simulated:sub_window_s=1e300",
    "simulated:seed=99999999999999999999999",
    "roofline:cpu-bogus",  # was read as the cpu profile
    "simulated:cpu-anything",
])
def test_extreme_or_unknown_values_are_refused(spec):
    with pytest.raises(MeterSpecError):
        parse_meter_spec(spec)


def test_ordinary_values_still_parse():
    spec = parse_meter_spec("simulated:h200:period_ms=100:sample_ms=25:noise=0.05:seed=3:sub_window_s=2")
    assert spec.profile == "h200" and spec.options == {"period_ms": 100.0, "sample_ms": 25.0, "noise": 0.05,
                                                      "seed": 3, "sub_window_s": 2.0}
    assert parse_meter_spec("simulated:cpu:period_ms=60000:noise=1").options["noise"] == 1.0


@pytest.mark.parametrize("key", ["lag_ms", "rise_ms", "warm_s", "gap_us", "idle_w", "drift_ppm", "busy",
                                 "rows_knee", "keys_gain", "flop_knee_tflops"])
def test_every_device_law_key_has_a_ceiling(key):
    with pytest.raises(MeterSpecError):
        parse_meter_spec(f"simulated:{key}=1e300")
