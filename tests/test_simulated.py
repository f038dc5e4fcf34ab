"""The simulated device: its own power law (not the roofline's), lag, host power and warm-up, a
counter sampling it like NVML with a drifting clock. A phase read per phase is wrong; the run's
windows carry what attribution needs."""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from refspec.config import ModelArgs
from refspec.energy.accounting.attribution import nnls_phase_power
from refspec.energy.ledger.counter_records import counter_ledger
from refspec.energy.meters.device_law import SPEC_KEYS, DeviceLaw, cpu_law, gpu_law
from refspec.energy.model.hardware import H200_SXM, HardwareProfile
from refspec.energy.ledger.writer import Ledger
from refspec.energy.ledger.read import read_ledger
from refspec.energy.meters.spec import SIMULATED_LAW, MeterSpecError
from refspec.energy.meters.make import make_meter
from refspec.energy.model.work import ForwardShape
from refspec.energy.model.roofline import forward_cost, work_time_s
from refspec.energy.meters.simulated import PowerTrace, SimulatedCounter, SimulatedMeter

TINY = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True))
DRAFT = ForwardShape(args=TINY, rows=1, tokens_per_row=1, context_tokens=8, dtype_bytes=4)
VERIFY = ForwardShape(args=TINY, rows=4, tokens_per_row=4, context_tokens=64, dtype_bytes=4)
TOY = HardwareProfile(name="toy", peak_flops=1e9, bandwidth_Bps=1e9, static_w=10.0, pj_per_flop=0.0,
                      pj_per_byte=50.0, idle_w=2.0)
FLAT = DeviceLaw(idle_w=2.0, host_w=2.0, active_w=10.0, tdp_w=100.0, flop_w=0.0, flop_knee=1.0, byte_w=0.0,
                 byte_knee=1.0, hold_s=0.0)
"""A law without dynamic power, lag or host power: every phase at 10 W, 2 W between."""
# toy law: a DRAFT forward's bytes in 2 ms drive the byte term near its knee, a VERIFY's in 1 ms well past it
LAW = DeviceLaw(idle_w=2.0, host_w=4.0, active_w=10.0, tdp_w=200.0, flop_w=20.0, flop_knee=1e9, byte_w=40.0,
                byte_knee=forward_cost(DRAFT).bytes / 0.002, rows_knee=4.0, keys_gain=0.3, hold_s=0.5)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---- the law --------------------------------------------------------------------------------------
def test_a_phase_draws_a_level_from_what_it_does_not_from_the_roofline():
    draft, verify = LAW.level_w((DRAFT,), 0.002), LAW.level_w((VERIFY,), 0.001)
    assert LAW.level_w((), 0.01) == LAW.active_w == 10.0, "no forward: the active power"
    assert 10.0 < draft < verify < LAW.tdp_w
    # saturation: the same bytes in half the time raise the level by less than the rate doubled
    faster = LAW.level_w((DRAFT,), 0.001)
    assert faster - 10.0 < 2 * (draft - 10.0)
    # occupancy: the same bytes and FLOPs in as many rows draw less than in more rows
    one_row = dataclasses.replace(VERIFY, rows=1, tokens_per_row=1)
    cost = forward_cost(one_row)
    dt = 0.001
    wide = dataclasses.replace(LAW, rows_knee=1e-9)  # every forward fully occupied
    assert LAW.level_w((one_row,), dt) < wide.level_w((one_row,), dt)
    assert cost.kv_read_bytes > 0 and LAW.level_w((one_row,), dt) > dataclasses.replace(
        LAW, keys_gain=0.0).level_w((one_row,), dt), "key reads draw more per byte"
    assert dataclasses.replace(LAW, tdp_w=12.0).level_w((VERIFY,), 0.001) == 12.0, "capped"
    # the roofline prices energy linearly in the work: twice the verifies in the same time, twice the
    # dynamic energy; the law's power saturates instead
    assert TOY.energy_j(forward_cost(VERIFY).scale(2), 0.001) - 10e-3 == pytest.approx(
        2 * (TOY.energy_j(forward_cost(VERIFY), 0.001) - 10e-3))
    assert LAW.level_w((VERIFY, VERIFY), 0.001) - 10.0 < 1.9 * (verify - 10.0)


def test_a_time_shared_device_draws_its_level_whatever_the_load():
    shared = dataclasses.replace(LAW, busy=0.0)
    assert shared.level_w((VERIFY,), 0.001) == pytest.approx(shared.level_w((VERIFY,), 0.5))
    assert LAW.level_w((VERIFY,), 0.5) < LAW.level_w((VERIFY,), 0.001), "busy: a stretched phase draws less"


