"""The engine: speculative decoding changes nothing (greedy, fp32), ragged rows, bad input."""
import pytest
import torch

from refspec.drafters.draft_model import DraftModelDrafter
from refspec.drafters.ngram import NgramDrafter
from refspec.drafting import DrafterError
from refspec.engine import Engine, EngineConfig, GenerationError
from refspec.sampling import SamplingConfig

EOS = [2]


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30, 9, 12, 3, 25, 7, 2][:n]
    ps = [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]
    if n > 1:
        ps[1] = ps[1][:6] * 3  # a repetitive prompt gives the n-gram drafter matches
    return ps


def _drafters(model):
    return {"ngram": lambda: NgramDrafter(max_n=3),
            "ngram-untrimmed": lambda: NgramDrafter(max_n=3, trim=False),
            "draft-model": lambda: DraftModelDrafter(model.truncated(1), target_vocab_size=model.args.vocab_size)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("drafter", ["ngram", "ngram-untrimmed", "draft-model"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_plain(tiny_models, family, drafter, k):
    m = tiny_models[family]
    for prompts in (_prompts(1), _prompts(10)):
        plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=32)
        spec = Engine(m, _drafters(m)[drafter](), config=EngineConfig(k=k), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=32)
        for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)):
            assert a == b, f"{family}/{drafter}/k={k} row {i} (batch {len(prompts)}): spec {b} != plain {a}"
        assert spec.steps <= plain.steps


def test_ragged_batch_equals_rows_alone(tiny_models):
    m = tiny_models["gemma3"]
    prompts = _prompts(8)
    batch = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=20).tokens
    alone = [Engine(m, eos_token_ids=EOS).generate([p], max_new_tokens=20).tokens[0] for p in prompts]
    assert batch == alone


def test_rows_finish_independently_at_eos_and_budget(tiny_models):
    m = tiny_models["qwen2"]
    prompts = _prompts(6)
    plain = Engine(m).generate(prompts, max_new_tokens=12)
    # make the 4th token of row 0 an EOS: that row must stop there, others continue
    eos = plain.tokens[0][3]
    gen = Engine(m, NgramDrafter(), config=EngineConfig(k=3), eos_token_ids=[eos]).generate(prompts, max_new_tokens=12)
    first = plain.tokens[0].index(eos)
    assert gen.tokens[0] == plain.tokens[0][: first + 1] and gen.finished_by_eos[0]
    for a, b in zip(plain.tokens, gen.tokens):
        cut = a.index(eos) + 1 if eos in a else len(a)
        assert b == a[:cut]
    assert all(len(t) <= 12 for t in gen.tokens)


def test_draft_model_catches_up_after_full_acceptance(tiny_models):
    """The target as its own drafter accepts everything: the two-token catch-up keeps it exact."""
    m = tiny_models["qwen2"]
    prompts = _prompts(4)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=30)
    d = DraftModelDrafter(m.truncated(m.num_layers), target_vocab_size=96)
    spec = Engine(m, d, config=EngineConfig(k=3), eos_token_ids=EOS).generate(prompts, max_new_tokens=30)
    assert spec.tokens == plain.tokens
    full = [a for step in spec.accepted_per_step for a in step if a >= 0]
    assert sum(a == 3 for a in full) >= len(full) - len(prompts), "a perfect drafter is accepted in full"
    assert d.forwards == 3 * spec.steps, "k forwards per step"


def test_sampled_speculative_follows_target_distribution(tiny_models):
    """End to end: the 2nd emitted token's distribution with a (bad) draft model equals the exact
    marginal sum_x p(x | prompt) p(y | prompt, x). Chi-square at alpha = 1e-4 is the false-failure rate."""
    from scipy import stats

    m = tiny_models["qwen2"]
    prompt = [5, 9, 11, 4]
    cfg = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        lg, _ = m(torch.tensor([prompt]), torch.arange(4)[None], m.new_cache(1, 8))
        p1 = torch.softmax(lg[0, -1], -1)
        v = p1.shape[0]
        seqs = torch.cat([torch.tensor(prompt).expand(v, 4), torch.arange(v)[:, None]], 1)
        lg2, _ = m(seqs, torch.arange(5)[None].expand(v, 5), m.new_cache(v, 8))
        exact = (p1[:, None] * torch.softmax(lg2[:, -1], -1)).sum(0).double()
    n = 3000
    g = torch.Generator().manual_seed(11)
    drafter = DraftModelDrafter(m.truncated(1), target_vocab_size=v)
    gen = Engine(m, drafter, config=EngineConfig(k=3, sampling=cfg)).generate([prompt] * n, max_new_tokens=3,
                                                                             generator=g)
    second = torch.tensor([t[1] for t in gen.tokens])
    counts = torch.bincount(second, minlength=v).double()
    keep = exact * n >= 5  # pool rare tokens so the chi-square approximation holds
    obs, exp = counts[keep], exact[keep] * n
    if (~keep).any():
        obs = torch.cat([obs, counts[~keep].sum()[None]])
        exp = torch.cat([exp, exact[~keep].sum()[None] * n])
    exp = exp / exp.sum() * obs.sum()
    _, pval = stats.chisquare(obs.numpy(), exp.numpy())
    assert pval > 1e-4, f"sampled speculative output does not follow the target (p={pval:.2e})"


