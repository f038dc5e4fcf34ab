"""The report under serving conditions: latency-target selection, the per-request greedy audit, the window fields."""
from __future__ import annotations

import json
import math

import pytest
import torch

from refspec.energy.accounting.headline import energy_saving
from refspec.energy.accounting.latency import Targets, choose, misses, premium
from eval_records import record, with_fields
from refspec.eval import audit
from refspec.eval.audit import Divergence, compare, first_divergence, margin_of, ulp
from refspec.eval.baseline import attach_baselines, audit_fields, with_baseline
from refspec.eval.record import RequestOutput
from refspec.eval.report import format_table, write_report
from refspec.eval.report_serving import greedy_text, target_choices, targets_md, window_cell


def _rec(corpus, drafter, k, batch, *, jw, jr=None, tpot, ttft=None, old=False, **extra):
    """A hand-built record; ``old``: a static record from before serving windows (version 2: run J/token only)."""
    r = dict(record_version=4, status="ok", config_id=f"{drafter}-k{k}-b{batch}-{corpus}", drafter=drafter, k=k,
             batch=batch, corpus=corpus, model="tiny", dtype="fp32", device="cpu", greedy=True, tau=1.5,
             run_tokens_per_s=100.0, tpot_p50_s=tpot / 2, tpot_p99_s=tpot, energy_source="modelled:roofline(cpu)",
             energy_source_text="modelled (not measured) by roofline profile cpu", energy_measured=False,
             baseline_config_id=f"none-k0-b{batch}-{corpus}", max_new_tokens=8)
    if old:
        r.update(record_version=2, energy_per_token_j=jr, prompts_unique=16, rows=batch, tokens_per_s=100.0)
        del r["run_tokens_per_s"]
    else:
        r.update(window_j_per_token=jw, run_j_per_token=jr if jr is not None else 1.2 * jw, schedule="continuous",
                 requests=4 * batch, requests_unique=4 * batch, run_mean_active_rows=0.9 * batch,
                 ttft_p50_s=ttft / 2, ttft_p99_s=ttft, window_time_s=1.0, window_tokens=100, window_first_step=2,
                 window_last_step=11, window_steps=10, window_mean_active_rows=batch, window_tokens_per_s=100.0,
                 window_note=None)
    return record(**{**r, **extra})


SWEEP = [
    _rec("code", "none", 0, 64, jw=0.10, tpot=0.030, ttft=2.0),
    _rec("code", "none", 0, 16, jw=0.16, tpot=0.018, ttft=0.6),
    _rec("code", "eagle", 3, 16, jw=0.14, tpot=0.012, ttft=0.9),
    _rec("code", "eagle", 3, 4, jw=0.30, tpot=0.008, ttft=0.2),
    _rec("chat", "none", 0, 64, jw=0.11, tpot=0.035, ttft=2.5),
    _rec("chat", "ngram", 4, 16, jw=0.13, tpot=0.020, ttft=0.7),
]


# ---- selection under targets --------------------------------------------------------------------
def test_each_corpus_gets_its_lowest_window_j_per_token_meeting_every_target():
    loose = target_choices(SWEEP, Targets(0.05, None))
    assert loose["code"].chosen.batch == 64 and loose["chat"].chosen.batch == 64
    tpot = target_choices(SWEEP, Targets(0.015, None))
    assert (tpot["code"].chosen.drafter, tpot["code"].chosen.batch) == ("eagle", 16)
    assert tpot["chat"].chosen is None, "no chat configuration reaches 15 ms"
    both = target_choices(SWEEP, Targets(0.015, 0.5))  # the TTFT target rules out eagle b16 (0.9 s)
    assert (both["code"].chosen.drafter, both["code"].chosen.batch) == ("eagle", 4)
    only_ttft = target_choices(SWEEP, Targets(None, 0.8))
    assert (only_ttft["code"].chosen.drafter, only_ttft["code"].chosen.batch) == ("none", 16)
    assert only_ttft["chat"].chosen.drafter == "ngram" and only_ttft["code"].tighter is None