def test_bad_law_parameters_are_refused():
    with pytest.raises(ValueError, match="idle_w <= host_w"):
        dataclasses.replace(LAW, host_w=1.0)
    with pytest.raises(ValueError, match="finite and >= 0: lag_s"):
        dataclasses.replace(LAW, lag_s=-1.0)
    with pytest.raises(ValueError, match="busy at most 1"):
        dataclasses.replace(LAW, busy=2.0)


# ---- the trace ------------------------------------------------------------------------------------
def test_power_trace_integrates_levels_host_time_and_idle():
    tr = PowerTrace(dataclasses.replace(FLAT, host_w=4.0, hold_s=1.0), origin_s=10.0)
    assert tr.energy_at(11.0) == 2.0, "idle before the first phase"
    assert tr.add(11.0, 11.5, 40.0) == 20.0
    assert tr.energy_at(12.0) == 24.0 and tr.energy_at(13.0) == 27.0, "host 4 W for 1 s, then idle"
    assert tr.add(13.0, 13.25, 8.0) == 2.0 and tr.energy_at(13.25) == 29.0
    assert tr.add(13.25, 13.25, 100.0) == 0.0, "an empty phase draws nothing"


def test_power_rises_fast_and_falls_slowly_between_phases():
    law = dataclasses.replace(FLAT, rise_s=0.01, lag_s=0.1)
    tr = PowerTrace(law, origin_s=0.0)
    hungry = tr.add(1.0, 1.5, 40.0)
    assert hungry == pytest.approx(40.0 * 0.5 - 38.0 * 0.01 * (1 - math.exp(-50)))
    short = tr.add(1.5, 1.6, 10.0)  # a short phase after a hungry one draws its power
    assert short == pytest.approx(10.0 * 0.1 + 30.0 * 0.1 * (1 - math.exp(-1)))
    assert short > 2 * 10.0 * 0.1


def test_the_device_warms_over_the_run():
    law = dataclasses.replace(LAW, warm_w=5.0, warm_s=10.0)
    assert law.level_w((), 1.0, age_s=0.0) == 10.0
    assert law.level_w((), 1.0, age_s=10.0) == pytest.approx(10.0 + 5.0 * (1 - math.exp(-1)))


# ---- the counter ----------------------------------------------------------------------------------
def test_counter_updates_once_a_period_from_its_sampled_part():
    quiet = dataclasses.replace(FLAT, idle_w=0.0, host_w=0.0)
    tr = PowerTrace(quiet, origin_s=0.0)
    c = SimulatedCounter(tr, period_s=0.1, sample_s=0.025, clock=lambda: 0.0, source="modelled:x")
    tr.add(0.010, 0.012, 1000.0)  # 2 J in the sampled part of period 0: read as 2 J x 100/25
    tr.add(0.150, 0.160, 500.0)  # 5 J in period 1 after its sampled part: never seen
    tr.add(0.215, 0.235, 100.0)  # 2 J straddling period 2's sample: 1 J inside
    assert c.value_at(0.099) == 0.0  # nothing until the first update
    assert c.value_at(0.1) == pytest.approx(8.0)
    assert c.value_at(0.2) == pytest.approx(8.0)
    assert c.value_at(0.3) == pytest.approx(8.0 + 1.0 * 4)
    assert tr.energy_at(0.3) == pytest.approx(9.0)
    # a counter clock 10 % fast (its 110 ms are the trace's 100 ms) whose first period starts 50 ms in
    # samples the 500 W phase, and reports it in its own seconds
    late = SimulatedCounter(tr, period_s=0.11, sample_s=0.0275, clock=lambda: 0.0, source="x", drift_ppm=1e5,
                            offset_s=0.05)
    assert late.value_at(0.2499) == 0.0
    assert late.value_at(0.25) == pytest.approx(5.0 * 1.1 * 4)


def test_noise_is_seeded_and_unbiased():
    def run(seed):
        tr = PowerTrace(dataclasses.replace(FLAT, idle_w=100.0, host_w=100.0, tdp_w=200.0), origin_s=0.0)
        c = SimulatedCounter(tr, period_s=0.1, sample_s=0.1, noise=0.1, seed=seed, clock=lambda: 0.0,
                             source="modelled:x")
        return c.value_at(100.0)

    assert run(1) == run(1) != run(2)
    assert run(1) == pytest.approx(100.0 * 100.0, rel=0.01)  # 1000 updates of 10 % noise