def test_bad_input_errors(tiny_models):
    m = tiny_models["llama"]
    with pytest.raises(GenerationError, match="k must be >= 0"):
        EngineConfig(k=-1)
    with pytest.raises(GenerationError, match="empty"):
        Engine(m).generate([[1, 2], []], max_new_tokens=4)
    with pytest.raises(GenerationError, match="context"):
        Engine(m).generate([[1] * 10], max_new_tokens=m.args.max_position_embeddings)
    with pytest.raises(GenerationError, match="cache holds"):
        Engine(m, NgramDrafter(), config=EngineConfig(k=8)).generate([[1] * 10], max_new_tokens=10, max_len=20)
    with pytest.raises(GenerationError, match="outside"):
        Engine(m).generate([[1, 500]], max_new_tokens=4)
    with pytest.raises(GenerationError, match="needs a drafter"):
        Engine(m, None, config=EngineConfig(k=2))
    with pytest.raises(DrafterError, match="tokenizer differs"):
        DraftModelDrafter(m, target_vocab_size=96, draft_fingerprint="aaaa", target_fingerprint="bbbb")


def test_phase_events_count_tokens(tiny_models):
    m = tiny_models["qwen2"]
    seen = []
    gen = Engine(m, NgramDrafter(trim=False), config=EngineConfig(k=2), observers=[seen.append]).generate(
        _prompts(5), max_new_tokens=10)
    assert [e.phase for e in seen[:4]] == ["prefill", "draft", "verify", "commit"]
    assert sum(e.emitted for e in seen) == gen.num_emitted, "events account for every emitted token"
    verify = [e for e in seen if e.phase == "verify"]
    assert all(e.verified == e.rows_active * 3 for e in verify)


def _ngram_state(rows, done=None):
    from refspec.drafting import DecodeState

    t = max(map(len, rows)) + 8
    tokens = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) - 1 for r in rows])  # the last token of each row is pending
    z = torch.zeros(len(rows), dtype=torch.long)
    return DecodeState(tokens=tokens, lengths=lengths, prev_lengths=lengths, pending=tokens[torch.arange(len(rows)),
                       lengths], prompt_lengths=lengths, done=torch.zeros(len(rows), dtype=torch.bool)
                       if done is None else torch.tensor(done), hidden=[], num_accepted=z, sampling=SamplingConfig(),
                       generator=None, step=0, max_length_bound=int(lengths.max()) + 1, target_args=None,
                       dtype_bytes=4)


def test_ngram_trim_cuts_the_draft_to_the_longest_continuation_in_the_batch():
    # row 0: suffix "7 8" occurred before, followed by "9 1" then the suffix itself: 4 known tokens
    # row 1: suffix "3" occurred before, followed by "4" only (then the pending token): 2 known
    rows = [[7, 8, 9, 1, 7, 8], [5, 3, 4, 3]]
    full = NgramDrafter(max_n=2, min_n=1, trim=False).propose(_ngram_state(rows), 6).tokens
    assert full.tolist() == [[9, 1, 7, 8, 8, 8], [4, 3, 3, 3, 3, 3]]
    assert NgramDrafter(max_n=2, min_n=1, trim=True).propose(_ngram_state(rows), 6).tokens.tolist() == [
        [9, 1, 7, 8], [4, 3, 3, 3]]
    # a finished row does not keep the draft long; no match anywhere gives an empty draft (a plain step)
    done = _ngram_state(rows, done=[True, False])
    assert NgramDrafter(max_n=2, min_n=1, trim=True).propose(done, 6).tokens.shape == (2, 2)
    assert NgramDrafter(trim=True).propose(_ngram_state([[1, 2, 3], [4, 5, 6]]), 4).tokens.shape == (2, 0)


def _plan_with_verify_cost(ratio):
    """A plan whose 5-row product costs ``ratio`` one-row products (linear in rows)."""
    return _plan_with_curve((ratio - 1.0) / 4)


