"""Per-phase energy attributed from counter windows and loops, and the validity of windows, on
ledgers built by hand: a fake counter whose every read is exact, so every figure is known.

The run: batch 1, one request at a time, phases at known powers (W), host time between steps
at a known host power; the counter is read at the start, after every step (and its refill),
and at the end, as the windowed meter reads it.
"""
from __future__ import annotations

import json
import math

import pytest

from refspec.energy.accounting.headline import account
from refspec.energy.accounting.serving_window import Window, WindowRule, window_validity
from refspec.energy.accounting.text import format_accounting
from refspec.energy.ledger.format import LEDGER_VERSION
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.step_groups import AccountingError
from refspec.energy.phase_energy import phase_energy, sub_windows

POWER = {"prefill": 300.0, "draft": 100.0, "verify": 250.0, "commit": 50.0}
HOST_W = 40.0
STEPS = 8
REFILLS = (1, 4)  # the request finishes in these steps; the next is prefilled after them


def built(*, loops=(), truth=False, reads_after=None, idle_w=None, steady=False):
    """The hand-built run's records (header, phases, counter reads, loops, end) and its known figures."""
    recs = [{"kind": "run", "version": LEDGER_VERSION, "run_id": "r", "labels": {}, "idle_w": idle_w}]
    w = {"clock": 0.0, "wall": 0.0, "e": 0.0, "gap": 0.0}
    reads = []

    def read(reason):
        reads.append({"kind": "counter", "version": LEDGER_VERSION, "run_id": "r", "clock_s": w["clock"],
                      "wall_s": w["wall"], "energy_j": 1000.0 + w["e"], "source": "measured:fake", "reason": reason,
                      **({"energy_true_j": w["e"]} if truth else {})})
        recs.append(reads[-1])

    def phase(step, name, t, req, **kw):
        extra = {"energy_true_j": POWER[name] * t, "energy_naive_j": 0.0} if truth else {}
        emitted = kw.pop("emitted", 0)
        recs.append({"kind": "phase", "version": LEDGER_VERSION, "run_id": "r", "step": step, "phase": name,
                     "batch": 1, "rows_active": 1, "time_s": t, "energy_j": None, "source": "measured:fake",
                     "work": [], "slot_requests": [req], "clock_s": w["clock"], "queued": len(REFILLS) - req,
                     "emitted": emitted, "emitted_per_row": [emitted], **kw, **extra})
        w["clock"] += t
        w["wall"] += t
        w["e"] += POWER[name] * t

    read("start")
    phase(-1, "prefill", 1.0, 0, emitted=1, arrivals_s=[0.0])
    req = 0
    for i in range(STEPS):
        v = 0 if steady else i  # steady: every step drafts, verifies and commits for the same time
        phase(i, "draft", 0.5 + 0.1 * (v % 3), req, drafted=4)
        phase(i, "verify", 1.0 + 0.2 * (v % 4), req, verified=5)
        phase(i, "commit", 0.1 * (1 + v % 2), req, emitted=2, accepted=1)
        gap = 0.05 * (i % 5)
        w["wall"] += gap
        w["e"] += HOST_W * gap
        w["gap"] += gap
        if i in REFILLS:
            req += 1
            phase(i, "prefill", 0.6 + 0.1 * i, req, emitted=1, arrivals_s=[w["clock"]])
        if reads_after is None or i in reads_after or i == STEPS - 1:
            read("end" if i == STEPS - 1 else "sub")
    for phase_name, (energy, time, iterations, *rows) in loops:
        recs.append({"kind": "loop", "version": LEDGER_VERSION, "run_id": "r", "phase": phase_name,
                     "energy_j": energy, "time_s": time, "iterations": iterations, "source": "measured:fake",
                     "rows": rows[0] if rows else None})
    recs.append({"kind": "end", "version": LEDGER_VERSION, "run_id": "r", "status": "complete"})
    return recs, reads, w


def _read(tmp_path, records):
    path = tmp_path / "l.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_ledger(path, strict=True)


def phases_of(records):
    return [r for r in records if r["kind"] == "phase"]


