"""Speculation policies in the evaluation: configurations, sweep plans, mixed corpora, records
and the report's policy section and frontier (no model runs: hand-built records and ledgers)."""
from __future__ import annotations


import pytest

from eval_records import record
from refspec.eval.acceptance_models import acceptance_from_tau
from refspec.eval.flags import UsageError
from refspec.eval.mixed_corpus import check_mixed, mixed_parts
from refspec.eval.policy_report import comparison_rows, frontier, policy_section
from refspec.eval.policy_setup import corpus_prior
from refspec.eval.record_figures import k_steps
from refspec.eval.run_config import RunConfig
from refspec.eval.sweep import SweepGrid, plan

BASE = dict(model="smollm2-135m", drafter="eagle", k=4, batch=8, corpus="code", num_prompts=None, max_new_tokens=64,
            dtype="fp32", device="cpu")


def test_fixed_keeps_the_config_ids_of_runs_before_policies():
    fixed = RunConfig(**BASE)
    assert "spec_policy" not in fixed.identity() and fixed.config_id.startswith("eagle-k4-b8-code-")
    energy = RunConfig(**BASE, spec_policy="energy:tpot_ms=20")
    assert energy.config_id.startswith("eagle-k4-energy-tpot_ms=20-b8-code-") and energy.config_id != fixed.config_id
    assert energy.identity()["spec_policy"] == "energy:tpot_ms=20" and "energy" in energy.label
    assert energy.baseline().spec_policy == "fixed" and energy.baseline().config_id == fixed.baseline().config_id
    assert RunConfig(**BASE, spec_policy="OFF-ABOVE:4").spec_policy == "off-above:4", "the canonical spec"


@pytest.mark.parametrize("changes, match", [
    (dict(spec_policy="sometimes"), "unknown"),
    (dict(spec_policy="k-by-batch:1=7,8=2"), "raise --k to 7"),
    (dict(spec_policy="energy", tree=True, k=16), "--tree"),
    (dict(spec_policy="energy", drafter="none", k=0), "baseline"),
])
def test_policies_a_configuration_cannot_run_are_refused(changes, match):
    with pytest.raises(UsageError, match=match):
        RunConfig(**{**BASE, **changes})


def test_a_sweep_runs_fixed_at_every_k_and_a_policy_once_at_the_largest():
    grid = SweepGrid(corpora=("code",), batches=(1, 8), drafters=("ngram", "eagle"), ks=(1, 2, 4),
                     base=RunConfig(**{**BASE, "drafter": "none", "k": 0}), policies=("fixed", "energy"))
    configs = plan(grid)
    by_cell = {}
    for c in configs:
        by_cell.setdefault(c.batch, []).append((c.drafter, c.k, c.spec_policy))
    assert by_cell[8] == [("none", 0, "fixed"), ("ngram", 1, "fixed"), ("ngram", 2, "fixed"), ("ngram", 4, "fixed"),
                          ("ngram", 4, "energy"), ("eagle", 1, "fixed"), ("eagle", 2, "fixed"), ("eagle", 4, "fixed"),
                          ("eagle", 4, "energy")]
    only = plan(SweepGrid(corpora=("code",), batches=(8,), drafters=("ngram",), ks=(2, 4),
                          base=RunConfig(**{**BASE, "drafter": "none", "k": 0}), policies=("energy",)))
    assert [(c.drafter, c.k, c.spec_policy) for c in only] == [("none", 0, "fixed"), ("ngram", 4, "energy")]


def test_mixed_corpora_name_two_or_more_built_in_corpora():
    known = ("conversation", "code", "math")
    assert check_mixed("mixed:conversation+code", known) == "mixed:conversation+code"
    assert mixed_parts("mixed:code+math") == ["code", "math"] and mixed_parts("code") is None
    for bad in ("mixed:code", "mixed:code+code", "mixed:code+poetry", "mixed:"):
        with pytest.raises(ValueError, match="mixed|built-in"):
            check_mixed(bad, known)