def test_an_invalid_window_is_marked_in_the_table_and_never_chosen():
    bad = dict(window_valid=False, window_invalid_reason="window 4 s < 20 s")
    sweep = [_rec("code", "none", 0, 64, jw=0.10, tpot=0.030, ttft=2.0, **bad),
             _rec("code", "none", 0, 16, jw=0.16, tpot=0.018, ttft=0.6, window_valid=True)]
    assert target_choices(sweep, Targets(0.05, None))["code"].chosen.batch == 16, "the cheaper one is not valid"
    assert window_cell(sweep[0]) == "0.1*" and window_cell(sweep[1]) == "0.16"
    table = format_table(sweep)
    assert "* none b64: window invalid (window 4 s < 20 s)" in table and "never ranked" in table


def test_the_others_show_by_how_much_they_miss_each_target():
    t = Targets(0.015, 0.5)
    rows = {r.config_id: m for r, m in target_choices(SWEEP, t)["code"].rows}
    assert rows["none-k0-b64-code"]["tpot_p99_s"] == pytest.approx(0.015)
    assert rows["none-k0-b64-code"]["ttft_p99_s"] == pytest.approx(1.5)
    assert rows["eagle-k3-b16-code"] == {"tpot_p99_s": 0.0, "ttft_p99_s": pytest.approx(0.4)}
    assert rows["eagle-k3-b4-code"] == {"tpot_p99_s": 0.0, "ttft_p99_s": 0.0}
    assert misses({"tpot_p99_s": float("nan")}, Targets(0.01)) == {"tpot_p99_s": None}, "NaN is no figure"


def test_an_empty_window_or_an_old_record_is_judged_as_such():
    empty = _rec("code", "ngram", 2, 64, jw=float("nan"), jr=0.05, tpot=0.01, ttft=0.1)  # cheapest run, no window
    old = _rec("code", "ngram", 4, 8, jw=None, jr=0.09, tpot=0.01, old=True)
    c = target_choices([*SWEEP, empty, old], Targets(0.05))["code"]
    assert c.chosen is old, "an old record competes with its run J/token; an empty window never wins"
    c = target_choices([*SWEEP, empty, old], Targets(0.05, 1.0))["code"]
    assert c.chosen.config_id == "eagle-k3-b16-code", "b64 misses TTFT 1 s; the old record has no TTFT"
    assert [(r.config_id, absent) for r, absent in c.no_figure] == [(old.config_id, ["ttft_p99_s"])]
    never_full = _rec("code", "ngram", 8, 64, jw=None, jr=0.01, tpot=0.001, ttft=0.01,
                      window_note="no decode step had every slot busy", window_first_step=None)
    c = target_choices([*SWEEP, never_full], Targets(0.05))["code"]
    assert c.chosen.config_id == "none-k0-b64-code" and c.no_figure[0][0] is never_full
    md = "\n".join(targets_md(SWEEP + [never_full], Targets(0.05), {"code": c}, lambda r: r.config_id))
    assert "ngram-k8-b64-code: not judged, it has no J/token (empty window: no decode step had" in md
    assert window_cell(never_full) == "empty"


@pytest.mark.parametrize("bad", [-0.5, 0.0, float("nan"), float("inf")])
def test_a_target_must_be_a_positive_finite_number_of_seconds(bad):
    with pytest.raises(ValueError, match="latency target"):
        Targets(bad, None)
    with pytest.raises(ValueError, match="ttft"):
        Targets(None, bad)


def test_premiums_are_the_accountings_saving_turned_round():
    for a, b in ((0.14, 0.16), (0.3, 0.1), (0.2, 0.2)):
        assert premium(a, b) == pytest.approx(-energy_saving(a, b))
    assert premium(0.2, 0.2) == 0.0 and math.copysign(1.0, premium(0.2, 0.2)) == 1.0, "never -0.0%"
    assert choose([], Targets(1.0)) is None