def test_ngram_min_n_auto_drafts_from_two_token_matches_where_verification_is_dear():
    """Where the plan measured verification dear, the default drafts only from matches of 2+
    tokens (a 1-token match is a plain step there); min_n=1 drafts from it; max_n=1 caps the
    default."""
    from refspec.models.ops import use_gemm_plan

    use_gemm_plan(_plan_with_verify_cost(3.0))
    rows = [[7, 8, 9, 1, 7, 8], [5, 3, 4, 3]]  # row 0 matches "7 8", row 1 only "3"
    auto = NgramDrafter(max_n=2, trim=False).propose(_ngram_state(rows), 4).tokens
    assert auto.tolist() == [[9, 1, 7, 8], [3, 3, 3, 3]], "row 1's 1-token match proposes nothing useful"
    assert NgramDrafter(max_n=2, trim=True).propose(_ngram_state([[5, 3, 4, 3]]), 4).tokens.shape == (1, 0)
    assert NgramDrafter(max_n=2, min_n=1, trim=True).propose(_ngram_state([[5, 3, 4, 3]]), 4).tokens.tolist() == [
        [4, 3]]
    assert NgramDrafter(max_n=1, trim=True).propose(_ngram_state([[5, 3, 4, 3]]), 4).tokens.tolist() == [[4, 3]]
    with pytest.raises(DrafterError, match="min_n"):
        NgramDrafter(max_n=2, min_n=3)


@pytest.mark.parametrize("ratio, dear", [(None, False), (1.2, False), (3.0, True)])
def test_ngram_auto_defaults_follow_the_measured_verify_cost(ratio, dear):
    """trim and min_n default from the plan's measured 5-row/1-row cost, not the device kind."""
    from refspec.models.calibration import REFERENCE
    from refspec.models.ops import use_gemm_plan

    use_gemm_plan(REFERENCE if ratio is None else _plan_with_verify_cost(ratio))
    one_token_match = NgramDrafter(max_n=2).propose(_ngram_state([[5, 3, 4, 3]]), 4).tokens.tolist()
    # cheap: it drafts from the 1-token match, cut to the continuation found; dear: the empty plain step
    assert one_token_match == ([[]] if dear else [[4, 3, 3, 3]] if ratio is None else [[4, 3]])


def test_ngram_trimming_changes_no_token_and_verifies_fewer_positions(tiny_models):
    m = tiny_models["llama"]
    prompts = _prompts(6)
    runs = {}
    for trim in (True, False):
        seen = []
        gen = Engine(m, NgramDrafter(max_n=3, trim=trim), config=EngineConfig(k=4), observers=[seen.append],
                     eos_token_ids=EOS).generate(prompts, max_new_tokens=16)
        runs[trim] = (gen, [e.work[0].tokens_per_row for e in seen if e.phase == "verify"])
    (trimmed, w_trim), (full, w_full) = runs[True], runs[False]
    assert trimmed.tokens == full.tokens
    assert set(w_full) == {5} and all(1 <= w <= 5 for w in w_trim) and min(w_trim) < 5


def test_injected_acceptance_refuses_a_trimmed_draft(tiny_models):
    from refspec.engine import GenerationError
    from refspec.eval.injection import geometric_model, make_acceptance_fn

    m = tiny_models["llama"]
    fn = make_acceptance_fn(geometric_model(0.5, 4), torch.Generator().manual_seed(0), k=4)
    with pytest.raises(GenerationError, match="trim"):
        Engine(m, NgramDrafter(trim=True), config=EngineConfig(k=4), acceptance_fn=fn).generate(
            [[20, 21, 22, 23, 24, 25]], max_new_tokens=4)


def test_a_tight_cache_holds_a_prefill_whose_bucket_exceeds_it(tiny_models):
    """max_len below the kv_bucket: prefill attends the whole cache, not a bucket beyond it."""
    m = tiny_models["llama"]
    prompts = _prompts(3)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=6)
    for drafter, k in ((None, 0), (NgramDrafter(trim=False), 3)):
        eng = Engine(m, drafter, config=EngineConfig(k=k), eos_token_ids=EOS)
        assert eng.config.kv_bucket > 40
        assert eng.generate(prompts, max_new_tokens=6, max_len=40).tokens == plain.tokens