def test_a_mixed_stream_interleaves_its_parts(monkeypatch):
    from refspec.eval import prompt_sets
    from refspec.eval.prompt_sets import mixed_prompt_set

    ids = {"code": 1, "conversation": 2, "math": 3}

    def fake(corpus, tokenizer, *, chat, wanted, cap=None, references=True):
        n = 1 if corpus == "math" else wanted  # math has one prompt here
        return prompt_sets.PromptSet([[ids[corpus], i] for i in range(n)], [None] * n)

    monkeypatch.setattr(prompt_sets, "corpus_prompt_set", fake)
    got = mixed_prompt_set("mixed:code+conversation", None, chat=False, wanted=5)
    assert got.prompts == [[1, 0], [2, 0], [1, 1], [2, 1], [1, 2]]
    short = mixed_prompt_set("mixed:math+code", None, chat=False, wanted=4)
    assert short.prompts == [[3, 0], [1, 0], [1, 1]], "a short part leaves the others"
    assert not short.has_references, "parts' reference lengths are scaled apart: none carried"


def test_acceptance_from_tau_inverts_the_expected_tokens():
    for a in (0.0, 0.3, 0.7, 0.95):
        tau = sum(a ** i for i in range(5))
        assert acceptance_from_tau(tau, 4) == pytest.approx(a, abs=1e-9)
    assert acceptance_from_tau(9.0, 4) == pytest.approx(1.0) and acceptance_from_tau(0.5, 4) == pytest.approx(0.0)
    assert corpus_prior("smollm2-135m", "eagle", "code", 0.0) == pytest.approx(acceptance_from_tau(2.032, 4))
    both = corpus_prior("smollm2-135m", "eagle", "mixed:conversation+code", 0.0)
    assert both == pytest.approx((acceptance_from_tau(1.46, 4) + acceptance_from_tau(2.032, 4)) / 2)
    assert corpus_prior("smollm2-135m", "ngram", "code", 0.0) is None
    assert corpus_prior("other", "eagle", "code", 0.0) is None


def _ledger(path, run_id, pattern, model):
    """A real ledger run of a tiny target under a policy cycling K through ``pattern``."""
    from refspec.drafters.ngram import NgramDrafter
    from refspec.energy.ledger.writer import Ledger
    from refspec.engine import Engine, EngineConfig
    from test_policy_engine import CyclingK

    with Ledger(path, run_id=run_id, mode="a", meter_source="none:time-only") as ledger:
        Engine(model, NgramDrafter(), config=EngineConfig(k=4), policy=CyclingK(pattern), observers=[ledger]).generate(
            [[5, 6, 7, 5, 6, 7]], max_new_tokens=8)


def test_k_steps_count_the_ks_the_ledger_recorded(tmp_path):
    recs = [{"kind": "phase", "run_id": "a", "phase": "verify", "step": s, "k": k} for s, k in enumerate([0, 4, 4, 2])]
    recs += [{"kind": "phase", "run_id": "a", "phase": "draft", "step": 0, "k": 4},
             {"kind": "phase", "run_id": "b", "phase": "verify", "step": 0, "k": 1}]
    assert k_steps(recs, ["a"]) == ({"0": 1, "2": 1, "4": 2}, 2.5)
    assert k_steps([], ["a"]) == ({}, None)


def _rec(drafter, k, j, tpot, policy="fixed", corpus="code", batch=8, run="r"):
    return record(drafter=drafter, k=k, batch=batch, corpus=corpus, spec_policy=policy, schedule="continuous",
                  window_j_per_token=j, run_j_per_token=j * 1.1, tpot_p50_s=tpot, stream_digest="s", meter="auto",
                  tree=False, run_ids=[run], k_mean=1.5 if policy != "fixed" else float(k))


RECORDS = [_rec("none", 0, 1.00, 0.050), _rec("eagle", 1, 0.90, 0.040), _rec("eagle", 4, 0.95, 0.030),
           _rec("eagle", 4, 0.88, 0.038, policy="energy", run="pol"),
           _rec("eagle", 4, 0.93, 0.031, policy="energy:tpot_ms=31", run="pol31"),
           _rec("ngram", 2, 0.70, 0.045, corpus="conversation")]