# ---- the audit: comparisons and the bound ------------------------------------------------------
def test_first_divergence_and_request_comparison():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    mine = [RequestOutput(id=0, prompt=[4], tokens=[1, 2]), RequestOutput(id=1, prompt=[5], tokens=[1, 3]),
            RequestOutput(id=2, prompt=[6], tokens=[1]), RequestOutput(id=3, prompt=[9], tokens=[7])]
    base = [RequestOutput(id=0, prompt=[4], tokens=[1, 2]), RequestOutput(id=1, prompt=[5], tokens=[1, 2]),
            RequestOutput(id=3, prompt=[8], tokens=[7]), RequestOutput(id=4, prompt=[3], tokens=[7])]
    c = compare(mine, base)
    assert (c.compared, c.matching, c.not_comparable) == (2, 1, (2, 3, 4))
    assert c.divergent == (Divergence(id=1, position=1, prompt=(5,), prefix=(1,), baseline_token=2, token=3),)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 23), (torch.bfloat16, 7), (torch.float16, 10)])
def test_the_bound_is_the_dtypes_rounding_or_the_fp32_accumulation_floor(dtype, bits):
    assert ulp(20.0, dtype) == 2.0 ** (4 - bits) and ulp(-0.7, dtype) == 2.0 ** (-1 - bits)
    top = 20.0
    bound = max(audit.NEAR_TIE_ULPS * ulp(top, dtype), audit.FP32_FLOOR_ULPS * ulp(top, torch.float32))
    assert audit.near_tie_bound(top, dtype) == bound
    assert bound == (audit.FP32_FLOOR_ULPS * 2.0 ** (4 - 23) if bits == 23 else audit.NEAR_TIE_ULPS * 2.0 ** (4 - bits))
    for fraction, near in ((0.0, True), (0.75, True), (1.0, True), (1.25, False), (10.0, False)):
        logits = torch.tensor([0.0, top, top - fraction * bound, -5.0], dtype=torch.float64)
        m = margin_of(logits, 1, 2, dtype)
        assert m.near_tie is near, f"a gap of {fraction} bounds in {dtype}"
        assert m.top2_margin == pytest.approx(fraction * bound) and m.bound == bound
    m = margin_of(torch.tensor([top, top - bound / 2, 0.0], dtype=torch.float64), 0, 2, dtype)
    assert not m.near_tie and m.top2_margin == pytest.approx(bound / 2), "small top-2 margin, token far down"
    with pytest.raises(ValueError, match="int8"):
        ulp(1.0, "int8")


def test_shape_noise_of_a_tiny_model_stays_under_the_bound():
    from refspec.eval.audit_noise import measure

    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randint(3, 90, (4, 24), generator=torch.Generator().manual_seed(1))
        for shape, s in measure(_tiny(dtype), rows).items():
            assert s["positions"] > 0 and s["max_ulp"] < s["bound_ulp_min"], (dtype, shape, s)


# ---- the audit on a tiny random model --------------------------------------------------------
def _tiny(dtype=torch.float32):
    from tiny import TINY_HF

    from refspec.models.random_models import random_model

    return random_model({**TINY_HF["llama"], "tie_word_embeddings": False}, dtype=dtype, std=0.2, seed=3)


def _greedy(model, prompt, n):
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(audit.last_logits(model, [*prompt, *out]))))
    return out