def test_sub_windows_hold_the_counter_difference_and_each_phase_time(tmp_path):
    records, reads, w = built()
    windows = sub_windows(phases_of(records), reads)
    assert len(windows) == len(reads) - 1 == STEPS
    first = windows[0]  # the first fill and step 0: prefill 1 s, draft 0.5, verify 1.0, commit 0.1, no gap
    assert first.phase_time_s == pytest.approx({"prefill": 1.0, "draft": 0.5, "verify": 1.0, "commit": 0.1})
    assert first.energy_j == pytest.approx(300 + 50 + 250 + 5) and first.time_s == pytest.approx(2.6)
    second = windows[1]  # step 1 (draft 0.6, verify 1.2, commit 0.2), a 0.05 s gap, then the refill (0.7 s)
    assert second.phase_time_s == pytest.approx({"draft": 0.6, "verify": 1.2, "commit": 0.2, "prefill": 0.7})
    assert second.time_s == pytest.approx(0.6 + 1.2 + 0.2 + 0.05 + 0.7)
    assert sum(x.energy_j for x in windows) == pytest.approx(w["e"])


def test_the_fit_recovers_known_phase_powers_and_host_power(tmp_path):
    records, _, w = built()
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    assert acc.phase_energy_method == "attributed-fit"
    fit = acc.attribution["fit_power_w"]
    assert fit == pytest.approx({**POWER, "unattributed": HOST_W}, rel=1e-9)
    assert acc.attribution["fit_relative_residual"] == pytest.approx(0.0, abs=1e-9)
    phase_time = acc.phase_time_s
    assert acc.phase_energy_j == pytest.approx({p: POWER[p] * phase_time[p] for p in POWER}, rel=1e-9)
    # the measured total is the counter's; the host time's energy is the named unattributed item
    assert acc.total_energy_j == pytest.approx(w["e"]) and acc.attribution["measured_j"] == pytest.approx(w["e"])
    assert acc.unattributed_energy_j == pytest.approx(HOST_W * w["gap"])
    assert acc.line_items_j["unattributed"] == acc.unattributed_energy_j
    assert acc.closes and acc.line_items_sum_j == pytest.approx(acc.total_energy_j)
    assert acc.phase_share == pytest.approx({p: POWER[p] * phase_time[p] / (w["e"] - HOST_W * w["gap"])
                                             for p in POWER})
    assert acc.attribution["span_s"] == pytest.approx(w["wall"])
    text = format_accounting(acc)
    assert "phase energy: attributed-fit over 8 counter sub-windows" in text
    assert "closure (attributed-fit split)" in text and "unattributed" in text and "-> OK" in text


def test_with_an_idle_power_the_host_time_is_priced_at_it_not_fitted(tmp_path):
    records, _, w = built(idle_w=HOST_W)
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    assert acc.attribution["fit_power_w"] == pytest.approx({**POWER, "unattributed": HOST_W}, rel=1e-9)
    assert acc.unattributed_energy_j == pytest.approx(HOST_W * w["gap"]) and acc.closes
    # net of idle subtracts idle over the counter's span, host time included
    assert acc.net_energy_j == pytest.approx(w["e"] - HOST_W * w["wall"])
    # a wrong idle power moves the difference into the phases, never out of the total
    wrong = account(_read(tmp_path, built(idle_w=10.0)[0]), min_window_s=5.0)
    assert wrong.total_energy_j == pytest.approx(w["e"]) and wrong.closes
    assert wrong.unattributed_energy_j == pytest.approx(w["e"] - sum(wrong.phase_energy_j.values()))


def test_docs_quote_the_attributed_statement_as_printed(tmp_path):
    from pathlib import Path

    text = format_accounting(account(_read(tmp_path, built()[0]), min_window_s=5.0)).split("\n")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "accounting.md").read_text()
    quoted = [line for line in text if line.startswith(("phase energy:", "  fit:", "closure"))]
    assert len(quoted) == 3 and all(line in doc for line in quoted), "docs/accounting.md section 8"
    assert "3361 J over 16 tokens, 210.062 J/token" in doc and any("3361 J (counter, 8 reads)" in x for x in text)


