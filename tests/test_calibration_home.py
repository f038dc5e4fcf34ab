"""A REFSPEC_HOME the calibration cache cannot be written to disables the cache only (a warning, no error)."""
from __future__ import annotations

import logging

from refspec.models import calibration as C


def _timer(calls):
    def timer(dtype, bucket, form):
        calls.append((dtype, bucket, form))
        return 0.5 if form == "wxt" else 1.0
    return timer


def test_an_unwritable_home_keeps_the_plan_for_this_process(tmp_path, caplog):
    home = tmp_path / "home-is-a-file"
    home.write_text("not a folder\n")  # like a read-only share: no calibration/ can be made under it
    calls: list = []
    with caplog.at_level(logging.WARNING, logger=C.__name__):
        first = C.load_or_calibrate(home, dtypes=("fp32",), timer=_timer(calls))
    assert "fp32" in first.forms and any("cannot be written" in r.getMessage() for r in caplog.records)
    n = len(calls)
    second = C.load_or_calibrate(home, dtypes=("fp32",), timer=_timer(calls))
    assert len(calls) == n and second.forms == first.forms, "timed again in the same process"
    assert home.read_text() == "not a folder\n"