def _tied(model, prompt, n):
    """``model`` with LM-head rows a and b made equal, and the first greedy position where a (or b) is emitted."""
    ref = _greedy(model, prompt, n)
    a = ref[2]
    b = next(t for t in range(model.args.vocab_size) if t != a and t not in ref)
    with torch.no_grad():
        model.lm_head.weight[b].copy_(model.lm_head.weight[a])  # logits of a and b equal at every position
    base = _greedy(model, prompt, n)
    p = next(i for i, t in enumerate(base) if t in (a, b))
    return base, p, ({a, b} - {base[p]}).pop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flip_at_a_tie_is_a_near_tie_and_a_corrupted_token_a_defect(dtype):
    model = _tiny(dtype)
    prompts = {0: [5, 9, 13, 7], 1: [3, 30, 41], 2: [11, 12]}
    base, p, other = _tied(model, prompts[0], 8)
    flipped = [*base[:p], other, *_greedy(model, [*prompts[0], *base[:p], other], 8 - p - 1)]
    good = _greedy(model, prompts[1], 6)
    plain2 = _greedy(model, prompts[2], 6)
    logits = audit.last_logits(model, [*prompts[2], *plain2[:3]])
    worst = int(torch.argmin(logits))
    corrupted = [*plain2[:3], worst, *plain2[4:]]
    rec_out = [{"id": 0, "prompt": prompts[0], "tokens": flipped}, {"id": 1, "prompt": prompts[1], "tokens": good},
               {"id": 2, "prompt": prompts[2], "tokens": corrupted}]
    base_out = [{"id": 0, "prompt": prompts[0], "tokens": base}, {"id": 1, "prompt": prompts[1], "tokens": good},
                {"id": 2, "prompt": prompts[2], "tokens": plain2}]
    f = audit_fields(record(drafter="ngram", k=2, request_outputs=rec_out),
                     record(config_id="none", output_digest="d", request_outputs=base_out), audit.margin_fn(model))
    assert (f["greedy_requests_compared"], f["greedy_requests_matching"]) == (3, 1)
    assert (f["greedy_requests_near_tie"], f["greedy_requests_defect"]) == (1, 1)
    (tie,), (defect,) = f["greedy_near_ties"], f["greedy_defects"]
    assert (tie["id"], tie["position"], tie["gap"], tie["top2_margin"]) == (0, p, 0.0, 0.0)
    assert (defect["id"], defect["position"], defect["token"]) == (2, 3, worst)
    assert defect["gap"] > defect["bound"] and "bound" in defect["reason"]
    assert audit.dtype_name(dtype) in f["greedy_near_tie_bound"]


def test_the_run_classifies_and_the_report_keeps_it_against_the_same_baseline_only():
    model = _tiny()
    prompt = [5, 9, 13, 7]
    base, p, other = _tied(model, prompt, 6)
    spec = record(drafter="ngram", k=2, greedy=True, output_digest="x", row_digests=["x"],
                  request_outputs=[{"id": 0, "prompt": prompt, "tokens": [*base[:p], other]}])
    baseline = record(config_id="none-b1", drafter="none", greedy=True, output_digest="y", row_digests=["y"],
                      request_outputs=[{"id": 0, "prompt": prompt, "tokens": base[:p + 1]}])
    spec = with_baseline(spec, baseline, margin_fn=audit.margin_fn(model))
    assert (spec.comparison.greedy_requests_near_tie, spec.comparison.greedy_requests_unclassified) == (1, 0)
    spec = with_baseline(spec, baseline)  # the report's pass: no model, same baseline
    assert spec.comparison.greedy_requests_near_tie == 1 and spec.comparison.greedy_near_ties[0]["position"] == p
    assert greedy_text(spec) == "0/1 req equal, 1 near-tie"
    spec = with_baseline(spec, with_fields(baseline, output_digest="z"))  # another baseline run: counted only
    assert spec.comparison.greedy_requests_near_tie is None and spec.comparison.greedy_requests_unclassified == 1
    assert greedy_text(spec) == "0/1 req equal, 1 unclassified"
    no_prompt = with_fields(spec, request_outputs=[{"id": 0, "tokens": [*base[:p], other]}])
    no_prompt = with_baseline(no_prompt, with_fields(baseline, request_outputs=[{"id": 0, "tokens": base[:p + 1]}]),
                              margin_fn=audit.margin_fn(model))
    c = no_prompt.comparison
    assert (c.greedy_requests_unclassified, c.greedy_requests_defect) == (1, 0), "no margin"
    sampled = with_baseline(with_fields(spec, greedy=False), baseline)
    assert sampled.comparison.greedy_requests_compared is None, "sampled outputs are not compared token for token"


