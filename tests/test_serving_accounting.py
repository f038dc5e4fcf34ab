"""The steady-state window and per-request latencies, on ledgers written by hand (not from a run).

Every expected figure below is worked out by hand from the records in the comments.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from refspec.energy.accounting.headline import account, pool_runs
from refspec.energy.accounting.text import format_accounting
from refspec.energy.ledger.format import LEDGER_VERSION, LedgerError
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.step_groups import AccountingError


def rec(step, phase, clock, time, energy, *, slots, queued=0, arrivals=(), emitted_per_row=(), run="r", batch=2,
        rows_active=None, **counts):
    """One phase record."""
    rows = rows_active if rows_active is not None else sum(s >= 0 for s in slots)
    return {"kind": "phase", "version": LEDGER_VERSION, "run_id": run, "step": step, "phase": phase, "batch": batch,
            "rows_active": rows, "time_s": time, "energy_j": energy, "source": "measured:hand", "work": [],
            "emitted_per_row": list(emitted_per_row), "slot_requests": list(slots), "arrivals_s": list(arrivals),
            "queued": queued, "clock_s": clock, "emitted": sum(emitted_per_row), **counts}


def decode_step(step, clock, slots, emitted_per_row, *, queued=0, energy=(2.0, 5.0, 1.0), run="r"):
    """draft 0.5 s, verify 1 s, commit 0.5 s starting at ``clock``; counts on the commit."""
    e_draft, e_verify, e_commit = energy
    n = sum(s >= 0 for s in slots)
    return [rec(step, "draft", clock, 0.5, e_draft, slots=slots, queued=queued, run=run, drafted=n),
            rec(step, "verify", clock + 0.5, 1.0, e_verify, slots=slots, queued=queued, run=run, verified=2 * n),
            rec(step, "commit", clock + 1.5, 0.5, e_commit, slots=slots, queued=queued, run=run,
                emitted_per_row=emitted_per_row, accepted=sum(emitted_per_row) - n)]


def header(run="r"):
    return {"kind": "run", "version": LEDGER_VERSION, "run_id": run, "labels": {}, "idle_w": None}


# Closed loop, batch 2, three requests. Request 0 (budget 3) and 1 (4) fill both slots at t = 0;
# request 0 finishes in step 0 and request 2 (4) is refilled into slot 0 after it; request 1
# finishes in step 1, and the stream is empty, so step 2 runs with slot 1 empty: the window is
# steps [0, 2) plus the refill after step 0.
CLOSED = [
    header(),
    rec(-1, "prefill", 0.0, 1.0, 10.0, slots=(0, 1), queued=1, arrivals=(0.0, 0.0), emitted_per_row=(1, 1)),
    *decode_step(0, 1.0, (0, 1), (2, 1), queued=1),
    rec(0, "prefill", 3.0, 0.5, 4.0, slots=(2, -1), arrivals=(3.0, -1.0), emitted_per_row=(1, 0)),
    *decode_step(1, 3.5, (2, 1), (1, 2)),
    *decode_step(2, 5.5, (2, -1), (2, 0), energy=(1.0, 3.0, 1.0)),
]


def _ledger(tmp_path, records, name="l.jsonl"):
    """``records`` written and read back, each run closed by a complete end record."""
    ends = [{"kind": "end", "version": LEDGER_VERSION, "run_id": r["run_id"], "status": "complete"}
            for r in records if r["kind"] == "run"]
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records + ends))
    return read_ledger(path, strict=True)


def test_window_bounds_energy_and_tokens(tmp_path):
    acc = account(_ledger(tmp_path, CLOSED))
    w = acc.window
    assert w.bounds == ((0, 2),) and (w.first_step, w.last_step) == (0, 1) and w.steps == 2
    assert w.time_s == 2.0 + 0.5 + 2.0                         # steps 0 and 1, and the refill after step 0
    assert w.energy_j == (2 + 5 + 1) + 4 + (2 + 5 + 1)
    assert w.tokens == 3 + 1 + 3                               # step 0, the refill's first token, step 1
    assert acc.window_j_per_token == 20.0 / 7
    assert w.mean_active_rows == 2.0 and w.note is None
    # the whole run: every record, the refill counted as prefill, never merged into step 0's counts
    assert acc.emitted == 2 + 3 + 1 + 3 + 2 and acc.total_energy_j == 35.0 and acc.j_per_token == 35.0 / 11
    assert acc.prefill_time_s == 1.5 and acc.steps == 3 and acc.phase_energy_j["prefill"] == 14.0
    assert acc.mean_active_rows == pytest.approx((2 * 2 + 2 * 2 + 1 * 2) / 6)
    assert acc.closes


def test_each_request_latency(tmp_path):
    acc = account(_ledger(tmp_path, CLOSED))
    r0, r1, r2 = acc.requests
    assert [r.id for r in acc.requests] == [0, 1, 2] and [r.slot for r in acc.requests] == [0, 1, 0]
    # request 0: first token at the prefill's end (1.0), two more at step 0's commit end (3.0)
    assert (r0.emissions_s, r0.emission_tokens) == ((1.0, 3.0), (1, 2))
    assert (r0.ttft_s, r0.tpot_s, r0.itl_s, r0.e2e_s) == (1.0, 1.0, (2.0,), 3.0)
    # request 1: 1.0, 3.0 (one token), 5.5 (two): TPOT over three tokens after the first
    assert (r1.emissions_s, r1.emission_tokens) == ((1.0, 3.0, 5.5), (1, 1, 2))
    assert (r1.ttft_s, r1.tpot_s, r1.itl_s, r1.e2e_s) == (1.0, 1.5, (2.0, 2.5), 5.5)
    # request 2: arrives (is admitted) at 3.0, first token at the refill's end 3.5, then 5.5 and 7.5
    assert (r2.arrival_s, r2.emissions_s, r2.emission_tokens) == (3.0, (3.5, 5.5, 7.5), (1, 1, 2))
    assert (r2.ttft_s, r2.tpot_s, r2.itl_s, r2.e2e_s) == (0.5, 4.0 / 3, (2.0, 2.0), 4.5)
    tpots = [1.0, 1.5, 4.0 / 3]
    assert acc.tpot_per_row_s == tuple(tpots) and acc.rows_with_tpot == 3
    assert acc.tpot_p50_s == pytest.approx(np.percentile(tpots, 50))
    assert acc.tpot_p99_s == pytest.approx(np.percentile(tpots, 99))
    assert acc.ttft_p50_s == 1.0 and acc.ttft_p99_s == pytest.approx(np.percentile([1.0, 1.0, 0.5], 99))
    assert acc.itl_p50_s == 2.0 and acc.itl_p99_s == pytest.approx(np.percentile([2.0, 2.0, 2.5, 2.0, 2.0], 99))
    assert acc.e2e_p50_s == 4.5


def test_open_loop_queue_keeps_the_window_open_and_an_empty_window_is_nan(tmp_path):
    # open loop: request 2 has not arrived when slot 0 frees after step 0 (queued 1): step 1 runs
    # with an empty slot, which does not end the window; it ends at step 3, once the stream is empty
    records = [
        header(),
        rec(-1, "prefill", 0.0, 1.0, 10.0, slots=(0, 1), queued=1, arrivals=(0.0, 0.5), emitted_per_row=(1, 1)),
        *decode_step(0, 1.0, (0, 1), (1, 1), queued=1),
        *decode_step(1, 3.0, (-1, 1), (0, 1), queued=1),
        rec(1, "prefill", 5.0, 0.5, 4.0, slots=(2, -1), arrivals=(4.0, -1.0), emitted_per_row=(1, 0)),
        *decode_step(2, 5.5, (2, 1), (1, 1)),
        *decode_step(3, 7.5, (2, -1), (1, 0)),
    ]
    acc = account(_ledger(tmp_path, records))
    assert acc.window.bounds == ((0, 3),)
    assert acc.window.mean_active_rows == pytest.approx((2 + 1 + 2) / 3)
    assert acc.window.tokens == 2 + 1 + 1 + 2
    assert acc.requests[2].ttft_s == 5.5 - 4.0 and acc.requests[1].ttft_s == 1.0 - 0.5  # queueing included
    # one slot busy at a time: never every slot busy, so no steady state
    lonely = [header(),
              rec(-1, "prefill", 0.0, 1.0, 10.0, slots=(0, -1), queued=0, arrivals=(0.0, -1.0),
                  emitted_per_row=(1, 0)),
              *decode_step(0, 1.0, (0, -1), (2, 0))]
    acc = account(_ledger(tmp_path, lonely, "lonely.jsonl"))
    w = acc.window
    assert w.empty and w.bounds == (None,) and w.first_step is None
    assert all(math.isnan(x) for x in (w.time_s, w.energy_j, w.tokens, w.mean_active_rows, acc.window_j_per_token))
    assert "no decode step had every slot busy" in w.note
    assert acc.j_per_token == 18.0 / 3 and acc.requests[0].tpot_s == 1.0  # the run's figures stand
    assert "window: empty" in format_accounting(acc)


def test_static_runs_pool_their_windows(tmp_path):
    # two lockstep batches (no refill, queued 0): each window ends at its first step with a done row
    def batch(run, ids):
        return [header(run),
                rec(-1, "prefill", 0.0, 1.0, 10.0, slots=ids, arrivals=(0.0, 0.0), emitted_per_row=(1, 1), run=run),
                *decode_step(0, 1.0, ids, (1, 1), run=run),
                *decode_step(1, 3.0, (ids[0], -1), (1, 0), run=run)]
    acc = pool_runs(_ledger(tmp_path, batch("a", (0, 1)) + batch("b", (2, 3))), ["a", "b"])
    w = acc.window
    assert w.bounds == ((0, 1), (0, 1)) and w.first_step is None and w.steps == 2
    assert (w.time_s, w.energy_j, w.tokens, w.mean_active_rows) == (4.0, 16.0, 4, 2.0)
    assert [r.id for r in acc.requests] == [0, 1, 2, 3] and acc.requests[3].tpot_s == 3.0 - 1.0
    assert acc.mean_active_rows == pytest.approx(1.5)


def test_a_ledger_of_an_older_version_is_refused_not_read_as_static(tmp_path):
    old = [{k: v for k, v in r.items() if k not in ("slot_requests", "arrivals_s", "queued", "clock_s", "work")}
           | {"version": 1} for r in CLOSED[:5]]
    with pytest.raises(LedgerError, match="version 1; this refspec reads and appends only version"):
        _ledger(tmp_path, old)


def test_inconsistent_serving_ledger_is_refused(tmp_path):
    bad = CLOSED[:2] + decode_step(0, 1.0, (0, 5), (1, 1))  # slot 1 emits for a request never prefilled
    with pytest.raises(AccountingError, match="request 5 in slot 1"):
        account(_ledger(tmp_path, bad))
    twice = CLOSED[:5] + [rec(0, "prefill", 3.0, 0.5, 4.0, slots=(1, -1), arrivals=(3.0, -1.0),
                              emitted_per_row=(1, 0))]
    with pytest.raises(AccountingError, match="prefilled twice"):
        account(_ledger(tmp_path, twice, "twice.jsonl"))


def test_two_refills_after_one_step_are_two_prefill_groups(tmp_path):
    # request 2 (budget 1) is refilled after step 0 and finishes at its first token, so request 3
    # is refilled into the same slot after the same step: two prefill records at step 0
    records = [
        header(),
        rec(-1, "prefill", 0.0, 1.0, 10.0, slots=(0, 1), queued=2, arrivals=(0.0, 0.0), emitted_per_row=(1, 1)),
        *decode_step(0, 1.0, (0, 1), (1, 1), queued=2),
        rec(0, "prefill", 3.0, 0.5, 4.0, slots=(2, -1), queued=1, arrivals=(3.0, -1.0), emitted_per_row=(1, 0)),
        rec(0, "prefill", 3.5, 0.5, 4.0, slots=(3, -1), queued=0, arrivals=(3.5, -1.0), emitted_per_row=(1, 0)),
        *decode_step(1, 4.0, (3, 1), (1, 1)),
    ]
    acc = account(_ledger(tmp_path, records))
    assert acc.emitted == 2 + 2 + 1 + 1 + 2 and acc.prefill_time_s == 2.0 and acc.steps == 2
    assert [(r.id, r.emissions_s) for r in acc.requests] == [(0, (1.0, 3.0)), (1, (1.0, 3.0, 6.0)), (2, (3.5,)),
                                                             (3, (4.0, 6.0))]
    assert acc.requests[2].tpot_s is None and acc.requests[2].ttft_s == 0.5
    assert acc.window.bounds == ((0, 2),) and acc.window.tokens == 2 + 1 + 1 + 2
    with pytest.raises(AccountingError, match="twice"):
        account(_ledger(tmp_path, records + [records[4]], "dup.jsonl"))