def test_the_window_under_a_counter_is_what_the_counter_read_over_it(tmp_path):
    records, reads, w = built()
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    win = acc.window
    # every step is full (one slot, always busy): the steady state is steps 0..7; the first read
    # inside it follows step 0, so the counter's window is steps 1..7 and their refills
    assert win.bounds == ((1, STEPS),) and win.counter_reads == STEPS
    assert win.energy_j == pytest.approx(reads[-1]["energy_j"] - reads[1]["energy_j"])
    assert win.tokens == 2 * (STEPS - 1) + 2  # two tokens a step, one for each refill's first token
    assert acc.window_j_per_token == pytest.approx(win.energy_j / win.tokens)
    steps_time = sum(r["time_s"] for r in phases_of(records) if r["step"] >= 1)
    assert win.time_s == pytest.approx(steps_time)
    assert acc.window_valid and acc.window_invalid_reason is None


def test_few_counter_reads_leave_the_fit_undetermined_and_the_window_invalid(tmp_path):
    records, reads, w = built(reads_after=(3,))  # start, after step 3, end: two sub-windows for five powers
    acc = account(_read(tmp_path, records), min_window_s=1.0)
    assert acc.phase_energy_method == "measured-total-only" and acc.attribution["fit_power_w"] is None
    assert acc.total_energy_j == pytest.approx(w["e"]) and acc.unattributed_energy_j == pytest.approx(w["e"])
    assert acc.closes, "nothing attributed: the whole measured total is the unattributed item"
    one = [r for r in records if not (r["kind"] == "counter" and r["reason"] != "start")]
    with pytest.raises(AccountingError, match="at least its start and end counter reads"):
        account(_read(tmp_path, one))


def test_a_fit_over_a_steady_mix_is_undetermined_and_splits_nothing(tmp_path):
    records, _, w = built(steady=True, idle_w=HOST_W)  # draft, verify, commit in one ratio in every window
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    a = acc.attribution
    assert acc.phase_energy_method == "measured-total-only" and not a["fit_determined"]
    assert a["fit_condition"] > 1e3 and a["fit_share"] is not None, "the fit is reported, not used"
    assert acc.unattributed_energy_j == pytest.approx(w["e"]) and acc.closes
    assert "fit undetermined" in format_accounting(acc)
    # loops split it all the same: each phase alone, at its own power
    loops = [(p, (POWER[p] * t * 10, t * 10, 10)) for p, t in (("draft", 0.5), ("verify", 1.0), ("commit", 0.1))]
    acc = account(_read(tmp_path, built(steady=True, idle_w=HOST_W, loops=loops)[0]), min_window_s=5.0)
    assert acc.phase_energy_method == "attributed-loops"
    assert acc.phase_energy_j == pytest.approx({"prefill": 0.0, "draft": 50.0 * STEPS, "verify": 250.0 * STEPS,
                                                "commit": 5.0 * STEPS})
    assert acc.unattributed_energy_j == pytest.approx(w["e"] - sum(acc.phase_energy_j.values()))


def test_loops_price_their_phases_at_the_loops_power_and_report_agreement_and_additivity(tmp_path):
    # draft loop: 600 J in 6 s, 100 W, 60 J per call; verify loop: 3,300 J in 13 s (253.8 W, 5 W more
    # than the run's verify draws), 330 J per call
    records, _, w = built(loops=[("draft", (600.0, 6.0, 10)), ("verify", (3300.0, 13.0, 10))])
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    assert acc.phase_energy_method == "attributed-loops"
    a = acc.attribution
    assert a["loops_j_per_call"] == {"draft": 60.0, "verify": 330.0}
    phase_time = acc.phase_time_s
    loop_power = {"draft": 100.0, "verify": 3300.0 / 13.0}
    assert acc.phase_energy_j["draft"] == pytest.approx(100.0 * phase_time["draft"])
    assert acc.phase_energy_j["verify"] == pytest.approx(loop_power["verify"] * phase_time["verify"])
    assert acc.phase_energy_j["commit"] == pytest.approx(50.0 * phase_time["commit"]), "no loop: the fit's power"
    # prediction = loops' phases + the fit's phases without a loop + the fit's host energy
    predicted = sum(loop_power[p] * phase_time[p] for p in loop_power) + 300.0 * phase_time["prefill"] \
        + 50.0 * phase_time["commit"] + HOST_W * w["gap"]
    assert a["additivity_residual"] == pytest.approx((predicted - w["e"]) / w["e"], rel=1e-9)
    fit_energy = {p: POWER[p] * phase_time[p] for p in POWER}
    loop_energy = {**fit_energy, **{p: loop_power[p] * phase_time[p] for p in loop_power}}
    share = {p: e / sum(fit_energy.values()) for p, e in fit_energy.items()}
    share_loops = {p: e / sum(loop_energy.values()) for p, e in loop_energy.items()}
    assert a["fit_share"] == pytest.approx(share) and a["loops_share"] == pytest.approx(share_loops)
    assert a["agreement"] == pytest.approx(max(abs(share_loops[p] - share[p]) for p in POWER))
    assert acc.closes and acc.total_energy_j == pytest.approx(w["e"])
    assert "loops:" in format_accounting(acc) and "closure (attributed-loops split)" in format_accounting(acc)