# ---- the report renders it -------------------------------------------------------------------
def _audited(r, **fields):
    return with_fields(r, greedy_requests_compared=64, greedy_requests_not_comparable=0,
                       greedy_near_tie_bound="4 ulp of the top logit's magnitude in bf16", **fields)


def test_report_shows_window_and_run_side_by_side_the_audit_counts_and_lists_defects(tmp_path):
    defect = {"id": 17, "position": 5, "baseline_token": 40, "token": 3, "top2_margin": 0.25, "gap": 9.5,
              "bound": 0.5, "dtype": "bf16", "reason": "gap 9.5 > bound 0.5"}
    recs = [_audited(SWEEP[2], greedy_requests_matching=61, greedy_requests_near_tie=2, greedy_requests_defect=1,
                     greedy_requests_unclassified=0, greedy_defects=[defect],
                     greedy_near_ties=[{**defect, "id": 3, "token": 41, "gap": 0.125, "top2_margin": 0.125}]),
            SWEEP[1], _rec("code", "ngram", 4, 8, jw=None, jr=0.09, tpot=0.01, old=True,
                           greedy_match_baseline=False, greedy_rows_matching=6)]
    rep = write_report(tmp_path, recs, latency_target_s=0.02, ttft_target_s=0.8)
    md = rep.markdown.read_text()
    assert "| J/token window | J/token run |" in md.replace("mean active rows | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
                                                           "| ", "")
    assert "| 0.14 | 0.168 |" in md, "window 0.14 beside run 0.168 for eagle k3 b16"
    assert "61/64 req equal, 2 near-tie, 1 DEFECT" in md
    assert "DEFECT request 17 at token 5: baseline 40, this run 3" in md and "gap 9.5 > bound 0.5" in md
    assert "near-tie request 3 at token 5: baseline 40, this run 41; top-2 margin 0.125, gap 0.125 <= bound 0.5" in md
    assert "no: 2/8 rows differ, unclassified" in md and "without per-request outputs" in md
    assert "| absent | 0.09 |" in md and "window fields" in md
    assert "**code**: none b16, 0.16 J/token (window)" in md, "TTFT 0.8 s rules out the cheaper eagle b16"
    assert "| eagle k3 b16 | 0.14 | 0.168 | 14.4 | 900.0 | 12.0 | meets | +100 ms (+12%) | -12.5% |" in md
    assert "ngram k4 b8: not judged, it has no ttft_p99_s" in md
    assert "window_vs_run.png" in [p.name for p in rep.plots]
    assert "| eagle k3 b16 | 2..11 (10) | 1 | 100 | 16.0 / 14.4 | 100 |  |" in md, "the window's bounds and tokens"
    table = format_table(recs)
    assert "J/tok window" in table and "absent" in table and "61/64 req equal, 2 near-tie, 1 DEFECT" in table


def test_report_of_old_records_only_says_the_window_fields_are_absent(tmp_path):
    old = [_rec("code", "none", 0, 8, jw=None, jr=0.2, tpot=0.02, old=True),
           _rec("code", "ngram", 4, 8, jw=None, jr=0.15, tpot=0.01, old=True, greedy_match_baseline=True)]
    rep = write_report(tmp_path, old, latency_target_s=0.05)
    md = rep.markdown.read_text()
    assert "lack the serving window fields" in md and "**code**: ngram k4 b8, absent J/token (window)" in md
    assert "window_vs_run.png" not in [p.name for p in rep.plots], "nothing to draw: no record has a window"
    assert "yes (rows)" in format_table(old)


