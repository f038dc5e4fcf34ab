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
    from refspec.energy.meters.direct import TimeMeter

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
    from refspec.models import load_model, prepare_target
    from refspec.models.calibration import REFERENCE
    from refspec.models.cpu_speed import weight_copy_kind
    from tiny import packed_form_runs, packed_plan, save_hf

    if not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    save_hf("llama", tmp_path)
    reference = Engine(prepare_target(load_model(tmp_path), cpu_plan=REFERENCE), eos_token_ids=EOS).generate(
        _prompts(10), max_new_tokens=24)
    m = prepare_target(load_model(tmp_path), cpu_plan=packed_plan()).model
    assert weight_copy_kind(m) == "packed"
    plain = Engine(m, eos_token_ids=EOS).generate(_prompts(10), max_new_tokens=24)
    spec = Engine(m, _drafters(m)[drafter](), config=EngineConfig(k=4), eos_token_ids=EOS).generate(
        _prompts(10), max_new_tokens=24)
    assert plain.tokens == reference.tokens and spec.tokens == plain.tokens