def test_the_default_meter_is_the_time_meter(tiny_models):
    from refspec.energy.meters import TimeMeter

    seen = []
    eng = Engine(tiny_models["llama"], observers=[seen.append])
    assert isinstance(eng.meter, TimeMeter), "the meters' TimeMeter synchronises CUDA before each clock read"
    eng.generate([[5, 6, 7]], max_new_tokens=3)
    assert seen and all(e.measurement.source == "none:time-only" and e.measurement.time_s >= 0 for e in seen)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_greedy_speculative_equals_plain_under_the_packed_plan(tmp_path, drafter):
    """Through oneDNN-packed weight copies (one-row steps and multi-row verification in their
    own kernels) speculative decoding still equals plain decoding, and both equal the reference
    plan's tokens (fp32)."""
    from refspec.models import load_model
    from refspec.models.calibration import REFERENCE
    from tiny import packed_form_runs, packed_plan, save_hf

    if not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    save_hf("llama", tmp_path)
    reference = Engine(load_model(tmp_path, gemm_plan=REFERENCE), eos_token_ids=EOS).generate(
        _prompts(10), max_new_tokens=24)
    m = load_model(tmp_path, gemm_plan=packed_plan())
    assert m.weight_copy_kind == "packed"
    plain = Engine(m, eos_token_ids=EOS).generate(_prompts(10), max_new_tokens=24)
    spec = Engine(m, _drafters(m)[drafter](), config=EngineConfig(k=4), eos_token_ids=EOS).generate(
        _prompts(10), max_new_tokens=24)
    assert plain.tokens == reference.tokens and spec.tokens == plain.tokens


def test_paying_length_follows_the_measured_product_cost():
    from refspec.drafters.ngram import PositionAcceptance, paying_length

    half = [0.0, 0.5, 1.0, 1.5, 2.0]  # every matched position accepted half the time
    flat = lambda rows: 1.0  # noqa: E731  verification free: draft every matched token
    assert paying_length([3, 1, 0], 3, half, flat) == 3
    steep = lambda rows: float(rows)  # noqa: E731  every position as dear as a row: never pays
    assert paying_length([4, 4], 2, [0.0, 0.9, 1.8, 2.7, 3.6], steep) == 0
    # 2 rows, cost 1 + 0.1 per extra position: L=2 gives (2 + 2 * 1.0) / 1.4 = 2.86, L=1 2.5, L=0 2
    mild = lambda rows: 1.0 + 0.1 * (rows - 2)  # noqa: E731
    assert paying_length([2, 2], 2, half, mild) == 2
    assert paying_length([], 0, half, flat) == 0
    acc = PositionAcceptance(3)
    assert acc.gain() == [0.0, 0.5, 0.75, 0.875], "prior: position i accepted at 2^-i"
    acc.count(torch.tensor([3, 1, 0]), torch.tensor([2, 1, 0]))  # row 0: 2 of 3 accepted; row 1: 1 of 1
    assert acc.drafted.tolist() == [10.0, 9.0, 9.0] and acc.accepted.tolist() == [6.0, 3.0, 1.0]


def _plan_with_curve(per_row_s):
    from refspec.models.calibration import CURVE_ROWS, GemmPlan

    forms = {"one": "linear", "few": "linear", "many": "linear"}
    curve = {str(r): 1.0 + per_row_s * (r - 1) for r in CURVE_ROWS}
    return GemmPlan(forms={"fp32": forms}, timings_s={"fp32": {"rows": curve}}, machine={})


def test_ngram_auto_trim_drafts_what_pays_and_counts_acceptance(tiny_models):
    """trim=auto with a measured cost curve: dear rows draft nothing, cheap rows draft every
    matched token; the acceptance estimate moves with what the engine accepted; tokens equal
    plain decoding either way."""
    from refspec.models.ops import use_gemm_plan

    m = tiny_models["llama"]
    prompts = _prompts(6)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=16)
    for per_row_s, expect in ((2.0, "none"), (0.0, "some")):
        use_gemm_plan(_plan_with_curve(per_row_s))
        seen, drafter = [], NgramDrafter(max_n=3)
        gen = Engine(m, drafter, config=EngineConfig(k=4), observers=[seen.append],
                     eos_token_ids=EOS).generate(prompts, max_new_tokens=16)
        widths = [e.work[0].tokens_per_row for e in seen if e.phase == "verify"]
        assert gen.tokens == plain.tokens
        acc = drafter.acceptance
        counted = acc.accepted.sum().item() - 8.0 * (1 - 0.5 ** 4)  # less the prior
        if expect == "none":
            assert set(widths) == {1} and acc.drafted.tolist() == [8.0] * 4, "one position per row: plain steps"
        else:
            assert max(widths) > 1 and acc.drafted[0] > 8.0
            # matched tokens accepted: at most all accepted drafts (a padded position may be accepted too)
            assert 0 < counted <= sum(max(a, 0) for step in gen.accepted_per_step for a in step) + 1e-9
