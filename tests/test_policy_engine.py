"""K chosen per step: every drafter stays exact whatever K a step takes (0 included).

A policy that cycles K through a pattern (0 and K below the engine's included) drives every
drafter: greedy output equals plain decoding (static batch and continuous batching with
refills), a drafter's drafts at a position do not depend on which K earlier steps took (its
state survives steps without a draft), and sampled output follows the target's law.
"""
from __future__ import annotations

import pytest
import torch

from refspec.drafters import block, draft_model, eagle, ngram
from refspec.engine import Engine, EngineConfig
from refspec.sampling import SamplingConfig
from refspec.serving import Request
from tree_stats import assert_follows_target

EOS = [2]
CHAIN = (3, 0, 1, 0, 0, 2, 3, 0, 3, 3, 0, 1)  # engine K = 3: every K, runs of K = 0, K below the engine's
TREE_K = 8


class CyclingK:
    """Takes K from ``pattern`` in turn (a test policy); records every K it chose."""

    def __init__(self, pattern, name="cycling"):
        self.pattern, self.name, self.ks = tuple(pattern), name, tuple(sorted(set(pattern)))
        self.chosen: list[int] = []

    def choose(self, view):
        k = self.pattern[len(self.chosen) % len(self.pattern)]
        self.chosen.append(k)
        return k

    def observe(self, k, accepted, slot_requests):
        pass


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30, 9, 12, 3, 25, 7, 2][:n]
    ps = [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]
    ps[1] = ps[1][:6] * 3  # a repetitive prompt gives the n-gram drafter matches
    return ps


def _drafter(name, m):
    """(drafter, engine K, cycling pattern) for each drafter kind, on random-weight heads."""
    torch.manual_seed(0)
    tree = eagle.TreeConfig(topk=3, depth=3, budget=TREE_K)
    heads = {kind: eagle.new_head(eagle.HeadConfig.for_target(kind, m.args)) for kind in ("eagle", "eagle3")}
    block_head = block.BlockHead(m.args, block.BlockHeadConfig(
        feature_layers=block.default_feature_layers(m.num_layers), block_size=4, num_layers=1))
    return {
        "ngram": lambda: (ngram.NgramDrafter(max_n=3), 3, CHAIN),
        "draft-model": lambda: (draft_model.DraftModelDrafter(m.truncated(1), target_vocab_size=96), 3, CHAIN),
        "eagle": lambda: (eagle.EagleDrafter(heads["eagle"].to(m.device), m), 3, CHAIN),
        "eagle3": lambda: (eagle.EagleDrafter(heads["eagle3"].to(m.device), m), 3, CHAIN),
        "eagle-tree": lambda: (eagle.EagleDrafter(heads["eagle"], m, tree=tree), TREE_K,
                               tuple(TREE_K if k else 0 for k in CHAIN)),
        "block": lambda: (block.BlockDrafter(block_head, m), 3, CHAIN),
    }[name]()


DRAFTERS = ["ngram", "draft-model", "eagle", "eagle3", "eagle-tree", "block"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_output_equals_plain_whatever_k_each_step_takes(tiny_models, family, name):
    m = tiny_models[family]
    prompts = _prompts(6)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=24)
    drafter, k, pattern = _drafter(name, m)
    policy = CyclingK(pattern)
    spec = Engine(m, drafter, config=EngineConfig(k=k), policy=policy, eos_token_ids=EOS).generate(
        prompts, max_new_tokens=24)
    assert spec.tokens == plain.tokens, f"{family}/{name}: cycling K changed the output"
    assert {0, k} <= set(policy.chosen), "the run took K = 0 and the engine's K"
    ks = [e.k for e in spec.events if e.phase == "verify"]
    assert ks == policy.chosen, "each step's event records the K the policy chose"
    verified = [e.work[-1].tokens_per_row for e in spec.events if e.phase == "verify"]
    assert verified == [kk + 1 for kk in ks], "a step verifies the pending token and the K drafts it chose"


@pytest.mark.parametrize("name", DRAFTERS)
def test_continuous_batching_with_refills_stays_exact(tiny_models, name):
    """Refilled slots (reset_rows) between steps without drafts: each request's output equals
    plain decoding of it."""
    m = tiny_models["llama"]
    prompts = _prompts(10, seed=3)
    reqs = [Request(id=i, prompt=tuple(p), max_new_tokens=6 + 3 * (i % 4)) for i, p in enumerate(prompts)]
    plain = Engine(m, eos_token_ids=EOS).serve(reqs, batch=3)
    drafter, k, pattern = _drafter(name, m)
    spec = Engine(m, drafter, config=EngineConfig(k=k), policy=CyclingK(pattern), eos_token_ids=EOS).serve(
        reqs, batch=3)
    assert [r.tokens for r in spec.requests] == [r.tokens for r in plain.requests]