def test_a_static_rows_window_figures_are_na_with_a_footnote_and_its_run_j_per_token_stays(tmp_path):
    static = _rec("code", "none", 0, 8, jw=0.05, jr=0.21, tpot=0.02, ttft=0.4, schedule="static")
    recs = [static, SWEEP[1]]
    assert window_cell(static) == "n/a" and window_cell(SWEEP[1]) == "0.16"
    md = write_report(tmp_path, recs, latency_target_s=0.05).markdown.read_text()
    assert "| none b8 | 1.500 | 100.00 | 7.2 | n/a | n/a | 200.0 | 400.0 | 10.0 | 20.0 | n/a | 0.21 |" in md
    assert "| none b8 | n/a | n/a | n/a | n/a / 7.2 | n/a | static schedule: no steady state |" in md
    assert not [line for line in md.splitlines() if "none b8" in line and "0.05" in line], "pooled J/token shown"
    assert md.count("n/a window (static schedule): lockstep batches never refill") == 2  # results, targets
    assert "**code**: none b16, 0.16 J/token (window)" in md, "ranked by its run's 0.21, not its pooled 0.05"
    assert "| none b8 | n/a | 0.21 |" in md and "+31.2%" in md, "the target table keeps the run J/token"
    table = format_table(recs)
    assert "note: n/a window (static schedule)" in table and "0.05" not in table and "0.21" in table
    assert "n/a window" not in format_table([SWEEP[1]]), "no footnote without a static row"


def test_a_static_row_is_ranked_under_targets_by_its_run_j_per_token():
    cont = _rec("code", "none", 0, 16, jw=0.16, jr=0.19, tpot=0.018, ttft=0.6)
    pooled_low = _rec("code", "none", 0, 8, jw=0.05, jr=0.21, tpot=0.02, ttft=0.4, schedule="static")
    run_low = _rec("code", "ngram", 4, 8, jw=0.30, jr=0.12, tpot=0.02, ttft=0.4, schedule="static")
    assert target_choices([cont, pooled_low], Targets(0.05, None))["code"].chosen is cont
    choice = target_choices([cont, pooled_low, run_low], Targets(0.05, None))["code"]
    assert choice.chosen is run_low, "the record itself, its own figures untouched"
    assert run_low.window.j_per_token == 0.30
    assert [row["energy_per_token_j"] for row in choice.tighter if row["feasible"]][0] == 0.12


# ---- the command line -------------------------------------------------------------------------
def _dir(tmp_path, recs):
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "records.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
    return d


def test_report_command_prints_the_choice_and_notes_a_corpus_without_one(tmp_path, capsys):
    from refspec.eval import cli

    d = _dir(tmp_path, SWEEP)
    assert cli.main(["report", str(d), "--latency-target", "0.015", "--ttft-target", "1.0"]) == 0
    out, err = capsys.readouterr()
    assert "code: eagle k3 b16, 0.14 J/token" in out and "chat: no configuration meets the targets" in out
    assert "note: no configuration meets p99 TPOT <= 15 ms, p99 TTFT <= 1000 ms on chat" in err
    assert (d / "report.md").is_file() and "TTFT miss" in (d / "report.md").read_text()


