"""Ledger round trip, accounting arithmetic on a hand-checkable run, phase attribution."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from refspec.energy.accounting import AccountingError, account, pool_runs
from refspec.energy.accounting_text import format_accounting
from refspec.energy.attribution import Loop, additivity_check, nnls_phase_power
from refspec.config import ModelArgs
from refspec.energy.ledger import SCHEMA, Ledger, LedgerError, read_ledger
from refspec.energy.meters import FakeMeter
from refspec.energy.phases import ForwardShape, Measurement, PhaseEvent
from refspec.energy.roofline import forward_cost

# The run of docs/accounting.md: batch 2, k = 3. Per phase: (step, phase, seconds, joules, counts).
# Row 0 accepts 3, 2, 1 drafts in steps 0-2; row 1 accepts 1, then 0 and stops at EOS in step 1.
RUN = [
    (-1, "prefill", 0.5, 95.0, dict(rows_active=2, emitted=2, emitted_per_row=(1, 1))),
    (0, "draft", 0.125, 12.0, dict(rows_active=2, drafted=6)),
    (0, "verify", 0.25, 40.0, dict(rows_active=2, verified=8)),
    (0, "commit", 0.0625, 5.0, dict(rows_active=2, accepted=4, emitted=6, emitted_per_row=(4, 2))),
    (1, "draft", 0.125, 12.0, dict(rows_active=2, drafted=6)),
    (1, "verify", 0.25, 40.0, dict(rows_active=2, verified=8)),
    (1, "commit", 0.0625, 5.0, dict(rows_active=2, accepted=2, emitted=4, emitted_per_row=(3, 1))),
    (2, "draft", 0.125, 9.0, dict(rows_active=1, drafted=3)),
    (2, "verify", 0.25, 30.0, dict(rows_active=1, verified=4)),
    (2, "commit", 0.0625, 4.0, dict(rows_active=1, accepted=1, emitted=2, emitted_per_row=(2, 0))),
]


def write_run(path, run=RUN, idle_w=20.0, repeat_counts=False):
    """Meter RUN with a FakeMeter over a scripted clock and counter, and write its ledger."""
    world = {"t": 0.0, "e": 1000.0}
    meter = FakeMeter(lambda: world["t"], lambda: world["e"], idle_w=idle_w)
    step_counts: dict[int, dict] = {}
    if repeat_counts:  # the same step counts on every phase record of the step
        for step, _, _, _, c in run:
            step_counts.setdefault(step, {}).update(c)
    with Ledger(path, run_id="demo", labels={"k": 3, "batch": 2}, meter_source=meter.source, idle_w=idle_w) as led:
        for step, phase, dt, de, counts in run:
            meter.begin(phase)
            world["t"] += dt
            world["e"] += de
            m = meter.end(phase)
            c = dict(step_counts[step]) if repeat_counts else dict(counts)
            c["emitted_per_row"] = tuple(c.get("emitted_per_row", ()))
            led(PhaseEvent(step=step, phase=phase, batch=2, measurement=m, **c))
    return path


def test_accounting_of_the_documented_run(tmp_path):
    acc = account(read_ledger(write_run(tmp_path / "run.jsonl")))
    assert acc.sources == ("measured:fake-counter",) and acc.measured
    assert (acc.emitted, acc.drafted, acc.accepted, acc.verified) == (14, 15, 7, 20)
    assert acc.total_energy_j == 252.0
    assert acc.j_per_token == 252.0 / 14 == 18.0
    assert acc.j_per_verified_token == 110.0 / 20
    assert acc.phase_energy_j == {"prefill": 95.0, "draft": 33.0, "verify": 110.0, "commit": 14.0}
    assert acc.phase_share["verify"] == pytest.approx(110 / 252)
    # rejected positions: (8 - 4 - 2) + (8 - 2 - 2) + (4 - 1 - 1)
    assert acc.rejected_positions == 8
    assert acc.verify_rejected_j == 40 * 2 / 8 + 40 * 4 / 8 + 30 * 2 / 4 == 45.0
    assert acc.draft_rejected_j == 12 * 2 / 6 + 12 * 4 / 6 + 9 * 2 / 3 == 18.0
    assert acc.draft_rejected_share == pytest.approx(18 / 33)
    assert acc.rejected_energy_j == 63.0 and acc.rejected_share == 0.25
    assert acc.line_items_j == {"prefill": 95.0, "draft_kept": 15.0, "draft_rejected": 18.0, "verify_useful": 65.0,
                                "verify_rejected": 45.0, "commit": 14.0, "other": 0.0}
    assert acc.closes and acc.closure_error_j == 0.0
    # time: 0.5 s prefill + 3 steps of 0.4375 s
    assert acc.total_time_s == 1.8125 and acc.prefill_time_s == 0.5
    assert acc.tokens_per_s == 14 / 1.8125
    assert acc.idle_w == 20.0
    assert acc.net_energy_j == 252.0 - 20.0 * 1.8125
    assert acc.net_j_per_token == pytest.approx((252.0 - 36.25) / 14)
    assert acc.net_phase_energy_j["verify"] == 110.0 - 20.0 * 0.75
    # tau: (accepted + bonus) / row-steps = (7 + 5) / 5
    assert acc.tau == 2.4 and acc.acceptance_rate == 7 / 15
    # TPOT: row 0 emitted 10 tokens, active through step 2; row 1 emitted 4, through step 1
    assert acc.tpot_per_row_s == pytest.approx((3 * 0.4375 / 9, 2 * 0.4375 / 3))
    assert acc.tpot_p50_s == pytest.approx((3 * 0.4375 / 9 + 2 * 0.4375 / 3) / 2)
    assert acc.tpot_p99_s == pytest.approx(3 * 0.4375 / 9 + 0.99 * (2 * 0.4375 / 3 - 3 * 0.4375 / 9))
    report = format_accounting(acc)
    assert "measured:fake-counter" in report and "closure" in report and "OK" in report


def test_counts_repeated_on_every_phase_give_the_same_accounting(tmp_path):
    once = account(read_ledger(write_run(tmp_path / "a.jsonl")))
    everywhere = account(read_ledger(write_run(tmp_path / "b.jsonl", repeat_counts=True)))
    for field in ("emitted", "accepted", "verified", "rejected_positions", "tau", "line_items_j", "tpot_per_row_s"):
        assert getattr(once, field) == getattr(everywhere, field), field


def test_idle_power_argument_overrides_header_and_none_disables_net(tmp_path):
    path = write_run(tmp_path / "run.jsonl", idle_w=None)
    assert account(read_ledger(path)).net_energy_j is None
    assert account(read_ledger(path), idle_w=10.0).net_energy_j == 252.0 - 18.125


def test_time_only_ledger_has_no_energy_figures(tmp_path):
    with Ledger(tmp_path / "t.jsonl", run_id="t") as led:
        led(PhaseEvent(step=-1, phase="prefill", batch=1, rows_active=1, emitted=1, emitted_per_row=(1,),
                       measurement=Measurement(0.5, None, "none:time-only")))
        led(PhaseEvent(step=0, phase="verify", batch=1, rows_active=1, verified=1, emitted=1, emitted_per_row=(1,),
                       measurement=Measurement(0.25, None, "none:time-only")))
    acc = account(read_ledger(tmp_path / "t.jsonl"))
    assert acc.total_energy_j is None and acc.j_per_token is None and acc.closes is None
    assert acc.tau == 1.0 and acc.tpot_p50_s == 0.25
    assert "time-only" in format_accounting(acc)


def test_unknown_phase_is_other_and_closure_holds(tmp_path):
    run = RUN + [(2, "sample", 0.5, 7.5, dict(rows_active=1))]
    acc = account(read_ledger(write_run(tmp_path / "o.jsonl", run=run)))
    assert acc.line_items_j["other"] == 7.5 and acc.closes and acc.total_energy_j == 259.5


def test_several_runs_need_a_run_id(tmp_path):
    path = tmp_path / "two.jsonl"
    write_run(path)
    with Ledger(path, run_id="second", mode="a") as led:
        led(PhaseEvent(step=-1, phase="prefill", batch=1, rows_active=1, emitted=1,
                       measurement=Measurement(1.0, 2.0, "measured:fake-counter")))
    records = read_ledger(path)
    with pytest.raises(AccountingError, match="pass run_id"):
        account(records)
    assert account(records, run_id="second").total_energy_j == 2.0
    assert account(records, run_id="demo").total_energy_j == 252.0


TINY = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True))


def test_ledger_round_trip_with_modelled_work(tmp_path):
    shape = ForwardShape(args=TINY, rows=2, tokens_per_row=4, context_tokens=24, dtype_bytes=2)
    event = PhaseEvent(step=3, phase="verify", batch=2, rows_active=2, verified=8, work=(shape, shape),
                       measurement=Measurement(0.01, 1.5, "measured:fake-counter"), emitted_per_row=(2, 1))
    with Ledger(tmp_path / "l.jsonl", run_id="r1", labels={"model": "tiny"}, meter_source="measured:fake-counter",
                idle_w=3.0) as led:
        led(event)
    header, rec = read_ledger(tmp_path / "l.jsonl")
    assert header["kind"] == "run" and header["labels"] == {"model": "tiny"} and header["idle_w"] == 3.0
    assert set(rec) == set(SCHEMA)
    cost = forward_cost(shape)
    assert rec["flops"] == 2 * cost.flops and rec["bytes"] == 2 * cost.bytes and rec["forwards"] == 2
    assert rec["kv_read_bytes"] == 2 * cost.kv_read_bytes
    assert (rec["step"], rec["phase"], rec["verified"], rec["time_s"], rec["energy_j"]) == (3, "verify", 8, 0.01, 1.5)
    assert rec["emitted_per_row"] == [2, 1] and rec["run_id"] == "r1"


def test_ledger_is_flushed_per_record(tmp_path):
    led = Ledger(tmp_path / "f.jsonl", run_id="f")
    led(PhaseEvent(step=0, phase="verify", batch=1, rows_active=1, measurement=Measurement(1.0, 1.0, "x")))
    assert len(read_ledger(tmp_path / "f.jsonl")) == 2  # readable before close
    led.close()
    with pytest.raises(LedgerError, match="closed"):
        led(PhaseEvent(step=1, phase="verify", batch=1, rows_active=1, measurement=Measurement(1.0, 1.0, "x")))


def test_corrupt_lines_are_reported_by_number(tmp_path, caplog):
    path = write_run(tmp_path / "c.jsonl")
    with open(path, "a") as fh:
        fh.write("not json\n")
        fh.write(json.dumps({"kind": "phase", "version": 1, "run_id": "demo"}) + "\n")
        fh.write('{"kind": "phase", "version": 1, "step": 9, "pha')  # truncated by a crash
    with caplog.at_level(logging.WARNING, logger="refspec.energy.ledger"):
        records = read_ledger(path)
    assert len(records) == 11  # header + 10 phases survive
    assert [n for n, _ in records.corrupt] == [12, 13, 14]
    assert "missing fields" in records.corrupt[1][1]
    assert "line 12" in caplog.text and "line 14" in caplog.text
    assert account(records).total_energy_j == 252.0
    with pytest.raises(LedgerError, match="line 12"):
        read_ledger(path, strict=True)
    with pytest.raises(LedgerError, match="no ledger"):
        read_ledger(tmp_path / "missing.jsonl")


# ---- attribution ------------------------------------------------------------------------------
def test_nnls_recovers_known_phase_powers():
    rng = np.random.default_rng(0)
    truth = np.array([310.0, 180.0, 120.0])  # verify, draft, commit, W
    times = rng.uniform(0.2, 2.0, size=(40, 3))  # [W, P] seconds per window
    energy = times @ truth + rng.normal(0.0, 0.5, size=40)
    fit = nnls_phase_power(energy, times, ["verify", "draft", "commit"])
    for name, p in zip(["verify", "draft", "commit"], truth):
        assert fit.power_w[name] == pytest.approx(p, rel=0.01)
    assert fit.relative_residual < 0.01
    assert sum(fit.share.values()) == pytest.approx(1.0)
    assert len(fit.window_residuals_j) == 40


def test_nnls_unattributed_gap_and_non_negativity():
    times = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]])
    gaps = np.array([0.5, 0.5, 0.0, 1.0])
    energy = times @ np.array([300.0, 100.0]) + 60.0 * gaps
    fit = nnls_phase_power(energy, times, ["verify", "draft"], window_time_s=times.sum(axis=1) + gaps)
    assert fit.power_w == pytest.approx({"verify": 300.0, "draft": 100.0, "unattributed": 60.0})
    assert fit.residual_j == pytest.approx(0.0, abs=1e-9)
    negative = nnls_phase_power([1.0, 1.0, 2.0], [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]], ["a", "b"])
    assert min(negative.power_w.values()) >= 0.0
    with pytest.raises(ValueError, match="shape"):
        nnls_phase_power([1.0], [[1.0, 2.0]], ["a"])


def test_additivity_check():
    isolated = {"draft": Loop(energy_j=1800.0, time_s=10.0, iterations=1000),
                "verify": Loop(energy_j=6000.0, time_s=20.0, iterations=1000)}
    good = additivity_check(isolated, Loop(energy_j=7.9e3, time_s=30.5, iterations=1000))
    assert good.predicted_j_per_step == 7.8 and good.combined_j_per_step == 7.9
    assert good.relative_error == pytest.approx(-0.1 / 7.9) and good.ok
    assert good.phase_share["verify"] == pytest.approx(6 / 7.8)
    bad = additivity_check(isolated, Loop(energy_j=10e3, time_s=30.0, iterations=1000))
    assert not bad.ok
