"""Lossless tree sampling: the verify function's output distribution enumerated exactly, seeded
chi-square tests through the engine, and the one warp every sampling path shares."""
import itertools

import pytest
import torch

from refspec.drafting import DecodeState, Draft, DraftTree
from refspec.engine import Engine, EngineConfig
from refspec.sampling import SamplingConfig, probs_from_logits
from refspec.verify import recovery_distribution
from refspec.verify_tree import tree_greedy_accept, tree_path, tree_rejection_walk, tree_speculative_sample
from tree_stats import assert_follows_target

F64 = torch.float64
FLAT = [0, 0, 0]  # block index of each node's parent: the root with three children
DEEP = [0, 0, 1, 1, 2]  # root -> a, b; a -> c, d; b -> e
WIDE = [0, 0, 0, 1, 1, 2, 3]  # root -> a, b, c; a -> d, e; b -> f; c -> g


# ---- exact enumeration ------------------------------------------------------------------------


def _tables(v, seed, zeros=False):
    """Target laws p0 [V], p1 [V, V] (after y1), p2 [V, V, V] and draft laws q0 [V], q1 [V, V]."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape):
        return torch.softmax(torch.randn(*shape, v, generator=g, dtype=F64) * 2, -1)

    p0, p1, p2, q0, q1 = dist(), dist(v), dist(v, v), dist(), dist(v)
    if zeros:  # a top-k target: every depth-0 and depth-1 law loses its least likely token
        for p in (p0, p1):
            p.scatter_(-1, p.argmin(-1, keepdim=True), 0.0)
            p /= p.sum(-1, keepdim=True)
    return p0, p1, p2, q0, q1


def _assignments(parents, q0, q1, mode):
    """Every token assignment of a depth <= 2 tree drawn by ``mode`` (``iid`` or ``without``
    replacement among siblings), with its probability, each node's conditional law (the q the
    rule needs) and its unconditional law (the q a careless drafter would report)."""
    v = q0.shape[0]
    toks, weights, laws, plain = [], [], [], []
    for assign in itertools.product(range(v), repeat=len(parents)):
        w, cond, unc = 1.0, [], []
        for j, x in enumerate(assign):
            par = parents[j]
            assert par == 0 or parents[par - 1] == 0, "depth <= 2"
            law = (q0 if par == 0 else q1[assign[par - 1]]).clone()
            unc.append(law.clone())
            if mode == "without":
                law[[assign[i] for i in range(j) if parents[i] == par]] = 0
                law = law / law.sum()
            w *= float(law[x])
            cond.append(law)
        if w > 0:
            toks.append(assign), weights.append(w), laws.append(torch.stack(cond)), plain.append(torch.stack(unc))
    return torch.tensor(toks), torch.tensor(weights, dtype=F64), torch.stack(laws), torch.stack(plain)


def _joint_first_two(parents, tokens, weights, probs, p0, p1, p2):
    """``[V, V]`` law of the first two emitted tokens, every outcome enumerated.

    Rows are (token assignment, acceptance draws in {0, 1}^N): a draw of 0 accepts a tried node
    iff its acceptance probability is positive, 1 always rejects; the row's weight multiplies the
    assignment's probability by ``a`` or ``1 - a`` per tried node (untried nodes count once).
    The recovered / bonus token is integrated through the residual. When nothing is accepted
    the second token comes from the next step, which emits from ``p1[y1]`` by this same property.
    """
    n, v = len(parents), p0.shape[0]
    draws = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), dtype=F64)  # [2^N, N]
    m, rows = draws.shape[0], tokens.shape[0] * draws.shape[0]
    tok = tokens.repeat_interleave(m, 0)  # [R, N]
    u = draws.repeat(tokens.shape[0], 1)
    par = torch.tensor(parents).expand(rows, n)
    target = torch.empty(rows, n + 1, v, dtype=F64)
    target[:, 0] = p0
    for j, pj in enumerate(parents):
        target[:, j + 1] = p1[tok[:, j]] if pj == 0 else p2[tok[:, pj - 1], tok[:, j]]
    walk = tree_rejection_walk(tok, par, None if probs is None else probs.repeat_interleave(m, 0), target, u)
    step = torch.where(u == 0, walk.accept_prob, 1 - walk.accept_prob)
    w = weights.repeat_interleave(m) * torch.where(walk.tried, step, (u == 0).to(F64)).prod(1)
    path = tree_path(walk.node, walk.num_accepted, par, 2)
    t1, t2 = (torch.nn.functional.one_hot(tok.gather(1, (path[:, d:d + 1] - 1).clamp_min(0))[:, 0], v).to(F64)
              for d in (1, 2))
    r, acc = walk.residual, walk.num_accepted[:, None, None]
    per = torch.where(acc == 0, r[:, :, None] * p1[None], torch.where(acc == 1, t1[:, :, None] * r[:, None],
                                                                        t1[:, :, None] * t2[:, None]))
    return (w[:, None, None] * per).sum(0)


def _target_joint(p0, p1):
    return p0[:, None] * p1


@pytest.mark.parametrize("v", [3, 4, 5])
@pytest.mark.parametrize("zeros", [False, True], ids=["full", "top-k"])
@pytest.mark.parametrize("tokens", [[2, 0, 1], [1, 1, 0], [0, 2, 2]], ids=["distinct", "dup-first", "dup-last"])
def test_fixed_children_one_level_emit_the_target_exactly(v, zeros, tokens):
    p0, p1, p2, _, _ = _tables(v, seed=v + 10 * zeros)
    got = _joint_first_two(FLAT, torch.tensor([tokens]), torch.ones(1, dtype=F64), None, p0, p1, p2)
    torch.testing.assert_close(got, _target_joint(p0, p1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("v", [3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_children_two_levels_emit_the_target_exactly(v, seed):
    p0, p1, p2, _, _ = _tables(v, seed=seed, zeros=seed == 2)
    tokens = torch.randint(v, (1, len(WIDE)), generator=torch.Generator().manual_seed(seed))  # duplicates allowed
    got = _joint_first_two(WIDE, tokens, torch.ones(1, dtype=F64), None, p0, p1, p2)
    torch.testing.assert_close(got, _target_joint(p0, p1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", ["iid", "without"])
@pytest.mark.parametrize("v,zeros", [(3, False), (4, False), (4, True)])
def test_sampled_children_with_their_laws_emit_the_target_exactly(mode, v, zeros):
    p0, p1, p2, q0, q1 = _tables(v, seed=v, zeros=zeros)
    tokens, weights, laws, _ = _assignments(DEEP, q0, q1, mode)
    assert abs(float(weights.sum()) - 1) < 1e-12, "the enumeration covers every draft"
    got = _joint_first_two(DEEP, tokens, weights, laws, p0, p1, p2)
    torch.testing.assert_close(got, _target_joint(p0, p1), atol=1e-6, rtol=0)
    # sampled children verified as fixed ones (probs None) stay exact, only accepted less often
    got_fixed = _joint_first_two(DEEP, tokens, weights, None, p0, p1, p2)
    torch.testing.assert_close(got_fixed, _target_joint(p0, p1), atol=1e-6, rtol=0)


def test_draws_without_replacement_verified_with_the_unconditional_law_are_biased():
    """The enumeration can fail: reporting q instead of q without the earlier siblings is wrong."""
    p0, p1, p2, q0, q1 = _tables(4, seed=4)
    tokens, weights, _, plain = _assignments(DEEP, q0, q1, "without")
    got = _joint_first_two(DEEP, tokens, weights, plain, p0, p1, p2)
    assert (got - _target_joint(p0, p1)).abs().max() > 1e-3


def test_with_q_children_are_accepted_more_often_than_as_fixed_tokens():
    p0, p1, p2, q0, q1 = _tables(4, seed=5)
    tokens, weights, laws, _ = _assignments(FLAT, q0, q1, "without")
    target = torch.cat([p0.expand(len(tokens), 1, 4), p1[tokens]], 1)
    par = torch.zeros_like(tokens)
    u = torch.full(tokens.shape, 0.5, dtype=F64)  # the acceptance probabilities do not depend on u
    reach_with_q = tree_rejection_walk(tokens, par, laws, target, u)
    reach_fixed = tree_rejection_walk(tokens, par, None, target, u)

    def accept_mass(walk):  # P(some child accepted) = 1 - prod over tried children of (1 - a)
        return float((weights * (1 - (1 - walk.accept_prob).prod(1))).sum())
    assert accept_mass(reach_with_q) > accept_mass(reach_fixed)


# ---- consistency with the chain and the greedy tree ---------------------------------------------


def test_a_single_child_chain_is_the_chain_rule():
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 3, 6
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    draft = torch.multinomial(q.reshape(b * k, v), 1, generator=g).reshape(b, k)
    u = torch.rand(b, k, generator=g)
    walk = tree_rejection_walk(draft, torch.arange(k).expand(b, k), q, p, u)
    accept = (u < (p[:, :k].gather(2, draft[..., None]) / q.gather(2, draft[..., None])).squeeze(2)).long()
    num = accept.cumprod(1).sum(1)
    assert torch.equal(walk.num_accepted, num)
    want = recovery_distribution(p, q).gather(1, num[:, None, None].expand(b, 1, v))[:, 0]
    torch.testing.assert_close(walk.residual, want)


def test_a_one_hot_target_samples_the_greedy_tree():
    """top-k = 1 makes p the argmax: sampled verification then accepts what greedy accepts."""
    g = torch.Generator().manual_seed(1)
    parents = torch.tensor([[0, 0, 1, 1, 2, 3, 3, 5, 0]])
    depth = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 3, 1]])
    for _ in range(40):
        tokens = torch.randperm(12, generator=g)[:9][None]  # distinct, so siblings differ
        logits = torch.randn(1, 10, 12, generator=g)
        for blk in (0, 1, 3):  # make deep paths likely
            if torch.rand(1, generator=g) < 0.8:
                child = int(torch.nonzero(parents[0] == blk)[0]) if (parents[0] == blk).any() else None
                if child is not None:
                    logits[0, blk, tokens[0, child]] = 9
        p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=1))
        acc, path = tree_speculative_sample(tokens, parents, depth, None, p, g)
        want, want_path = tree_greedy_accept(tokens, parents, depth, logits)
        assert torch.equal(acc.num_accepted, want.num_accepted) and torch.equal(acc.next_token, want.next_token)
        assert torch.equal(path, want_path)


# ---- through the engine -------------------------------------------------------------------------

PROMPT = [5, 9, 11, 4]
ROWS = 2000
FULL = SamplingConfig(temperature=1.0)
WARPED = SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)
ENGINE_TREE = [0, 0, 0, 1, 1, 2, 4]  # root -> a, b, c; a -> d, e; b -> f; d -> g


class SampledTreeDrafter:
    """A tree drafter that knows the target up to noise: node law q(. | path) is the warp of the
    target's logits after the path plus a fixed random bigram table (so q != p); children are
    drawn without replacement (``probs``: each child's conditional law) or are the best children
    in order (``sample=False``: deterministic, ``probs`` None)."""

    name = "sampled-tree"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, model, parents: list[int], *, sample: bool, noise: float = 0.1, seed: int = 0,
                 careless: bool = False) -> None:
        v = model.args.vocab_size
        self.model = model
        self.table = torch.randn(v, v, generator=torch.Generator().manual_seed(seed)) * noise  # [V, V]
        self.parents = parents
        self.depth = []
        for par in parents:
            self.depth.append(1 if par == 0 else self.depth[par - 1] + 1)
        self.sample = sample
        self.careless = careless  # report q itself, not q without the earlier siblings (a wrong law)

    def reset(self, state: DecodeState) -> None:
        return None

    def commit(self, state: DecodeState) -> None:
        return None

    def _logits_after(self, state: DecodeState, tokens: torch.Tensor, block: int) -> torch.Tensor:
        """``[B, V]`` target logits after the pending token and the path to ``block``."""
        path = []
        while block:
            path.insert(0, block)
            block = self.parents[block - 1]
        seq = state.tokens.clone()  # [B, T]; rows are ragged, so the path goes right after each row's pending token
        for d, blk in enumerate(path):
            seq.scatter_(1, (state.lengths + 1 + d)[:, None], tokens[:, blk - 1:blk])
        b, w = seq.shape[0], state.max_length_bound + len(path)
        logits, _ = self.model(seq[:, :w], torch.arange(w)[None].expand(b, w), self.model.new_cache(b, w),
                               logits_at=(state.lengths + len(path))[:, None])
        return logits[:, 0]

    def propose(self, state: DecodeState, k: int) -> Draft:
        b, n, v = state.batch, len(self.parents), self.table.shape[0]
        tokens = torch.zeros(b, n, dtype=torch.long)
        probs = torch.zeros(b, n, v)
        laws: dict[int, torch.Tensor] = {}  # per parent block, q before removing siblings
        for j, par in enumerate(self.parents):
            parent_tok = state.pending if par == 0 else tokens[:, par - 1]
            if par not in laws:
                logits = self._logits_after(state, tokens, par) + self.table[parent_tok]
                laws[par] = probs_from_logits(logits, state.sampling)  # [B, V]
            q = laws[par]
            free = torch.ones(b, v)
            for i in (i for i in range(j) if self.parents[i] == par):  # earlier siblings are excluded
                q, free = q.scatter(1, tokens[:, i:i + 1], 0.0), free.scatter(1, tokens[:, i:i + 1], 0.0)
            mass = q.sum(-1, keepdim=True)
            # a warp whose support is used up: draw uniformly among the tokens left
            q = torch.where(mass > 0, q / mass.clamp_min(1e-30), free / free.sum(-1, keepdim=True))
            tokens[:, j] = torch.multinomial(q, 1, generator=state.generator)[:, 0] if self.sample else q.argmax(-1)
            probs[:, j] = laws[par] if self.careless else q
        tree = DraftTree(parents=torch.tensor(self.parents).expand(b, n), depth=torch.tensor(self.depth).expand(b, n),
                         max_depth=max(self.depth))
        return Draft(tokens=tokens, probs=probs if self.sample else None, tree=tree)


@pytest.mark.parametrize("cfg", [FULL, WARPED], ids=["t1", "warped"])
@pytest.mark.parametrize("sample", [True, False], ids=["q-without-replacement", "top-children"])
def test_engine_tree_sampling_follows_the_target(tiny_models, cfg, sample):
    """Seeded chi-square (``tree_stats.assert_follows_target``): a correct sampler fails each test
    with probability alpha = 1e-3 over seeds, so this one at most 2e-3 (two tests at T = 1) or
    1e-3 (warped); the fixed seed makes the outcome reproducible."""
    m = tiny_models["llama"]
    drafter = SampledTreeDrafter(m, ENGINE_TREE, sample=sample)
    gen = Engine(m, drafter, config=EngineConfig(k=len(ENGINE_TREE), sampling=cfg)).generate(
        [PROMPT] * ROWS, max_new_tokens=3, generator=torch.Generator().manual_seed(17))
    first = torch.tensor(gen.accepted_per_step[0])
    # a near-uniform target at T = 1 accepts a fixed child with probability p(x) ~ 1/V: fewer bites there
    assert (first >= 2).sum() >= (2 if cfg == FULL and not sample else 300), "paths past depth 1 must be accepted"
    assert_follows_target(m, PROMPT, gen.tokens, cfg)


def test_engine_chi_square_rejects_a_wrong_draft_law(tiny_models):
    """The engine test can fail: children drawn without replacement but reported with their
    unconditional q bias the output, and the same chi-square rejects it."""
    m = tiny_models["llama"]
    drafter = SampledTreeDrafter(m, ENGINE_TREE, sample=True, careless=True, noise=3.0)
    gen = Engine(m, drafter, config=EngineConfig(k=len(ENGINE_TREE), sampling=WARPED)).generate(
        [PROMPT] * ROWS, max_new_tokens=3, generator=torch.Generator().manual_seed(17))
    with pytest.raises(AssertionError, match="do not follow the target"):
        assert_follows_target(m, PROMPT, gen.tokens, WARPED)


# ---- one warp for p and q -----------------------------------------------------------------------


def _warp_drafter(name, m):
    """(drafter, module whose probs_from_logits it calls or None, k) for each sampling drafter."""
    import sys

    from refspec.drafters import block, draft_model, eagle, ngram

    eagle_head = eagle.new_head(eagle.HeadConfig.for_target("eagle", m.args))
    return {
        "ngram": lambda: (ngram.NgramDrafter(max_n=2, min_n=1, trim=False), None, 3),
        "draft-model": lambda: (draft_model.DraftModelDrafter(m.truncated(1), target_vocab_size=96), draft_model, 3),
        "block": lambda: (block.BlockDrafter(block.BlockHead(m.args, block.BlockHeadConfig(
            feature_layers=block.default_feature_layers(m.num_layers), block_size=4, num_layers=1)), m), block, 3),
        "eagle-chain": lambda: (eagle.EagleDrafter(eagle_head, m), eagle, 3),
        "eagle-tree": lambda: (eagle.EagleDrafter(eagle_head, m, tree=eagle.TreeConfig(topk=3, depth=3, budget=8)),
                               eagle, 4),
        "sampled-tree": lambda: (SampledTreeDrafter(m, ENGINE_TREE, sample=True), sys.modules[__name__], 7),
    }[name]()


@pytest.mark.parametrize("name", ["ngram", "draft-model", "block", "eagle-chain", "eagle-tree", "sampled-tree"])
def test_every_sampling_path_warps_p_and_q_with_the_engines_config(tiny_models, monkeypatch, name):
    """The target's p (engine) and the drafter's q come from the one ``probs_from_logits`` called
    with the engine's sampling config; chain q rows keep at most top_k tokens."""
    import refspec.step as engine_module  # the engine's verify step warps the target's p

    m = tiny_models["llama"]
    torch.manual_seed(0)
    drafter, module, k = _warp_drafter(name, m)
    cfg = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    seen: dict[str, list] = {"target": [], "drafter": []}

    from refspec.sampling import probs_from_logits as real_warp  # this module's name is patched too

    def spy(who):
        def warp(logits, config):
            seen[who].append(config)
            return real_warp(logits, config)
        return warp

    monkeypatch.setattr(engine_module, "probs_from_logits", spy("target"))
    if module is not None:
        monkeypatch.setattr(module, "probs_from_logits", spy("drafter"))
    drafts = []
    real = drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda state, kk: drafts.append(real(state, kk)) or drafts[-1])
    gen = Engine(m, drafter, config=EngineConfig(k=k, sampling=cfg)).generate(
        [[5, 9, 11, 4, 5, 9], [7, 3, 8]], max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 6 for t in gen.tokens)
    assert seen["target"] and all(c == cfg for c in seen["target"] + seen["drafter"])
    assert bool(seen["drafter"]) == (module is not None), "a drafter that samples warps its q with the same config"
    for d in drafts:
        if d.probs is not None and d.tree is None:
            assert bool(((d.probs > 0).sum(-1) <= cfg.top_k).all()), "q is top-k warped"
