"""The CPU roofline check: predictions come from the verify forward's own shape; the fit is exact."""
from __future__ import annotations

import math

import pytest

from refspec.eval.roofline_check import check_roofline, fit_overhead, format_check, plot_check
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import work_time_s
from refspec.energy.model.work import ForwardShape

# bandwidth-bound by construction on tiny shapes: 1 GB/s and a huge peak
SLOW = HardwareProfile(name="test-1GBps", peak_flops=1e15, bandwidth_Bps=1e9, static_w=1.0, pj_per_flop=1.0,
                       pj_per_byte=1.0, idle_w=0.0)


def test_fit_overhead_recovers_a_line_and_refuses_a_negative_intercept():
    xs = [1.0, 2.0, 5.0, 9.0]
    a, c = fit_overhead(xs, [3 * x + 0.5 for x in xs])
    assert a == pytest.approx(3.0) and c == pytest.approx(0.5)
    a, c = fit_overhead(xs, [2 * x - 1.0 for x in xs])  # would need c < 0: refit through the origin
    assert c == 0.0 and a == pytest.approx(sum(x * (2 * x - 1) for x in xs) / sum(x * x for x in xs))
    with pytest.raises(ValueError):
        fit_overhead([1.0], [1.0])


def test_check_predicts_each_cell_from_its_verify_shape(tiny_models, tmp_path):
    model = tiny_models["llama"]
    res = check_roofline(model, batches=[1, 3], ks=[0, 2], prompt_len=8, new_tokens=5, skip=1, profile=SLOW)
    assert [(c["batch"], c["k"]) for c in res["cells"]] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    for c in res["cells"]:
        assert c["tokens_per_forward"] == c["batch"] * (c["k"] + 1)
        # the context at the first timed step is at least the prompt; recompute the prediction by hand
        shape = ForwardShape(args=model.args, rows=c["batch"], tokens_per_row=c["k"] + 1,
                             context_tokens=c["batch"] * (8 + c["k"] + 1), dtype_bytes=4)
        lower = 1e3 * work_time_s((shape,), SLOW)
        assert lower <= c["predicted_ms"] < 1.5 * lower
        assert c["verify_ratio"] == pytest.approx(c["measured_verify_ms"] / c["predicted_ms"])
        assert c["measured_step_ms"] >= c["measured_verify_ms"] > 0
    # bigger forwards are predicted slower
    pred = {(c["batch"], c["k"]): c["predicted_ms"] for c in res["cells"]}
    assert pred[(3, 2)] > pred[(3, 0)] > pred[(1, 0)]
    assert math.isfinite(res["raw"]["median_abs_rel_error"]) and res["fitted"]["overhead_ms"] >= 0
    text = format_check(res)
    assert "test-1GBps" in text and "fitted overhead" in text
    assert plot_check(res, tmp_path / "r.png").stat().st_size > 0


def test_check_refuses_too_few_tokens(tiny_models):
    with pytest.raises(ValueError, match="new_tokens"):
        check_roofline(tiny_models["llama"], batches=[1], ks=[0], new_tokens=2, skip=2, profile=SLOW)


def test_bench_cli_lists_the_roofline_check(capsys):
    from refspec.eval.bench import main

    with pytest.raises(SystemExit) as exc:
        main(["roofline", "--help"])
    assert exc.value.code == 0
    assert "--plot" in capsys.readouterr().out