# ---- the meter ------------------------------------------------------------------------------------
def test_meter_records_truth_naive_read_and_counter_reads():
    clock = Clock()
    m = SimulatedMeter(TOY, time_source="wall_time", period_s=0.1, sample_s=0.025, clock=clock, law=LAW,
                       offset_s=0.0)
    assert m.source == "modelled:simulated-counter(toy,wall-time,P=100ms,S=25ms)" and m.idle_w == 2.0
    m.begin("verify")
    clock.t += 0.004
    out = m.end("verify", (VERIFY,) * 4)
    truth = dict(out.extra)["energy_true_j"]
    assert out.time_s == pytest.approx(0.004) and out.energy_j is None
    assert truth == pytest.approx(LAW.level_w((VERIFY,) * 4, 0.004) * 0.004)
    assert dict(out.extra)["energy_naive_j"] == 0.0  # a 4 ms phase inside one period sees no update
    start = out.marks[0].read
    assert start.energy_j == 0.0 and start.true_j == 0.0 and out.marks[0].reason == "start"
    clock.t += 1.996  # host power for 0.5 s, then idle, to 2 s
    end = m.finish_run()
    assert end.true_j == pytest.approx(truth + 4.0 * 0.5 + 2.0 * 1.496)
    # period 0 samples the verify and 21 ms of host time, x 100/25; periods 1-4 host time; period 5
    # 4 ms of host time and 21 ms idle; periods 6-19 idle
    assert end.energy_j == pytest.approx(4 * (truth + 4.0 * 0.021) + 4 * 4.0 * 0.1 + 4 * (4.0 * 0.004 + 2.0 * 0.021)
                                         + 14 * 2.0 * 0.1)


def test_spec_keys_set_the_law_and_the_counter_clock():
    assert set(SPEC_KEYS) | {"drift_ppm", "offset_ms"} == set(SIMULATED_LAW)
    m = make_meter("simulated:h200:lag_ms=3:host_w=150:flop_knee_tflops=200:gap_us=4:drift_ppm=40:offset_ms=7")
    assert m.law == dataclasses.replace(gpu_law(H200_SXM), lag_s=3e-3, host_w=150.0, flop_knee=2e14, gap_s=4e-6)
    assert m.counter._first == pytest.approx(0.007) and m.counter._scale == pytest.approx(1 / (1 + 40e-6))
    with pytest.raises(MeterSpecError, match="lag_ms=-1 must be >= 0"):
        make_meter("simulated:h200:lag_ms=-1")
    with pytest.raises(ValueError, match="idle_w <= host_w"):
        make_meter("simulated:h200:host_w=10")
    assert make_meter("simulated:h200").counter._first != make_meter("simulated:h200:seed=1").counter._first


def test_gpu_profile_runs_on_the_modelled_clock_with_host_gaps_and_warns_when_too_short(caplog):
    m = make_meter("simulated:h200:period_ms=100:sample_ms=25")
    assert isinstance(m, SimulatedMeter) and m.time_source == "model"
    assert m.source == "modelled:simulated-counter(h200-sxm,P=100ms,S=25ms)"
    m.begin("verify")
    out = m.end("verify", (VERIFY,))
    assert out.time_s == work_time_s((VERIFY,), m.profile)
    m.begin("commit")
    bare = m.end("commit", ())
    assert bare.time_s == m.law.bare_s > 0, "a phase without forwards takes the law's bare time"
    assert m.counter.read().wall_s == pytest.approx(2 * m.law.gap_s + out.time_s + bare.time_s)
    with caplog.at_level(logging.WARNING, logger="refspec.energy.meters"):
        m.finish_run()
    assert "cannot be resolved" in caplog.text


def test_a_cpu_profile_gets_a_time_shared_law_at_its_idle_power():
    law = cpu_law(TOY)
    assert law.busy == 0.0 and law.idle_w == TOY.idle_w < law.host_w < law.active_w


NAMES = ("draft", "verify", "commit")


def drifting_run(meter: SimulatedMeter, clock: Clock, seconds: float, seed: int = 0):
    """Steps of draft, verify, commit and a host gap on a fake clock, the mix drifting between
    regimes of 0.5-2 s (as active rows do). Returns per phase the summed truth and naive read,
    and per window between consecutive counter reads its phase times, duration and energy."""
    rng = random.Random(seed)
    truth = dict.fromkeys(NAMES, 0.0)
    naive = dict.fromkeys(NAMES, 0.0)
    windows: list[list[float]] = []  # per window, the time of each phase in it
    bounds = []  # (clock, counter J, true J) of each read
    regime_end, n_draft, n_verify = 0.0, 1, 4
    while clock.t < seconds:
        if clock.t >= regime_end:
            regime_end, n_draft, n_verify = clock.t + rng.uniform(0.5, 2.0), rng.randint(1, 3), rng.randint(2, 12)
        for i, (name, work, dt) in enumerate((("draft", (DRAFT,) * n_draft, 0.002 * n_draft),
                                              ("verify", (VERIFY,) * n_verify, 0.001 * n_verify),
                                              ("commit", (), rng.uniform(0.001, 0.003)))):
            meter.begin(name)
            clock.t += dt
            m = meter.end(name, work)
            extra = dict(m.extra)
            truth[name] += extra["energy_true_j"]
            naive[name] += extra["energy_naive_j"]
            for mark in m.marks:
                if not mark.at_end:  # the start read, before this phase
                    bounds.append((clock.t - m.time_s, mark.read.energy_j, mark.read.true_j))
                    windows.append([0.0] * len(NAMES))
            windows[-1][i] += m.time_s
            for mark in m.marks:
                if mark.at_end:  # a sub-window read after this phase
                    bounds.append((clock.t, mark.read.energy_j, mark.read.true_j))
                    windows.append([0.0] * len(NAMES))
        clock.t += rng.uniform(0.0005, 0.0015)  # host time outside any phase
    end = meter.finish_run()
    bounds.append((clock.t, end.energy_j, end.true_j))
    energy = [b[1] - a[1] for a, b in zip(bounds, bounds[1:])]
    span = [b[0] - a[0] for a, b in zip(bounds, bounds[1:])]
    return truth, naive, windows, span, energy, bounds[-1][2] - bounds[0][2]