def test_a_loop_that_took_no_time_leaves_its_phase_to_the_fit(tmp_path):
    # a run without a drafter loops its empty draft phase: no time, no energy, no power to read
    records, _, _ = built(loops=[("draft", (0.0, 0.0, 10)), ("verify", (3300.0, 13.0, 10))])
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    assert acc.phase_energy_method == "attributed-loops"
    assert acc.attribution["loops_j_per_call"] == {"verify": 330.0}
    assert acc.phase_energy_j["draft"] == pytest.approx(100.0 * acc.phase_time_s["draft"]), "the fit's power"


def test_a_slower_run_keeps_the_loops_power_and_a_varying_k_splits_the_fit(tmp_path):
    # a prefill loop of 4 rows per call, 10 calls, 4,000 J in 10 s: 400 W, whatever a refill's size
    records, _, w = built(loops=[("prefill", (4000.0, 10.0, 10, 4))])
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    assert acc.phase_energy_j["prefill"] == pytest.approx(400.0 * acc.phase_time_s["prefill"])
    with pytest.raises(AccountingError, match="mix calls priced per call and per row"):
        account(_read(tmp_path, built(loops=[("prefill", (1.0, 1.0, 1, 4)), ("prefill", (1.0, 1.0, 1))])[0]))
    # steps at two draft lengths: the fit gives each (phase, K) its own power
    for r in records:
        if r["kind"] == "phase" and r["step"] >= 0:
            r["k"] = 2 if r["step"] % 2 else 6
    phases = [r for r in records if r["kind"] == "phase"]
    columns = {c for win in sub_windows(phases, [r for r in records if r["kind"] == "counter"],
                                        lambda r: f"{r['phase']}@k{r.get('k')}") for c in win.phase_time_s}
    assert {"draft@k2", "draft@k6", "verify@k2", "verify@k6"} <= columns
    pe = phase_energy([(phases, [r for r in records if r["kind"] == "counter"], [])])
    assert pe.fit is None and pe.method == "measured-total-only", "8 sub-windows cannot fit 8 powers (commit too)"


def test_a_simulated_counter_s_truth_gives_the_true_shares(tmp_path):
    records, _, w = built(truth=True)
    acc = account(_read(tmp_path, records), min_window_s=5.0)
    true = {p: POWER[p] * acc.phase_time_s[p] for p in POWER}
    assert acc.phase_share_true == pytest.approx({p: e / sum(true.values()) for p, e in true.items()})
    assert acc.phase_share == pytest.approx(acc.phase_share_true, abs=1e-9), "an exact counter: the fit is the truth"
    assert acc.attribution["true_total_j"] == pytest.approx(w["e"])
    assert acc.attribution["total_error_vs_true"] == pytest.approx(0.0, abs=1e-12)
    assert acc.phase_share_naive == {p: pytest.approx(math.nan, nan_ok=True) for p in POWER}, "naive reads of 0 J"


def test_direct_reads_keep_their_method():
    def run(source, energy):
        return ([{"phase": "verify", "time_s": 1.0, "energy_j": energy, "source": source}], [], [])
    assert phase_energy([run("modelled:roofline(cpu)", 2.0)]).method == "modelled"
    direct = phase_energy([run("measured:fake-counter", 2.0)])
    assert (direct.method, direct.total_j, direct.unattributed_j) == ("measured-direct", 2.0, 0.0)
    assert phase_energy([run("none:time-only", None)]).method is None


# ---- validity ------------------------------------------------------------------------------------
def window(time_s=30.0, rows=8.0, reads=0, steps=10):
    return Window(bounds=((0, steps),), steps=steps, time_s=time_s, decode_time_s=time_s, energy_j=1.0, tokens=5.0,
                  mean_active_rows=rows, counter_reads=reads)


