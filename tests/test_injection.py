"""Acceptance injection: recorded distributions, their files, and the engine hook."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from refspec.drafters.ngram import NgramDrafter
from refspec.drafting import Draft
from refspec.engine import Engine, EngineConfig
from refspec.eval.injection import (SCHEMA, VLLM_EAGLE3_TAU, AcceptanceModel, AcceptanceModelError, Provenance,
                               geometric_model, injection_label, injection_record, load_acceptance_models,
                               make_acceptance_fn, resolve_acceptance_model, save_acceptance_models)
from refspec.energy.model.roofline import expected_tokens_per_step

VLLM = "vllm-eagle3-llama3.1-8b"


def _prov(**kw):
    return Provenance(**{"kind": "measured", "source_model": "tiny", "corpus": "c", "prompts": 2,
                         "date": "2026-01-01", **kw})


@pytest.mark.parametrize("k,tau", sorted(VLLM_EAGLE3_TAU.items()))
def test_builtin_reproduces_published_taus(k, tau):
    m = resolve_acceptance_model(VLLM, k=k)
    assert math.isclose(m.mean_tau, tau, abs_tol=1e-9), f"K={k}: {m.mean_tau} != published {tau}"
    assert m.provenance.kind == "derived" and "vLLM" in m.provenance.source and "3.54" in m.provenance.source


def test_builtin_beyond_published_k_is_labelled_extrapolated():
    m = resolve_acceptance_model(VLLM, k=15)
    assert m.k == 15 and m.provenance.kind == "extrapolated"
    assert VLLM_EAGLE3_TAU[7] < m.mean_tau < 8, "a decaying tail adds a little beyond K = 7"
    assert "INJECTED" in injection_label(m) and "extrapolated" in injection_label(m)
    assert injection_record(m)["injected"] is True


def test_geometric_model_matches_leviathan():
    for a, k in ((0.0, 3), (0.6, 4), (0.9, 7), (1.0, 5)):
        assert math.isclose(geometric_model(a, k).mean_tau, expected_tokens_per_step(a, k), rel_tol=1e-12)
    assert resolve_acceptance_model("geometric:0.5", k=2).probs == pytest.approx((0.5, 0.25, 0.25))


def test_restrict_folds_the_tail():
    m = AcceptanceModel(name="x", drafter="ngram", corpus="c", k=3, probs=(0.1, 0.2, 0.3, 0.4),
                        counts=(1, 2, 3, 4), provenance=_prov())
    r = m.restrict(1)
    assert r.probs == pytest.approx((0.1, 0.9)) and r.counts == (1, 9) and r.provenance.kind == "restricted"
    with pytest.raises(AcceptanceModelError, match="cannot serve k=5"):
        m.restrict(5)
    with pytest.raises(AcceptanceModelError, match="k \\+ 1"):
        AcceptanceModel(name="bad", drafter="d", corpus="c", k=2, probs=(0.5, 0.5), provenance=_prov())


def test_from_generation_counts_active_row_steps():
    gen = SimpleNamespace(accepted_per_step=[[0, 2, 3], [1, -1, 3], [3, -1, -1]], prompt_lengths=[4, 5, 6])
    m = AcceptanceModel.from_generation(gen, 3, name="n", drafter="ngram", corpus="c", source_model="tiny",
                                        source="test")
    assert m.counts == (1, 1, 1, 3) and m.row_steps == 6 and m.provenance.prompts == 3
    assert m.probs == pytest.approx((1 / 6, 1 / 6, 1 / 6, 0.5))
    with pytest.raises(AcceptanceModelError, match="pass the run's k"):
        AcceptanceModel.from_generation(gen, 2, name="n", drafter="ngram", corpus="c", source_model="tiny")


def test_file_round_trip_and_selection(tmp_path):
    a = AcceptanceModel.from_counts([5, 3, 2], name="a", drafter="ngram", corpus="code", provenance=_prov())
    b = AcceptanceModel.from_counts([1, 1, 1, 1, 6], name="b", drafter="ngram", corpus="chat", provenance=_prov())
    path = save_acceptance_models(tmp_path / "acc.json", [a, b])
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA and doc["models"][0]["provenance"]["source_model"] == "tiny"
    assert load_acceptance_models(path) == [a, b]
    assert resolve_acceptance_model(str(path), k=2) == a, "the smallest K >= k wins"
    assert resolve_acceptance_model(str(path), k=3).probs == pytest.approx((0.1, 0.1, 0.1, 0.7))
    assert resolve_acceptance_model(str(path), k=2, corpus="chat").probs == pytest.approx((0.1, 0.1, 0.8))
    with pytest.raises(AcceptanceModelError, match="no model for k=5"):
        resolve_acceptance_model(str(path), k=5)
    with pytest.raises(AcceptanceModelError, match="not a built-in"):
        resolve_acceptance_model(str(tmp_path / "missing.json"), k=2)
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(AcceptanceModelError, match="not a refspec.acceptance/1 file"):
        load_acceptance_models(tmp_path / "other.json")


def test_samples_follow_the_distribution():
    from scipy import stats

    m = resolve_acceptance_model(VLLM, k=4)
    n = 20000
    draws = m.sample(n, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=5).double()
    _, pval = stats.chisquare(counts.numpy(), (torch.tensor(m.probs, dtype=torch.float64) * n).numpy())
    assert pval > 1e-4, f"draws do not follow the model (p={pval:.2e})"


def test_acceptance_fn_emits_target_argmax_after_the_sampled_prefix():
    m = AcceptanceModel(name="always2", drafter="any", corpus="any", k=3, probs=(0, 0, 1, 0), provenance=_prov())
    fn = make_acceptance_fn(m, torch.Generator().manual_seed(0))
    logits = torch.zeros(2, 4, 10)
    logits[0, 2, 7] = 1.0
    logits[1, 2, 4] = 1.0
    acc = fn(Draft(tokens=torch.tensor([[1, 2, 3], [4, 5, 6]])), logits, None)
    assert acc.num_accepted.tolist() == [2, 2] and acc.next_token.tolist() == [7, 4]
    short = fn(Draft(tokens=torch.tensor([[1], [2]])), logits[:, :2], None)  # k = 1 < K: restricted
    assert short.num_accepted.tolist() == [1, 1]


def test_injected_engine_run_reproduces_mean_tau(tiny_models):
    """The engine's measured tau under injection matches the model's mean within 4 standard errors."""
    target = tiny_models["llama"]
    model = resolve_acceptance_model(VLLM, k=4)
    fn = make_acceptance_fn(model, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (6,), generator=g).tolist() for _ in range(32)]
    gen = Engine(target, NgramDrafter(trim=False), config=EngineConfig(k=4), acceptance_fn=fn).generate(
        prompts, max_new_tokens=40)
    n = sum(1 for step in gen.accepted_per_step for a in step if a >= 0)
    se = model.std_tau / math.sqrt(n)
    assert abs(gen.tau - model.mean_tau) < 4 * se, f"tau {gen.tau:.3f} vs model {model.mean_tau:.3f} (se {se:.3f}, n {n})"
    again = AcceptanceModel.from_generation(gen, 4, name="re", drafter="ngram", corpus="c", source_model="tiny")
    assert math.isclose(again.mean_tau, gen.tau, rel_tol=1e-12), "export of a run reproduces its tau"
