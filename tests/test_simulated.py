"""The simulated counter: the roofline's per-phase energy as truth, sampled like NVML. A phase
read per phase is wrong; the run's windows carry what attribution needs."""
from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import pytest
import torch

from refspec.config import ModelArgs
from refspec.energy.attribution import nnls_phase_power
from refspec.energy.ledger.counter_records import counter_ledger
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.writer import Ledger
from refspec.energy.meters.make import make_meter
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import forward_cost, total_cost, work_time_s
from refspec.energy.model.work import ForwardShape
from refspec.energy.simulated import PowerTrace, SimulatedCounter, SimulatedMeter

TINY = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True))
DRAFT = ForwardShape(args=TINY, rows=1, tokens_per_row=1, context_tokens=8, dtype_bytes=4)
VERIFY = ForwardShape(args=TINY, rows=4, tokens_per_row=4, context_tokens=64, dtype_bytes=4)
# static 10 W, idle 2 W; one DRAFT forward's bytes cost 30 mJ, so 2 ms per DRAFT draws 25 W, and
# 1 ms per VERIFY (about 36 mJ) about 46 W; a commit (no forward) draws the static 10 W
PJ_PER_BYTE = 0.030 / forward_cost(DRAFT).bytes * 1e12
TOY = HardwareProfile(name="toy", peak_flops=1e9, bandwidth_Bps=1e9, static_w=10.0, pj_per_flop=0.0,
                      pj_per_byte=PJ_PER_BYTE, idle_w=2.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_power_trace_integrates_phases_and_idle():
    tr = PowerTrace(idle_w=2.0, origin_s=10.0)
    tr.add(11.0, 11.5, 20.0)  # 40 W for 0.5 s
    tr.add(11.5, 12.0, 5.0)  # 10 W
    assert tr.energy_at(11.0) == 2.0 and tr.energy_at(11.25) == 12.0 and tr.energy_at(12.0) == 27.0
    assert tr.energy_at(13.0) == 29.0  # idle after the last phase
    tr.add(12.0, 12.0, 0.0)  # an empty phase (a modelled commit) changes nothing
    with pytest.raises(AssertionError):
        tr.add(13.0, 13.0, 1.0)


def test_counter_updates_once_a_period_from_its_sampled_part():
    tr = PowerTrace(idle_w=0.0, origin_s=0.0)
    c = SimulatedCounter(tr, period_s=0.1, sample_s=0.025, clock=lambda: 0.0, source="modelled:x")
    tr.add(0.010, 0.012, 2.0)  # 2 J in the sampled part of period 0: read as 2 J x 100/25
    tr.add(0.150, 0.160, 5.0)  # 5 J in period 1 after its sampled part: never seen
    tr.add(0.205, 0.215, 1.0)  # straddles period 2's sample: 20 of 10 ms... half inside
    assert c.value_at(0.099) == 0.0  # nothing until the first update
    assert c.value_at(0.1) == pytest.approx(8.0)
    assert c.value_at(0.2) == pytest.approx(8.0)
    assert c.value_at(0.3) == pytest.approx(8.0 + 1.0 * 4)  # 10 ms at 100 W inside [0.2, 0.225)
    assert tr.energy_at(0.3) == pytest.approx(8.0)
    full = SimulatedCounter(tr, period_s=0.1, sample_s=0.1, clock=lambda: 0.0, source="modelled:x")
    assert full.value_at(0.35) == pytest.approx(tr.energy_at(0.3))  # a full-time sensor lags by one period


def test_noise_is_seeded_and_unbiased():
    def run(seed):
        tr = PowerTrace(idle_w=100.0, origin_s=0.0)
        c = SimulatedCounter(tr, period_s=0.1, sample_s=0.1, noise=0.1, seed=seed, clock=lambda: 0.0,
                             source="modelled:x")
        return c.value_at(100.0)

    assert run(1) == run(1) != run(2)
    assert run(1) == pytest.approx(100.0 * 100.0, rel=0.01)  # 1000 updates of 10 % noise


def test_meter_records_truth_naive_read_and_counter_reads():
    clock = Clock()
    m = SimulatedMeter(TOY, time_source="wall_time", period_s=0.1, sample_s=0.025, clock=clock)
    assert m.source == "modelled:simulated-counter(toy,wall-time,P=100ms,S=25ms)" and m.idle_w == 2.0
    m.begin("verify")
    clock.t += 0.004
    out = m.end("verify", (VERIFY,) * 4)
    truth = dict(out.extra)["energy_true_j"]
    assert out.time_s == pytest.approx(0.004) and out.energy_j is None
    assert truth == pytest.approx(TOY.energy_j(total_cost((VERIFY,) * 4), 0.004))
    assert dict(out.extra)["energy_naive_j"] == 0.0  # a 4 ms phase inside one period sees no update
    start = out.marks[0].read
    assert start.energy_j == 0.0 and start.true_j == 0.0 and out.marks[0].reason == "start"
    clock.t += 1.996  # idle to 2 s
    end = m.finish_run()
    assert end.true_j == pytest.approx(truth + 2.0 * 1.996)
    # period 0 samples the verify and 21 ms of idle, x 100/25; periods 1-19 sample idle 2 W
    assert end.energy_j == pytest.approx(4 * (truth + 2.0 * 0.021) + 19 * 2.0 * 0.1)


def test_gpu_profile_runs_on_the_modelled_clock_and_warns_when_too_short(caplog):
    m = make_meter("simulated:h200:period_ms=100:sample_ms=25")
    assert isinstance(m, SimulatedMeter) and m.time_source == "model"
    assert m.source == "modelled:simulated-counter(h200-sxm,P=100ms,S=25ms)"
    m.begin("verify")
    out = m.end("verify", (VERIFY,))
    assert out.time_s == work_time_s((VERIFY,), m.profile) and m.counter.read().wall_s == out.time_s
    with caplog.at_level(logging.WARNING, logger="refspec.energy.meters"):
        m.finish_run()
    assert "cannot be resolved" in caplog.text


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
        clock.t += rng.uniform(0.0005, 0.0015)  # host time outside any phase draws idle power
    end = meter.finish_run()
    bounds.append((clock.t, end.energy_j, end.true_j))
    energy = [b[1] - a[1] for a, b in zip(bounds, bounds[1:])]
    span = [b[0] - a[0] for a, b in zip(bounds, bounds[1:])]
    return truth, naive, windows, span, energy, bounds[-1][2] - bounds[0][2]


NAMES = ("draft", "verify", "commit")


def test_naive_per_phase_read_fails_where_sub_windows_recover_the_split():
    clock = Clock()
    meter = SimulatedMeter(TOY, time_source="wall_time", period_s=0.1, sample_s=0.025, clock=clock)
    truth, naive, windows, span, energy, true_total = drifting_run(meter, clock, 60.0)
    assert len(windows) >= 50 and all(s >= meter.sub_window_s for s in span[:-1])
    # the whole run: the counter's total within 2 % of the truth it sampled
    assert sum(energy) == pytest.approx(true_total, rel=0.02)
    # per phase: the naive read follows time rather than power, so some phase is far off
    naive_error = {p: abs(naive[p] - truth[p]) / truth[p] for p in NAMES}
    assert max(naive_error.values()) > 0.20, naive_error
    # the sub-windows carry the split: net of idle power over the host time between phases (a
    # commit and a host gap both last about the same every step, so a fit cannot tell them
    # apart), a non-negative fit of phase powers recovers it
    net = [e - meter.idle_w * (s - sum(t)) for e, s, t in zip(energy, span, windows)]
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
    # the modelled clock has no host time: the truth between the bounds is the phases' truth
    assert counts[-1]["energy_true_j"] - counts[0]["energy_true_j"] == pytest.approx(
        sum(r["energy_true_j"] for r in phases))
    assert counts[-1]["clock_s"] == pytest.approx(sum(r["time_s"] for r in phases))
    assert counts[-1]["wall_s"] - counts[0]["wall_s"] == pytest.approx(counts[-1]["clock_s"])


def test_the_record_says_simulated_never_measured():
    from refspec.eval.record_figures import describe_source

    text = describe_source(make_meter("simulated:h200:period_ms=50:sample_ms=12.5").source)
    assert text == ("simulated (not measured): a counter (h200-sxm,P=50ms,S=12.5ms) sampling the roofline's "
                    "modelled energy")