def test_comparison_rows_put_each_policy_beside_every_fixed_k():
    rows = comparison_rows(RECORDS)
    assert [(r["policy"], r["best_k"]) for r in rows] == [("energy", 1), ("energy:tpot_ms=31", 1)]
    assert rows[0]["fixed"] == {0: 1.00, 1: 0.90, 4: 0.95} and rows[0]["vs_best"] == pytest.approx(0.88 / 0.90 - 1)


def test_the_frontier_is_the_lowest_j_per_token_at_each_tpot_target():
    stairs = frontier(RECORDS)[("code", 8)]
    assert [(t, j) for t, j, _ in stairs] == [(0.030, 0.95), (0.031, 0.93), (0.038, 0.88)]
    assert "energy" in stairs[-1][2]


def test_the_policy_section_draws_k_over_the_run_and_the_frontier(tmp_path, tiny_models):
    ledger = tmp_path / "ledger.jsonl"
    _ledger(ledger, "pol", [0, 4, 1], tiny_models["llama"])
    _ledger(ledger, "pol31", [4, 3], tiny_models["llama"])
    from refspec.eval.policy_report import k_by_step

    assert k_by_step([ledger], {"pol"})["pol"][:3] == [(0, 0), (1, 4), (2, 1)], "each step's K as the ledger has it"
    md, plots = policy_section(RECORDS, tmp_path, [ledger], frontier_plot=True)
    assert {p.name for p in plots} == {"policy_k.png", "policy_energy.png", "frontier.png"}
    assert all(p.stat().st_size > 0 for p in plots)
    text = "\n".join(md)
    assert "| code | 8 | eagle | energy (K<=4) | 0.88 |" in text and "-2.2%" in text
    for i, line in enumerate(md):  # every Markdown table's delimiter row has its header's cells
        if line.startswith("|---"):
            assert line.count("|") == md[i - 1].count("|")
    assert "## Energy-latency frontier" in text
    md, plots = policy_section([r for r in RECORDS if r.spec_policy == "fixed"], tmp_path, [ledger])
    assert md == [] and plots == [], "no policy run, no frontier asked: nothing"


@pytest.mark.parametrize("argv, match", [
    (["run", "--spec-policy", "sometimes"], "--spec-policy 'sometimes' is unknown"),
    (["sweep", "--spec-policy", "energy", "--spec-policy", "energy:tpot_ms=-1"], "tpot_ms"),
    (["run", "--corpus", "mixed:code+poetry"], "poetry is not a built-in corpus"),
    (["run", "--drafter", "ngram", "--k", "2", "--spec-policy", "k-by-batch:1=4"], "raise --k to 4"),
])
def test_bad_policy_flags_are_one_line_errors(argv, match, capsys):
    from refspec.eval.cli import main

    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and match in err[0]


def test_injected_acceptance_follows_each_steps_k_under_a_policy(tiny_models):
    """Under a policy the injection is restricted to each step's K (k=None): steps of K = 0 and
    K below the engine's run, and never accept more than they drafted."""
    import torch

    from refspec.drafters.ngram import NgramDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.injection import geometric_model, make_acceptance_fn
    from test_policy_engine import CyclingK

    fn = make_acceptance_fn(geometric_model(0.9, 4), torch.Generator().manual_seed(0), k=None)
    gen = Engine(tiny_models["llama"], NgramDrafter(), config=EngineConfig(k=4), acceptance_fn=fn,
                 policy=CyclingK((4, 0, 2))).generate([[20, 21, 22, 23]] * 3, max_new_tokens=16)
    ks = [e.k for e in gen.events if e.phase == "verify"]
    assert set(ks) == {0, 2, 4}
    for k, step in zip(ks, gen.accepted_per_step):
        assert all(a <= k for a in step)
    assert any(a == 4 for step in gen.accepted_per_step for a in step), "injected acceptance of full drafts"