def test_validity_flags_short_and_underfilled_windows():
    m = dict(measured=True)  # the length rule is the counter's
    assert window_validity(window(), 8, **m) == (True, None)
    assert window_validity(window(time_s=19.9), 8, **m) == (False, "window 19.9 s < 20 s")
    assert window_validity(window(time_s=19.9), 8) == (True, None), "a modelled window's energy is exact at any length"
    assert window_validity(window(rows=6.7), 8) == (False, "mean active rows 6.7 < 0.85 x batch 8")
    ok, why = window_validity(window(time_s=5.0, rows=6.7), 8, **m)
    assert not ok and why == "window 5 s < 20 s; mean active rows 6.7 < 0.85 x batch 8"
    assert window_validity(window(rows=6.8), 8, **m) == (True, None), "0.85 x 8 = 6.8 is enough"
    assert window_validity(window(time_s=5.0, rows=4.0), 8, WindowRule(min_s=5.0, min_fill=0.5), **m) == (True, None)
    empty = Window(bounds=(None,), steps=0, time_s=math.nan, decode_time_s=math.nan, energy_j=math.nan,
                   tokens=math.nan, mean_active_rows=math.nan, note="never busy")
    assert window_validity(empty, 8) == (False, "empty window (never busy)")
    ok, why = window_validity(window(reads=1), 8, counter=True)
    assert not ok and "read fewer than twice" in why
    assert window_validity(window(reads=2), 8, counter=True) == (True, None)


def test_account_applies_the_validity_thresholds_it_is_given(tmp_path):
    records = _read(tmp_path, built()[0])
    short = account(records)  # the window (steps 1..7 and two refills) lasts 16.4 s
    assert not short.window_valid and short.window_invalid_reason == "window 16.4 s < 20 s"
    assert account(records, min_window_s=5.0).window_valid
    assert not account(records, min_window_s=5.0, min_window_fill=1.01).window_valid
    assert "window INVALID: window 16.4 s < 20 s" in format_accounting(short)


# ---- through the engine ----------------------------------------------------------------------------
def test_an_engine_run_under_the_simulated_counter_is_attributed_and_closes_on_the_counter(tmp_path):
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import TINY_HF

    from refspec.drafters.ngram import NgramDrafter
    from refspec.energy.ledger.counter_records import counter_ledger
    from refspec.energy.ledger.writer import Ledger
    from refspec.energy.meters.make import make_meter
    from refspec.engine import Engine, EngineConfig
    from refspec.models.random_models import random_model
    from refspec.serving import Request

    model = random_model(dict(TINY_HF["llama"]), dtype=torch.float32)
    # a modelled H200 clock (phases of tens of microseconds), a counter of 2 us periods sampling 0.5 us
    meter = make_meter("simulated:h200:period_ms=0.002:sample_ms=0.0005:sub_window_s=0.00002")
    requests = [Request(id=i, prompt=tuple(range(3 + i, 9 + 2 * i)), max_new_tokens=6 + 3 * (i % 3)) for i in range(6)]
    path = tmp_path / "ledger.jsonl"
    with counter_ledger(meter, Ledger(path, run_id="sim", meter_source=meter.source, idle_w=meter.idle_w)) as led:
        Engine(model, NgramDrafter(max_n=3, trim=False), config=EngineConfig(k=3), meter=meter,
               observers=[led]).serve(requests, batch=2)
    records = read_ledger(path, strict=True)
    counters = [r for r in records if r["kind"] == "counter"]
    acc = account(records, min_window_s=0.0)
    assert acc.phase_energy_method == "attributed-fit" and acc.attribution["sub_windows"] == len(counters) - 1
    assert acc.total_energy_j == pytest.approx(counters[-1]["energy_j"] - counters[0]["energy_j"])
    assert acc.closes and acc.line_items_sum_j == pytest.approx(acc.total_energy_j)
    assert set(acc.phase_share) == set(acc.phase_share_true) == set(acc.phase_share_naive)
    assert acc.attribution["true_total_j"] == pytest.approx(
        sum(r["energy_true_j"] for r in records if r["kind"] == "phase"))  # no host time on the modelled clock
    assert all(abs(acc.phase_share[p] - acc.phase_share_true[p]) < 0.05 for p in acc.phase_share), \
        (acc.phase_share, acc.phase_share_true)
