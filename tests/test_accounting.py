"""Ledger round trip, accounting arithmetic on hand-checkable runs (one, and two pooled), phase attribution."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from refspec.config import ModelArgs
from refspec.energy.accounting.headline import (acceptance_length, account, energy_saving, pool_runs, speedup,
                                                tau_of_steps)
from refspec.energy.accounting.text import format_accounting, format_closure
from refspec.energy.accounting.attribution import Loop, additivity_check, nnls_phase_power
from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.ledger.format import (LEDGER_VERSION, MODEL_SCHEMA, SCHEMA, LedgerError, experts_touched,
                                          phase_work, run_models)
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.step_groups import AccountingError
from refspec.energy.ledger.writer import Ledger, RepeatedPhaseError
from refspec.energy.meters.direct import FakeMeter
from refspec.energy.meters.measurement import Measurement
from refspec.energy.model.roofline import forward_cost, total_cost
from refspec.energy.model.work import ForwardShape

# The run of docs/accounting.md: batch 2, k = 3, requests 0 and 1 in slots 0 and 1. Per phase:
# (step, phase, seconds, joules, counts). Row 0 accepts 3, 2, 1 drafts in steps 0-2; row 1
# accepts 1, then 0 and stops at EOS in step 1, so its slot is empty in step 2.
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
# The second batch of docs/accounting.md section 5: both rows reject all 3 drafts; the recovered tokens are EOS.
RUN2 = [
    (-1, "prefill", 0.5, 50.0, dict(rows_active=2, emitted=2, emitted_per_row=(1, 1))),
    (0, "draft", 0.125, 12.0, dict(rows_active=2, drafted=6)),
    (0, "verify", 0.25, 40.0, dict(rows_active=2, verified=8)),
    (0, "commit", 0.0625, 6.0, dict(rows_active=2, accepted=0, emitted=2, emitted_per_row=(1, 1))),
]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "accounting.md"


def slots_of(run, first_request=0):
    """Slot requests per step of a lockstep batch of two: -1 once a row emitted nothing in a decode step."""
    ids, out = [first_request, first_request + 1], {}
    for step, _, _, _, c in run:
        out.setdefault(step, tuple(ids))
        if step >= 0 and "emitted_per_row" in c:
            ids = [-1 if n == 0 else i for i, n in zip(ids, c["emitted_per_row"])]
    return out


def write_run(path, run=RUN, idle_w=20.0, repeat_counts=False, run_id="demo", mode="w", first_request=0):
    """Meter ``run`` with a FakeMeter over a scripted clock and counter, and write its ledger."""
    world = {"t": 0.0, "e": 1000.0}
    slots = slots_of(run, first_request)
    meter = FakeMeter(lambda: world["t"], lambda: world["e"], idle_w=idle_w)
    step_counts: dict[int, dict] = {}
    if repeat_counts:  # the same step counts on every phase record of the step
        for step, _, _, _, c in run:
            step_counts.setdefault(step, {}).update(c)
    with Ledger(path, run_id=run_id, labels={"k": 3, "batch": 2}, meter_source=meter.source, idle_w=idle_w,
                mode=mode) as led:
        for step, phase, dt, de, counts in run:
            clock = world["t"]
            meter.begin(phase)
            world["t"] += dt
            world["e"] += de
            m = meter.end(phase)
            c = dict(step_counts[step]) if repeat_counts else dict(counts)
            c["emitted_per_row"] = tuple(c.get("emitted_per_row", ()))
            arrivals = (0.0, 0.0) if phase == "prefill" else ()
            led(PhaseEvent(step=step, phase=phase, batch=2, measurement=m, slot_requests=slots[step],
                           arrivals_s=arrivals, clock_s=clock, **c))
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
                                "verify_rejected": 45.0, "commit": 14.0, "other": 0.0, "unattributed": 0.0}
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
    # TPOT: request 0 emitted 10 tokens, the last at step 2's end; request 1 emitted 4, the last at step 1's
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
                       slot_requests=(0,), measurement=Measurement(0.5, None, "none:time-only")))
        led(PhaseEvent(step=0, phase="verify", batch=1, rows_active=1, verified=1, emitted=1, emitted_per_row=(1,),
                       slot_requests=(0,), clock_s=0.5, measurement=Measurement(0.25, None, "none:time-only")))
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
        led(PhaseEvent(step=-1, phase="prefill", batch=1, rows_active=1, emitted=1, slot_requests=(0,),
                       measurement=Measurement(1.0, 2.0, "measured:fake-counter")))
    records = read_ledger(path)
    with pytest.raises(AccountingError, match="pass run_id"):
        account(records)
    assert account(records, run_id="second").total_energy_j == 2.0
    assert account(records, run_id="demo").total_energy_j == 252.0


def test_the_documented_closure_line_is_the_one_printed(tmp_path):
    acc = account(read_ledger(write_run(tmp_path / "run.jsonl")))
    line = format_closure(acc.line_items_j, acc.line_items_sum_j, acc.total_energy_j, acc.closure_error_j, acc.closes,
                          acc.phase_energy_method)
    assert line == ("closure (measured-direct split): prefill 95 + draft kept 15 + draft rejected 18 + verify useful 65 "
                    "+ verify rejected 45 + commit 14 + other 0 + unattributed 0 = 252 J; total 252 J; error 0 J -> OK")
    assert line in format_accounting(acc).split("\n")
    assert line in DOCS.read_text(), "docs/accounting.md quotes the closure line as printed"


def test_the_documented_path_names_files_that_exist_at_about_their_length():
    import re

    rows = re.findall(r"^\| \d+ \| `([^`]+)` \| (\d+) \|", DOCS.read_text(), re.M)
    assert len(rows) >= 20 and "refspec/energy/accounting/phase_energy.py" in dict(rows)
    root = DOCS.parents[1]
    for path, lines in rows:
        actual = len((root / path).read_text().splitlines())
        assert abs(actual - int(lines)) <= max(10, int(lines) // 5), f"{path}: docs say {lines} lines, it has {actual}"


def test_closure_line_says_when_items_do_not_close():
    line = format_closure({"prefill": 1.0, "other": 2.0}, 3.0, 4.0, -1.0, False)
    assert line.endswith("= 3 J; total 4 J; error -1 J -> FAILED: they do not close")
    assert format_closure(None, None, None, None, None) == "closure: n/a (no energy recorded)"


# ---- pooling several runs of one configuration ------------------------------------------------
def _two_batches(path):
    write_run(path, run_id="demo.b0")
    write_run(path, run=RUN2, run_id="demo.b1", mode="a", first_request=2)
    return read_ledger(path)


def test_pooled_runs_equal_a_direct_computation(tmp_path):
    """docs/accounting.md section 5, by hand: sums first, then every ratio."""
    acc = pool_runs(_two_batches(tmp_path / "two.jsonl"), ["demo.b0", "demo.b1"])
    assert acc.run_ids == ("demo.b0", "demo.b1") and acc.run_id is None
    assert (acc.emitted, acc.drafted, acc.accepted, acc.verified, acc.row_steps) == (14 + 4, 15 + 6, 7, 28, 7)
    assert acc.total_energy_j == 252.0 + 108.0 == 360.0
    assert acc.j_per_token == 360.0 / 18 == 20.0
    assert acc.total_time_s == 1.8125 + 0.9375 and acc.tokens_per_s == 18 / 2.75
    assert acc.tau == (7 + 0 + 5 + 2) / (5 + 2) == 2.0 and acc.acceptance_rate == 7 / 21
    assert acc.steps == 3 + 1 and acc.prefill_time_s == 1.0
    rows = (3 * 0.4375 / 9, 2 * 0.4375 / 3, 0.4375 / 1, 0.4375 / 1)
    assert acc.tpot_per_row_s == pytest.approx(rows) and acc.rows_with_tpot == 4
    assert acc.tpot_p50_s == pytest.approx((2 * 0.4375 / 3 + 0.4375) / 2)
    assert acc.tpot_p99_s == pytest.approx(0.4375)
    assert acc.phase_energy_j == {"prefill": 145.0, "draft": 45.0, "verify": 150.0, "commit": 20.0}
    assert acc.phase_share["verify"] == pytest.approx(150 / 360)
    assert acc.phase_j_per_token == pytest.approx({"prefill": 145 / 18, "draft": 45 / 18, "verify": 150 / 18,
                                                   "commit": 20 / 18})
    assert acc.rejected_positions == 8 + (8 - 0 - 2)
    assert acc.line_items_j == {"prefill": 145.0, "draft_kept": 15.0, "draft_rejected": 30.0, "verify_useful": 75.0,
                                "verify_rejected": 75.0, "commit": 20.0, "other": 0.0, "unattributed": 0.0}
    assert acc.line_items_sum_j == 360.0 and acc.closes and acc.closure_error_j == 0.0
    assert acc.rejected_energy_j == 105.0 and acc.rejected_share == pytest.approx(105 / 360)
    assert acc.net_energy_j == 360.0 - 20.0 * 2.75 and acc.net_j_per_token == pytest.approx(305.0 / 18)
    assert acc.labels == {"k": 3, "batch": 2}


def test_pooled_figures_are_not_means_of_the_batches(tmp_path):
    records = _two_batches(tmp_path / "two.jsonl")
    first, second = account(records, run_id="demo.b0"), account(records, run_id="demo.b1")
    assert (first.j_per_token, second.j_per_token, first.tau, second.tau) == (18.0, 27.0, 2.4, 1.0)
    pooled = pool_runs(records, ["demo.b0", "demo.b1"])
    assert pooled.j_per_token != (first.j_per_token + second.j_per_token) / 2
    assert pooled.tau != (first.tau + second.tau) / 2


def test_pooling_one_run_is_its_accounting(tmp_path):
    records = _two_batches(tmp_path / "two.jsonl")
    assert pool_runs(records, ["demo.b0"]) == account(records, run_id="demo.b0")


def test_pooling_refuses_runs_that_disagree_on_idle_power(tmp_path):
    path = tmp_path / "idle.jsonl"
    write_run(path, run_id="a")
    write_run(path, run=RUN2, run_id="b", idle_w=30.0, mode="a", first_request=2)
    records = read_ledger(path)
    with pytest.raises(AccountingError, match="disagree on idle power"):
        pool_runs(records, ["a", "b"])
    assert pool_runs(records, ["a", "b"], idle_w=0.0).net_energy_j == 360.0
    with pytest.raises(AccountingError, match="no run ids"):
        pool_runs(records, [])
    with pytest.raises(AccountingError, match="no phase records for run 'c'"):
        pool_runs(records, ["a", "c"])


# ---- one definition: the engine's tau, comparisons ----------------------------------------------
def test_engine_style_tau_is_the_ledger_tau(tmp_path):
    # RUN per row and step: row 0 accepts 3, 2, 1; row 1 accepts 1, 0 and is done in step 2 (-1)
    assert tau_of_steps([[3, 1], [2, 0], [1, -1]]) == account(read_ledger(write_run(tmp_path / "r.jsonl"))).tau
    assert math.isnan(tau_of_steps([[-1, -1]])) and math.isnan(tau_of_steps([]))
    assert acceptance_length(7, 5) == 2.4 and acceptance_length(0, 0) is None


def test_saving_and_speedup_against_a_baseline():
    assert energy_saving(18.0, 24.0) == 0.25 and energy_saving(30.0, 24.0) == -0.25
    assert energy_saving(None, 24.0) is None and energy_saving(18.0, None) is None and energy_saving(1.0, 0.0) is None
    assert speedup(30.0, 20.0) == 1.5 and speedup(None, 20.0) is None and speedup(30.0, 0.0) is None


# ---- the ledger refuses what would be merged ------------------------------------------------------
def _event(step, phase, energy=1.0):
    return PhaseEvent(step=step, phase=phase, batch=1, rows_active=1, verified=1, emitted=1, emitted_per_row=(1,),
                      clock_s=0.5 * (step + 1),
                      measurement=Measurement(0.5, energy, "measured:fake-counter"))


def test_ledger_refuses_a_repeated_step_and_phase_in_one_run(tmp_path):
    path = tmp_path / "r.jsonl"
    with Ledger(path, run_id="gen1") as led:
        led(_event(-1, "prefill"))
        led(_event(0, "verify"))
        with pytest.raises(RepeatedPhaseError, match="run 'gen1' already holds step 0 phase 'verify'"):
            led(_event(0, "verify", energy=9.0))  # a second generation under the same run
        led(_event(1, "verify"))  # the run goes on
        led.begin_run("gen2")
        led(_event(0, "verify", energy=9.0))  # the same step in the next run is fine
        with pytest.raises(LedgerError, match="already written"):
            led.begin_run("gen1")
    records = read_ledger(path)
    assert led.run_ids == ["gen1", "gen2"] and len(records) == 2 + 3 + 1 + 2, "headers, phases, two end records"
    assert account(records, run_id="gen1").total_energy_j == 3.0, "the refused event was not written"
    assert account(records, run_id="gen2").total_energy_j == 9.0
    assert issubclass(RepeatedPhaseError, LedgerError)


def test_accounting_refuses_a_repeated_step_and_phase_in_the_records(tmp_path):
    path = tmp_path / "r.jsonl"
    for mode in ("w", "a"):  # two ledgers appending under one run id: each is consistent, together they are not
        with Ledger(path, run_id="same", mode=mode) as led:
            led(_event(0, "verify"))
    with pytest.raises(AccountingError, match="step 0 phase 'verify' twice"):
        account(read_ledger(path))


def test_read_ledger_from_an_offset_reads_what_one_ledger_wrote(tmp_path):
    path = write_run(tmp_path / "o.jsonl", run_id="earlier")
    with open(path, "a") as fh:
        fh.write('{"kind": "phase", "vers')  # a crash cut the last line short
    led = Ledger(path, run_id="later", mode="a")
    led(_event(0, "verify"))
    led.close()
    assert led.start_offset > 0
    later = read_ledger(path, offset=led.start_offset)
    assert not later.corrupt and [r["run_id"] for r in later] == ["later"] * 3  # header, phase, end
    assert len(read_ledger(path).corrupt) == 1, "the cut line stays reported in the whole file"


TINY = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True))


def test_ledger_round_trip_records_the_work_not_its_cost(tmp_path):
    shape = ForwardShape(args=TINY, rows=2, tokens_per_row=4, context_tokens=24, dtype_bytes=2)
    head = ForwardShape(args=dataclasses.replace(TINY, num_layers=1), rows=2, tokens_per_row=1, context_tokens=10,
                        dtype_bytes=2, lm_head_rows=32, extra_flops=7, query_tokens=2)
    event = PhaseEvent(step=3, phase="verify", batch=2, rows_active=2, verified=8, work=(shape, head, shape),
                       measurement=Measurement(0.01, 1.5, "measured:fake-counter"), emitted_per_row=(2, 1),
                       slot_requests=(4, 7), clock_s=2.0, k=3, row_lengths=(12, 12))
    with Ledger(tmp_path / "l.jsonl", run_id="r1", labels={"model": "tiny"}, meter_source="measured:fake-counter",
                idle_w=3.0) as led:
        led(event)
        led(dataclasses.replace(event, step=4))
    header, target, drafter, rec, rec2, end = read_ledger(tmp_path / "l.jsonl")
    assert end["kind"] == "end" and end["status"] == "complete" and header["version"] == LEDGER_VERSION
    assert header["kind"] == "run" and header["labels"] == {"model": "tiny"} and header["idle_w"] == 3.0
    assert set(rec) == set(SCHEMA) and set(target) == set(MODEL_SCHEMA)
    assert (target["model"], drafter["model"]) == (0, 1), "each architecture declared once, before its first use"
    assert [f["model"] for f in rec["work"]] == [0, 1, 0] and rec2["work"] == rec["work"]
    assert rec["work"][0] == {"model": 0, "rows": 2, "tokens_per_row": 4, "context_tokens": 24, "dtype_bytes": 2}
    assert "flops" not in rec and "bytes" not in rec, "the ledger records work; the model costs it"
    records = read_ledger(tmp_path / "l.jsonl")
    work = phase_work(rec, run_models(records, "r1"))
    assert work == (shape, head, shape)
    assert total_cost(work) == total_cost(event.work) and forward_cost(work[1]) == forward_cost(head)
    assert (rec["step"], rec["phase"], rec["verified"], rec["time_s"], rec["energy_j"]) == (3, "verify", 8, 0.01, 1.5)
    assert rec["emitted_per_row"] == [2, 1] and rec["run_id"] == "r1"
    assert (rec["k"], rec["row_lengths"], rec["slot_requests"]) == (3, [12, 12], [4, 7])
    assert experts_touched(rec) is None
    assert experts_touched({"work": [{"experts_touched": 3}, {}, {"experts_touched": 4}]}) == 7


def test_a_ledger_of_another_version_is_refused_whole(tmp_path):
    path = write_run(tmp_path / "old.jsonl")
    lines = path.read_text().splitlines()
    path.write_text("\n".join(ln.replace(f'"version": {LEDGER_VERSION}', '"version": 2') for ln in lines) + "\n")
    with pytest.raises(LedgerError, match=f"ledger format version 2; this refspec reads and appends only version "
                                          f"{LEDGER_VERSION}") as err:
        read_ledger(path)
    assert "line" not in str(err.value), "one message for the file, not one per line"
    with pytest.raises(LedgerError, match="version 2"):
        Ledger(path, run_id="more", mode="a")
    assert len(path.read_text().splitlines()) == len(lines), "nothing appended to the old file"


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
        fh.write(json.dumps({"kind": "phase", "version": LEDGER_VERSION, "run_id": "demo"}) + "\n")
        fh.write('{"kind": "phase", "version": 3, "step": 9, "pha')  # truncated by a crash
    with caplog.at_level(logging.WARNING, logger="refspec.energy.ledger"):
        records = read_ledger(path)
    assert len(records) == 12  # header + 10 phases + end survive
    assert [n for n, _ in records.corrupt] == [13, 14, 15]
    assert "missing fields" in records.corrupt[1][1]
    assert "line 13" in caplog.text and "line 15" in caplog.text
    assert account(records).total_energy_j == 252.0
    with pytest.raises(LedgerError, match="line 13"):
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