class _Recording:
    """Wraps a drafter and records, by each row's committed length, the step's K and the row's
    first draft: its token, or for a draft model the logits it came from (one wrong key in a
    one-layer draft model's cache rarely flips a token, never the logits)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, {}
        self.name, self.hidden_layers = inner.name, inner.hidden_layers
        self._logits = None
        if hasattr(inner, "_next"):
            real = inner._next

            def spy(logits, state):
                if self._logits is None:
                    self._logits = logits.clone()
                return real(logits, state)

            inner._next = spy

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def propose(self, state, k):
        self._logits = None
        draft = self.inner.propose(state, k)
        for row, (length, done) in enumerate(zip(state.lengths.tolist(), state.done.tolist())):
            if not done:
                first = draft.tokens[row, :1] if self._logits is None else self._logits[row]
                self.seen[(row, length)] = (k, first)
        return draft

    def commit(self, state):
        self.inner.commit(state)

    def reset(self, state):
        self.inner.reset(state)


@pytest.mark.parametrize("name", ["draft-model", "eagle", "eagle3", "block"])
def test_drafts_at_a_position_do_not_depend_on_earlier_ks(tiny_models, name):
    """The drafter's state after steps without drafts equals its state after drafting every
    step: at every (row, length) both runs reach with the same K (a block head's drafts depend on
    K), the first drafts agree. Without catching up the skipped steps' features the head reads
    stale cache entries and they disagree."""
    m = tiny_models["llama"]
    prompts = _prompts(10, seed=1)
    runs = []
    for pattern in ((3,), CHAIN):
        drafter, k, _ = _drafter(name, m)
        rec = _Recording(drafter)
        Engine(m, rec, config=EngineConfig(k=k), policy=CyclingK(pattern), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=48)
        runs.append(rec.seen)
    fixed, cycling = runs
    common = [key for key in cycling if key in fixed and cycling[key][0] == fixed[key][0]]
    assert len(common) >= 20, "the runs share enough positions to compare"
    differ = [key for key in common if not torch.allclose(cycling[key][1], fixed[key][1], atol=1e-4)]
    assert not differ, f"{name}: first drafts differ at {len(differ)} of {len(common)} (row, length) pairs"


def test_a_backlog_past_its_limit_is_fed_in_commit(tiny_models):
    """A long run of K = 0 steps (more than the backlog's limit) is fed in ``commit``: drafts
    after it still match drafting every step."""
    m = tiny_models["llama"]
    prompts = _prompts(4, seed=2)
    runs = []
    for pattern in ((3,), (3,) + (0,) * 7):
        drafter, k, _ = _drafter("eagle", m)
        drafter._backlog.limit = 4
        rec = _Recording(drafter)
        Engine(m, rec, config=EngineConfig(k=k), policy=CyclingK(pattern), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=40)
        runs.append(rec.seen)
    common = [key for key in runs[1] if key in runs[0]]
    assert common and all(torch.equal(runs[0][key][1], runs[1][key][1]) for key in common)


WARPED = SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)


@pytest.mark.parametrize("name", ["draft-model", "eagle", "block"])
def test_sampling_stays_lossless_whatever_k_each_step_takes(tiny_models, name):
    """The first three tokens' joint law (seeded chi-square, alpha 1e-3): the 2nd comes from a
    step without drafts, the 3rd from a drafting step right after it."""
    m = tiny_models["llama"]
    drafter, k, _ = _drafter(name, m)
    gen = Engine(m, drafter, config=EngineConfig(k=k, sampling=WARPED), policy=CyclingK((0, 3, 1))).generate(
        [[5, 9, 11, 4]] * 2000, max_new_tokens=3, generator=torch.Generator().manual_seed(5))
    assert_follows_target(m, [5, 9, 11, 4], gen.tokens, WARPED)


@pytest.mark.parametrize("name", ["eagle", "block"])
def test_static_shape_runner_holds_one_step_shape_per_k(tiny_models, name):
    """Through the CUDA-graph runner's static-shape path (eager here, captured on a GPU): output
    equals plain decoding, and the verify shapes are one per K (times the key buckets reached)."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.models import PreparedTarget

    m = tiny_models["llama"]
    prompts = _prompts(4, seed=4)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=20)
    runner = GraphRunner(m, capture=False, keys_bucket=512)
    drafter, k, pattern = _drafter(name, m)
    spec = Engine(PreparedTarget(m, step=runner), drafter, config=EngineConfig(k=k), policy=CyclingK(pattern),
                  eos_token_ids=EOS).generate(prompts, max_new_tokens=20)
    assert spec.tokens == plain.tokens
    assert {key.tokens_per_row for key in runner._entries} == {kk + 1 for kk in set(pattern)}
    assert runner.num_keys_prepared == len(set(pattern)), "one shape (one graph on a GPU) per K"