def test_naive_per_phase_read_fails_where_sub_windows_recover_the_split():
    clock = Clock()
    law = dataclasses.replace(LAW, busy=0.0)  # each phase at its level whatever its regime
    # sub-windows of 30 periods: a read sees only whole periods, so a window's energy is off by up to one
    meter = SimulatedMeter(TOY, time_source="wall_time", period_s=0.1, sample_s=0.025, clock=clock, law=law,
                           sub_window_s=3.0)
    truth, naive, windows, span, energy, true_total = drifting_run(meter, clock, 120.0)
    assert len(windows) >= 35 and all(s >= meter.sub_window_s for s in span[:-1])
    # the whole run: the counter's total within 2 % of the truth it sampled
    assert sum(energy) == pytest.approx(true_total, rel=0.02)
    # per phase: the naive read follows time rather than power, so some phase is far off
    naive_error = {p: abs(naive[p] - truth[p]) / truth[p] for p in NAMES}
    assert max(naive_error.values()) > 0.20, naive_error
    # the sub-windows carry the split: net of the host power over the host time between phases,
    # a non-negative fit of phase powers recovers it
    net = [e - law.host_w * (s - sum(t)) for e, s, t in zip(energy, span, windows)]
    fit = nnls_phase_power(net, windows, NAMES)
    fitted = {p: fit.energy_j[p] / sum(fit.energy_j.values()) for p in NAMES}
    share = {p: truth[p] / sum(truth.values()) for p in NAMES}
    assert all(abs(fitted[p] - share[p]) < 0.03 for p in NAMES), (fitted, share)


def test_engine_run_under_the_simulated_counter_closes_on_the_truth(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import TINY_HF

    from refspec.drafters.ngram import NgramDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.models.random_models import random_model

    model = random_model(dict(TINY_HF["llama"]), dtype=torch.float32)
    meter = make_meter("simulated:h200:period_ms=0.002:sample_ms=0.0005:noise=0.1:seed=3:sub_window_s=0.00002")
    path = tmp_path / "ledger.jsonl"
    with counter_ledger(meter, Ledger(path, run_id="sim")) as ledger:
        Engine(model, NgramDrafter(max_n=3, trim=False), config=EngineConfig(k=3), meter=meter,
               observers=[ledger]).generate([[1, 2, 3, 4], [5, 6, 7]], max_new_tokens=24)
    recs = read_ledger(path, strict=True)
    phases = [r for r in recs if r["kind"] == "phase"]
    counts = [r for r in recs if r["kind"] == "counter"]
    assert all(r["energy_j"] is None and r["energy_true_j"] >= 0 and "energy_naive_j" in r for r in phases)
    assert counts[0]["reason"] == "start" and counts[-1]["reason"] == "end" and len(counts) >= 3
    # the modelled clock holds the law's host gap before every phase: the truth between the bounds is
    # the phases' truth and that host time's
    span = counts[-1]["wall_s"] - counts[0]["wall_s"]
    host = span - sum(r["time_s"] for r in phases)
    assert host == pytest.approx(meter.law.gap_s * (len(phases) - 1))
    truth = counts[-1]["energy_true_j"] - counts[0]["energy_true_j"]
    assert sum(r["energy_true_j"] for r in phases) < truth < sum(r["energy_true_j"] for r in phases) + \
        host * meter.law.tdp_w


def test_the_record_says_simulated_never_measured():
    from refspec.eval.record_figures import describe_source

    text = describe_source(make_meter("simulated:h200:period_ms=50:sample_ms=12.5").source)
    assert text == ("simulated (not measured): a counter (h200-sxm,P=50ms,S=12.5ms) sampling a simulated device's "
                    "power law")