def test_a_ttft_target_over_records_without_ttft_is_one_error_and_rewrites_nothing(tmp_path, capsys):
    from refspec.eval import cli

    d = _dir(tmp_path, [_rec("code", "none", 0, 8, jw=None, jr=0.2, tpot=0.02, old=True)])
    assert cli.main(["report", str(d), "--ttft-target", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--ttft-target" in err and "absent" in err
    assert sorted(p.name for p in d.iterdir()) == ["records.jsonl"]


def test_active_rows_come_from_the_ledger_steps_and_the_plot_is_drawn(tmp_path):
    from refspec.eval.plots import active_rows_by_step, plot_active_rows

    ledger = tmp_path / "ledger.jsonl"
    rows = [4, 4, 4, 3, 1]
    lines = [{"kind": "phase", "run_id": "r", "step": -1, "phase": "prefill", "rows_active": 4}]
    for step, n in enumerate(rows):
        lines += [{"kind": "phase", "run_id": "r", "step": step, "phase": "verify", "rows_active": n},
                  {"kind": "phase", "run_id": "r", "step": step, "phase": "prefill", "rows_active": 1},
                  {"kind": "phase", "run_id": "other", "step": step, "phase": "verify", "rows_active": 2}]
    from refspec.energy.ledger.format import LEDGER_VERSION

    common = {"version": LEDGER_VERSION, "batch": 4, "time_s": 0.1, "energy_j": 0.1, "source": "modelled:roofline(cpu)",
              "work": [], "slot_requests": [], "clock_s": 0.0}
    ledger.write_text("".join(json.dumps({**common, **x}) + "\n" for x in lines))
    assert active_rows_by_step([ledger], {"r"}) == {"r": list(enumerate(rows))}, "refill prefills are not decode"
    rec = with_fields(SWEEP[1], run_ids=["r"], window_first_step=0, window_last_step=2)
    assert plot_active_rows([rec], [ledger], tmp_path / "a.png") == tmp_path / "a.png"
    assert plot_active_rows([with_fields(rec, window_first_step=None)], [ledger], tmp_path / "b.png") is None


def test_a_static_schedule_is_a_series_of_its_own_in_plots():
    from refspec.eval.plots import series_by_batch

    recs = [record(drafter=d, k=k, batch=b, corpus="c", schedule=sch)
            for sch in ("continuous", "static") for d, k in (("none", 0), ("ngram", 4)) for b in (8, 64)]
    series = dict(series_by_batch(recs, "c"))
    assert len(series) == 4, sorted(series)
    for rows in series.values():
        assert [r.batch for r in rows] == [8, 64] and len({r.stream.schedule for r in rows}) == 1
    old = record(drafter="ngram", k=4, batch=8, corpus="c")  # records before schedules existed
    assert dict(series_by_batch([old], "c")).keys() == {"ngram k=4"}


def test_window_vs_run_plot_draws_no_window_line_for_a_static_series(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from refspec.eval.plots import plot_window_vs_run

    drawn = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: drawn.append((kw.get("label"), list(a[1]))) or real(self, *a, **kw))
    recs = [_rec("code", "none", 0, 8, jw=0.05, jr=0.21, tpot=0.02, ttft=0.4, schedule="static"),
            _rec("code", "none", 0, 16, jw=0.04, jr=0.19, tpot=0.02, ttft=0.4, schedule="static"),
            _rec("code", "none", 0, 8, jw=0.10, jr=0.12, tpot=0.02, ttft=0.4)]
    assert plot_window_vs_run(recs, tmp_path / "w.png").exists()
    windows = [ys for label, ys in drawn if label and label.endswith(": window")]
    runs = [ys for label, ys in drawn if label and label.endswith(": run")]
    assert windows == [[0.10]], "only the continuous series draws a window line"
    assert sorted(runs) == [[0.12], [0.21, 0.19]]


# ---- what decided a comparison: refill groups and prefill work ------------------------------------
def _prefill(run, step, rows, forwards):
    """A ledger prefill record of ``rows`` requests whose forwards computed ``forwards`` (model, rows, S[, query])."""
    work = [{"model": m, "rows": n, "tokens_per_row": s, **({"query_tokens": q} if q is not None else {})}
            for m, n, s, q in forwards]
    return {"kind": "phase", "run_id": run, "phase": "prefill", "step": step, "rows_active": rows, "work": work}


def test_prefill_fields_count_refill_groups_and_the_targets_positions():
    from refspec.eval.prefill_work import prefill_fields

    ledger = [_prefill("a", -1, 4, [(0, 4, 10, None), (1, 4, 10, None)]),  # first fill: a drafter forward after
              {"kind": "phase", "run_id": "a", "phase": "verify", "step": 0, "rows_active": 4, "work": []},
              _prefill("a", 0, 1, [(0, 1, 7, None)]), _prefill("a", 3, 3, [(0, 3, 12, 20), (1, 3, 12, None)]),
              _prefill("b", 0, 9, [(0, 9, 99, None)])]  # another configuration's run
    f = prefill_fields(ledger, ["a"], prompt_lengths=[5, 10, 3, 8, 7, 6, 4, 5])
    assert (f["refills"], f["refill_group_p50"], f["refill_group_max"]) == (2, 2, 3), "the first fill is no refill"
    assert f["prefill_positions_per_request"] == (40 + 7 + 20) / 8, "the target's positions only, packed as recorded"
    assert f["prefill_tokens_per_request"] == 6.0 and f["prefill_positions_per_token"] == pytest.approx(67 / 48)
    bare = prefill_fields([{**_prefill("a", -1, 2, []), "work": []}], ["a"], [3, 4])
    assert bare["prefill_positions_per_request"] is None, "a ledger that records no work gives no figure"


def _with_prefill(r, positions, tokens, groups):
    return with_fields(r, prefill_positions_per_request=positions, prefill_tokens_per_request=tokens,
                       prefill_positions_per_token=positions / tokens, refills=len(groups),
                       refill_group_p50=sorted(groups)[len(groups) // 2], refill_group_max=max(groups),
                       stream_digest="s")


def test_a_comparison_whose_prefill_work_differs_by_more_than_10_percent_is_flagged_with_its_cause():
    base = _with_prefill(_rec("chat", "none", 0, 64, jw=0.2122, tpot=0.03, ttft=17.8), 237.8, 61.2, [56, 50, 61])
    spec = _with_prefill(_rec("chat", "eagle", 4, 64, jw=0.1688, tpot=0.02, ttft=0.41), 75.0, 61.2, [1, 2, 7])
    spec = with_baseline(spec, base)
    assert spec.comparison.prefill_work_vs_baseline == pytest.approx(75.0 / 237.8)
    warning = spec.comparison.prefill_warning
    assert "-68%" in warning and "padding" in warning and "median 56, max 61 rows" in warning, warning
    table = format_table([base, spec])
    assert f"!! eagle k4 b64: {warning}" in table and "56/61" in table and "8900/17800" in table
    close = with_baseline(_with_prefill(spec, 61.2 * 1.05, 61.2, [1, 2, 7]), _with_prefill(base, 61.2, 61.2, [2, 3, 5]))
    assert close.comparison.prefill_warning is None and close.comparison.prefill_work_vs_baseline == pytest.approx(1.05)
    other = with_baseline(with_fields(spec, stream_digest="t"), base)
    assert "different request streams" in other.comparison.prefill_warning


def test_the_table_closes_with_one_verdict_sentence_per_comparison():
    from refspec.eval.report import verdict

    rows = [_rec("code", "none", 0, 8, jw=0.10, tpot=0.03, ttft=1.0), _rec("code", "ngram", 4, 8, jw=0.08, tpot=0.02,
                                                                          ttft=1.0),
            _rec("chat", "none", 0, 8, jw=0.10, tpot=0.03, ttft=1.0), _rec("chat", "ngram", 4, 8, jw=0.125, tpot=0.04,
                                                                          ttft=1.0)]
    rows = attach_baselines(rows)
    lines = format_table(rows).splitlines()
    assert lines[-2:] == [
        "verdict: on chat at batch 8, ngram k4 costs 25.0% more energy per token than plain decoding (steady-state "
        "window J/token, energy modelled, at 1.00x the tokens/s).",
        "verdict: on code at batch 8, ngram k4 saves 20.0% energy per token against plain decoding (steady-state "
        "window J/token, energy modelled, at 1.00x the tokens/s)."]
    assert verdict(rows[0]) is None
