"""Serving conditions through ``python -m refspec.eval``: the request stream, the schedules, open-loop
arrivals and the summary fields, on the tiny random llama of test_eval_cli (in-process)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from refspec.energy.accounting.headline import pool_runs
from refspec.energy.ledger.read import read_ledger
from refspec.eval import cli
from refspec.eval.corpora.prompts import build_prompts, continuation_windows
from refspec.eval.prompt_sets import corpus_prompts
from refspec.eval.record import RECORD_VERSION, fields_of_json
from refspec.eval.requests import default_requests, make_stream, poisson_arrivals
import test_eval_cli
from test_eval_cli import QUIET

tiny, one_thread = test_eval_cli.tiny, test_eval_cli.one_thread  # the tiny model and one thread, as there
BUDGET = 6


def _run(tiny, out: Path, *extra: str) -> list[dict]:
    """One run (ngram against the baseline) with a modelled clock, so figures repeat exactly."""
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", str(BUDGET),
            "--meter", "roofline:h200", *QUIET, "--out", str(out), *extra]
    assert cli.main(argv) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def continuous(tiny, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("continuous")
    return out, _run(tiny, out, "--batch", "2", "--requests", "7")


@pytest.fixture(scope="module")
def static(tiny, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("static")
    return out, _run(tiny, out, "--batch", "2", "--requests", "7", "--schedule", "static")


# ---- the request stream ---------------------------------------------------------------------------
def test_poisson_arrivals_are_reproducible_from_the_seed_and_have_the_rate():
    a = poisson_arrivals(20_000, 4.0, seed=11)
    assert a == poisson_arrivals(20_000, 4.0, seed=11), "the same seed gives the same arrivals"
    assert a != poisson_arrivals(20_000, 4.0, seed=12)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps > 0).all()
    # mean gap 1/rate; the sample mean of 19,999 exponential gaps has sd 0.25/sqrt(19999) = 0.0018:
    # 6 sd (false failure ~2e-9)
    assert abs(gaps.mean() - 0.25) < 6 * 0.25 / math.sqrt(len(gaps))
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)


def test_stream_repeats_prompts_only_beyond_the_distinct_ones():
    prompts = [[3, 4], [5], [6, 7, 8]]
    s = make_stream(prompts, 7, max_new_tokens=5)
    assert [r.id for r in s.requests] == list(range(7)) and s.unique == 3
    assert [list(r.prompt) for r in s.requests] == [prompts[i % 3] for i in range(7)]
    assert all(r.arrival_s is None and r.max_new_tokens == 5 for r in s.requests), "closed loop by default"
    assert make_stream(prompts, 2, max_new_tokens=5).unique == 2
    s = make_stream(prompts, 4, max_new_tokens=5, rate=2.0, seed=3)
    assert [r.arrival_s for r in s.requests] == poisson_arrivals(4, 2.0, 3)
    assert [len(c) for c in make_stream(prompts, 7, max_new_tokens=5).chunks(3)] == [3, 3, 1]
    assert default_requests(8) == 32


def test_continuation_windows_cut_distinct_prompts_inside_the_text():
    full = list(range(100, 140))  # 40 tokens: n = 20, cut points 20, 25, 30 (each leaves >= 10)
    windows = continuation_windows(full, prose_tokens=128)
    assert windows[0] == full[:20], "the first is build_prompts' own prompt"
    assert [w[-1] for w in windows] == [full[c - 1] for c in (20, 25, 30)]
    assert all(len(w) == 20 for w in windows) and len({tuple(w) for w in windows}) == 3
    assert continuation_windows([7], 128) == [[7]] and continuation_windows([7, 8], 128) == [[7]]


def test_prose_corpus_gives_more_distinct_prompts_than_texts(tiny, tmp_path):
    from refspec.assets.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny["model"])
    path = tmp_path / "prose.jsonl"
    texts = [" ".join(f"w{3 + (i * 7 + j * (i + 3)) % 90}" for j in range(40)) for i in range(3)]
    path.write_text("".join(json.dumps({"prompt": t, "kind": "prose"}) + "\n" for t in texts))
    firsts = build_prompts([{"prompt": t, "kind": "prose"} for t in texts], tok, chat=False)
    got = corpus_prompts(str(path), tok, chat=False, wanted=100)
    assert got[:3] == firsts, "the corpus's own prompts come first"
    assert len(got) == len({tuple(p) for p in got}) == 3 * 3, "three cuts of each 40-token text, all distinct"
    assert corpus_prompts(str(path), tok, chat=False, wanted=5) == got[:5]
    assert corpus_prompts(str(path), tok, chat=False, wanted=9, cap=2) == got[:2]


# ---- the CLI --------------------------------------------------------------------------------------
SERVING_FIELDS = ("schedule", "requests", "requests_unique", "request_rate", "output_lengths", "run_mean_active_rows",
                  "window_mean_active_rows", "window_time_s", "window_tokens", "window_energy_j", "window_first_step",
                  "window_last_step", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s",
                  "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "window_j_per_token", "run_j_per_token")
"""The serving fields every record carries."""

def test_continuous_default_record_has_consistent_serving_fields(continuous):
    out, summary = continuous
    assert [r["drafter"] for r in summary] == ["none", "ngram"]
    for r in summary:
        missing = [f for f in SERVING_FIELDS if f not in r]
        assert not missing, f"{r['config_id']} lacks {missing}"
        assert set(r) <= set(fields_of_json()), f"unknown fields {sorted(set(r) - set(fields_of_json()))}"
        assert r["record_version"] == RECORD_VERSION and r["schedule"] == "continuous" and r["batches"] == 1
        assert r["requests"] == 7 and r["requests_unique"] == 5, "5 prompts in the file: 7 requests repeat 2"
        assert r["window_first_step"] == 0, "closed loop: every slot is busy from the first step"
        assert r["window_last_step"] >= r["window_first_step"]
        assert 0 < r["window_tokens"] <= r["run_tokens"] and r["window_time_s"] <= r["run_time_s"]
        assert 0 < r["run_mean_active_rows"] <= r["window_mean_active_rows"] == 2
        assert r["window_j_per_token"] == pytest.approx(r["window_energy_j"] / r["window_tokens"], rel=1e-12)
        assert r["run_j_per_token"] == pytest.approx(r["run_energy_j"] / r["run_tokens"], rel=1e-12)
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] <= r["tpot_p99_s"]
        outputs = r["request_outputs"]
        assert [o["id"] for o in outputs] == list(range(7))
        assert sum(len(o["tokens"]) for o in outputs) == r["run_tokens"] and all(len(o["tokens"]) <= BUDGET
                                                                             for o in outputs)
        assert outputs[5]["prompt"] == outputs[0]["prompt"] != outputs[1]["prompt"]
    base, spec = summary
    assert [o["tokens"] for o in spec["request_outputs"]] == [o["tokens"] for o in base["request_outputs"]], \
        "fp32 greedy speculation under continuous batching reproduces the baseline request by request"
    assert spec["greedy_match_baseline"] is True


def test_record_window_is_the_accounting_of_its_ledger(continuous):
    out, summary = continuous
    ledger = read_ledger(out / "ledger.jsonl")
    for r in summary:
        acc = pool_runs(ledger, r["run_ids"])
        w = acc.window
        assert (w.first_step, w.last_step, w.tokens, w.time_s) == (r["window_first_step"], r["window_last_step"],
                                                                    r["window_tokens"], r["window_time_s"])
        assert acc.window_j_per_token == r["window_j_per_token"] and acc.j_per_token == r["run_j_per_token"]
        assert [len(o["tokens"]) for o in r["request_outputs"]] == [q.tokens for q in acc.requests], \
            "the ledger's emissions per request are the tokens each request got"
        phases = [p for p in ledger if p.get("kind") == "phase" and p["run_id"] in r["run_ids"]]
        inside = [p for p in phases if w.bounds[0][0] <= p["step"] < w.bounds[0][1]]
        assert r["window_tokens"] == sum(p["emitted"] for p in inside)
        refills = [p["rows_active"] for p in phases if p["phase"] == "prefill" and p["step"] >= 0]
        assert (r["refills"], r["refill_group_max"]) == (len(refills), max(refills)) and r["refills"] >= 2
        prompts = [len(o["prompt"]) for o in r["request_outputs"]]
        assert r["prefill_tokens_per_request"] == sum(prompts) / len(prompts)
        assert r["prefill_positions_per_token"] >= 1.0, "a prefill computes at least every prompt token"


def test_static_schedule_serves_the_same_requests_in_lockstep_batches(continuous, static):
    _, cont = continuous
    out, stat = static
    for c, s in zip(cont, stat):
        assert s["schedule"] == "static" and s["batches"] == 4 and len(s["run_ids"]) == 4, "7 requests, batches of 2"
        assert s["window_first_step"] is None and len(s["window_bounds"]) == 4, "pooled batches: bounds per run"
        assert s["window_bounds"][-1] is not None, "the last chunk (one request) is a lockstep batch of its own size"
        assert s["config_id"] != c["config_id"] and "-static-" in s["config_id"]
        assert [o["tokens"] for o in s["request_outputs"]] == [o["tokens"] for o in c["request_outputs"]], \
            "fp32 greedy: static and continuous give every request the same tokens"
        assert s["run_mean_active_rows"] <= 2


def test_open_loop_is_reproducible_and_empty_slots_emit_nothing(tiny, tmp_path):
    runs = [_run(tiny, tmp_path / name, "--batch", "2", "--requests", "6", "--request-rate", rate, "--seed", seed,
                 "--drafter", "none")
            for name, rate, seed in (("a", "20000", "5"), ("b", "20000", "5"), ("c", "20000", "6"))]
    a, b, c = (r[0] for r in runs)
    assert a["request_rate"] == 20000.0
    keys = ("ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "window_bounds", "run_time_s", "run_mean_active_rows")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, "same seed, same arrivals, same modelled run"
    assert {k: a[k] for k in keys} != {k: c[k] for k in keys}, "another seed, other arrivals"
    ledger = read_ledger(tmp_path / "a" / "ledger.jsonl")
    decode = [p for p in ledger if p.get("kind") == "phase" and p["phase"] != "prefill"]
    empty = [(p["slot_requests"][i], p["emitted_per_row"][i]) for p in decode if p["emitted_per_row"]
             for i in range(2) if p["slot_requests"][i] < 0]
    assert all(n == 0 for _, n in empty), "an empty slot emits no tokens"
    assert [q.arrival_s for q in pool_runs(ledger, a["run_ids"]).requests] == poisson_arrivals(6, 20000.0, 5)


def test_default_stream_is_four_requests_per_slot(tiny, tmp_path):
    (r,) = _run(tiny, tmp_path / "d", "--batch", "2", "--drafter", "none", "--max-new-tokens", "2")
    assert r["requests"] == 8 and r["requests_unique"] == 5


def test_budgets_come_from_references_and_are_the_same_for_every_configuration(tiny, tmp_path):
    """Reference answers of 2 to 40 words: budgets scaled into [1, N], equal for ngram and its baseline."""
    from refspec.assets.tokenizer import load_tokenizer
    from refspec.eval.prompt_sets import quantile_length
    from refspec.eval.requests import reference_budgets

    refs = [" ".join(f"w{3 + j % 17}" for j in range(n)) for n in (2, 40, 9, 25, 14)]
    corpus = tmp_path / "with_refs.jsonl"
    prompts = [json.loads(line)["prompt"] for line in tiny["prompts"].read_text().splitlines()]
    corpus.write_text("".join(json.dumps({"prompt": p, "kind": "code", "reference": r}) + "\n"
                              for p, r in zip(prompts, refs)))
    argv = ["--model", str(tiny["model"]), "--corpus", str(corpus), "--max-new-tokens", "8", "--meter",
            "roofline:h200", *QUIET, "--batch", "2", "--requests", "7", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 0
    base, spec = json.loads((tmp_path / "o" / "summary.json").read_text())
    tok = load_tokenizer(tiny["model"])
    lengths = [len(tok.encode(r)) for r in refs]
    expected = reference_budgets([lengths[i % 5] for i in range(7)], 8, quantile_length(lengths))
    assert len(set(expected)) >= 4, "the references spread the budgets"
    for r in (base, spec):
        assert r["output_lengths"]["dist"] == "reference"
        assert [o["budget"] for o in r["request_outputs"]] == expected
        assert all(len(o["tokens"]) <= o["budget"] for o in r["request_outputs"])
    assert spec["stream_digest"] == base["stream_digest"] and spec["same_stream_as_baseline"] is True
    assert [o["tokens"] for o in spec["request_outputs"]] == [o["tokens"] for o in base["request_outputs"]]


def test_uniform_budgets_repeat_with_the_seed_and_fixed_gives_the_cap(tiny, tmp_path):
    def budgets(name, *extra):
        (r,) = _run(tiny, tmp_path / name, "--batch", "2", "--requests", "6", "--drafter", "none", *extra)
        return r["output_lengths"]["dist"], [o["budget"] for o in r["request_outputs"]]

    a, b = budgets("a", "--seed", "3"), budgets("b", "--seed", "3")
    assert a == b and a[0] == "uniform:0.25", "no references in the tiny prompts: auto is uniform:0.25"
    assert budgets("c", "--seed", "4")[1] != a[1]
    assert budgets("f", "--output-len-dist", "fixed") == ("fixed", [BUDGET] * 6)


def test_reference_lengths_without_references_is_one_error_line(tiny, tmp_path, capsys):
    rc = cli.main(["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--meter", "time", *QUIET,
                   "--output-len-dist", "reference", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error:") == 1 and "no reference answer" in err and "uniform" in err
    assert not (tmp_path / "r" / "records.jsonl").exists()


def test_help_has_the_serving_flags_and_docs_describe_every_record_field(capsys):
    assert cli.main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--schedule" in text and "--requests" in text and "--request-rate" in text
    docs = (Path(__file__).resolve().parents[1] / "docs" / "fields.md").read_text()
    described = {line.split("`")[1] for line in docs.splitlines() if line.startswith("| `")}
    assert described == set(fields_of_json()), (f"docs/fields.md lacks {sorted(set(fields_of_json()) - described)}, "
                                                f"describes unknown {sorted(described - set(fields_of_json()))}")


def test_a_drafter_without_a_per_slot_reset_needs_the_static_schedule(tiny, tmp_path, monkeypatch, capsys):
    import sys

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "noresetdrafter.py").write_text(
        "from refspec.drafters.example import BigramDrafter\n\n\n"
        "class NoReset(BigramDrafter):\n    reset_rows = None  # a drafter written before refills existed\n")
    monkeypatch.syspath_prepend(str(mods))
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "4", "--meter",
            "time", *QUIET, "--batch", "2", "--requests", "5", "--drafter", "noresetdrafter:NoReset"]
    try:
        assert cli.main([*argv, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert "has no reset_rows" in err and "--schedule static" in err
        assert not (tmp_path / "c" / "records.jsonl").exists(), "refused before anything ran"
        assert cli.main([*argv, "--schedule", "static", "--out", str(tmp_path / "s")]) == 0  # a short last chunk too
    finally:
        sys.modules.pop("noresetdrafter", None)


def test_sweep_over_both_schedules_compares_each_with_its_own_baseline(tiny, tmp_path):
    argv = ["sweep", "--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "4",
            "--meter", "roofline:h200", *QUIET, "--batch", "2", "--requests", "4", "--k", "0,2", "--drafter", "ngram",
            "--schedule", "continuous,static", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["schedule"], r["drafter"]) for r in summary] == [
        ("continuous", "none"), ("continuous", "ngram"), ("static", "none"), ("static", "ngram")]
    by_id = {r["config_id"]: r for r in summary}
    for r in summary[1::2]:
        assert by_id[r["baseline"]["config_id"]]["schedule"] == r["schedule"]
        assert r["greedy_match_baseline"] is True


@pytest.mark.real
def test_real_corpora_give_distinct_prompts_beyond_their_default_subset():
    from refspec import assets
    from refspec.assets.tokenizer import load_tokenizer

    tok = load_tokenizer(assets.resolve_model("smollm2-135m"))
    english = corpus_prompts("english", tok, chat=False, wanted=32)  # 13 eval blocks of the UDHR
    assert len(english) == len({tuple(p) for p in english}) == 32, "UDHR cut at later offsets: 32 distinct"
    conversation = corpus_prompts("conversation", tok, chat=True, wanted=120)  # 80 Vicuna questions first
    assert len({tuple(p) for p in conversation}) == 120, "the rest of the eval split follows the Vicuna questions"
