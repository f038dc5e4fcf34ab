"""EAGLE heads: tree verification, head cache consistency, greedy and sampled losslessness,
checkpoints (published layouts: ``test_eagle_layouts.py``).

The fast tier trains tiny heads for a few seconds on a tiny llama target's own greedy
outputs; the real tier (``-m real``) uses the shipped SmolLM2 heads.
"""
import json

import pytest
import torch

from refspec.cache import tree_mask
from refspec.drafters import registry
from refspec.drafters import training as T
from refspec.drafters.eagle import EagleDrafter, TreeConfig, find_head, load_head, save_head
from refspec.drafting import DecodeState, DrafterError
from refspec.engine import Engine, EngineConfig
from refspec.sampling import SamplingConfig
from refspec.verify import greedy_accept
from refspec.verify_tree import tree_ancestors, tree_greedy_accept
from tree_stats import assert_follows_target

EOS = [2]
TREE = TreeConfig(topk=3, depth=4, budget=10)


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30, 9, 12, 3, 25][:n]
    return [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Tiny eagle and eagle3 heads trained for a few seconds on the target's own greedy text."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (int(torch.randint(1, 31, (1,), generator=g)),), generator=g).tolist()
               for _ in range(64)]
    seqs = T.self_distill(target, prompts, max_new_tokens=48, batch_size=64, eos_token_ids=EOS, progress=False)
    trainers = T.load_trainers()
    out = {}
    for kind, opts in (("eagle", {"ce_fraction": 1.0}), ("eagle3", {"draft_vocab_size": 80, "ttt_steps": 2})):
        tr = trainers[kind]
        ds = T.collect_features(target, seqs, tr.feature_layers(target), progress=False)
        d = tmp_path_factory.mktemp(kind)
        res = T.train(tr, target, ds, T.TrainConfig(steps=100, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=10,
                                                    checkpoint_every=0, log_every=10), d, options=opts,
                      progress=False)
        out[kind] = (load_head(d, target.args)[0], d, res)
    return out


# ---- trees: mask, verification, compaction ------------------------------------------------------


def _random_tree(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long)] +
                                     [torch.randint(0, j + 1, (1,), generator=g) for j in range(1, n)])
                           for _ in range(b)])  # node j's parent is a block index <= j
    depth = torch.zeros(b, n, dtype=torch.long)
    for j in range(n):
        par = parents[:, j]
        depth[:, j] = torch.where(par == 0, torch.ones_like(par), depth.gather(1, (par - 1).clamp_min(0)[:, None])[:, 0] + 1)
    return parents, depth


def _path(parents, b, node):
    """Block indices from the root to ``node`` (block index)."""
    out = [node]
    while out[-1] != 0:
        out.append(int(parents[b, out[-1] - 1]))
    return out[::-1]


def test_tree_mask_shows_each_node_exactly_its_ancestors_and_the_prefix():
    parents, depth = _random_tree(2, 9, seed=3)
    base = torch.tensor([4, 7])
    anc = tree_ancestors(parents)
    depth0 = torch.cat([torch.zeros(2, 1, dtype=torch.long), depth], 1)
    mask = tree_mask(base, anc, base[:, None] + depth0, num_keys=24)[:, 0]  # [B, N+1, Tk]
    for b in range(2):
        for i in range(10):
            seen = {s for s in range(24) if mask[b, i, s]}
            want = set(range(int(base[b]))) | {int(base[b]) + a for a in _path(parents, b, i)}
            assert seen == want, f"row {b} node {i}: sees {sorted(seen)}, expected {sorted(want)}"


def test_tree_verification_equals_verifying_every_path_separately(target):
    """One forward over the tree with its mask gives each node the logits of its own path."""
    m = target
    b, n = 2, 9
    parents, depth = _random_tree(b, n, seed=5)
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 96, (b, 6), generator=g)
    block = torch.randint(3, 96, (b, n + 1), generator=g)  # root (pending) + nodes
    cache = m.new_cache(b, 32)
    m(prefix, torch.arange(6)[None].expand(b, 6), cache)
    base = torch.full((b,), 6)
    anc = tree_ancestors(parents)
    pos = base[:, None] + torch.cat([torch.zeros(b, 1, dtype=torch.long), depth], 1)
    slots = base[:, None] + torch.arange(n + 1)
    tree_logits, _ = m(block, pos, cache, slots=slots, mask=tree_mask(base, anc, pos, 32), num_keys=32)
    for row in range(b):
        for node in range(n + 1):
            path = _path(parents, row, node)
            seq = torch.cat([prefix[row], block[row, path]])[None]
            chain_logits, _ = m(seq, torch.arange(seq.shape[1])[None], m.new_cache(1, 32))
            torch.testing.assert_close(tree_logits[row, node], chain_logits[0, -1], atol=1e-4, rtol=1e-4)
    # and greedy acceptance over the tree is the best chain acceptance over its root-to-leaf paths
    drafts = block[:, 1:]
    acc, path = tree_greedy_accept(drafts, parents, depth, tree_logits)
    for row in range(b):
        leaves = [j for j in range(1, n + 1) if j not in parents[row].tolist()]
        best = []
        for leaf in leaves:
            p = _path(parents, row, leaf)
            chain = greedy_accept(block[row, p[1:]][None], tree_logits[row, p][None])
            best.append(int(chain.num_accepted))
        assert int(acc.num_accepted[row]) == max(best)
        k = int(acc.num_accepted[row])
        assert tree_logits[row, path[row, k]].argmax() == acc.next_token[row]


def test_compaction_keeps_the_accepted_paths_kv_entries(target):
    m = target
    parents, depth = _random_tree(1, 7, seed=11)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 96, (1, 5), generator=g)
    block = torch.randint(3, 96, (1, 8), generator=g)
    cache = m.new_cache(1, 24)
    m(prefix, torch.arange(5)[None], cache)
    base = torch.tensor([5])
    pos = base[:, None] + torch.cat([torch.zeros(1, 1, dtype=torch.long), depth], 1)
    m(block, pos, cache, slots=base[:, None] + torch.arange(8),
      mask=tree_mask(base, tree_ancestors(parents), pos, 24), num_keys=24)
    deepest = int(depth.argmax()) + 1
    path = _path(parents, 0, deepest)
    src = base[:, None] + torch.tensor(path[1:])[None]
    dst = base[:, None] + 1 + torch.arange(len(path) - 1)[None]
    cache.compact(src, dst)
    ref = m.new_cache(1, 24)
    m(torch.cat([prefix[0], block[0, path]])[None], torch.arange(5 + len(path))[None], ref)
    n = 5 + len(path)
    torch.testing.assert_close(cache.k[:, :, :, :n], ref.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, :n], ref.v[:, :, :, :n], atol=1e-5, rtol=1e-5)


# ---- losslessness and cache consistency ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_greedy_eagle_equals_plain_decoding(target, heads, kind, tree):
    head = heads[kind][0]
    prompts = _prompts(8)
    plain = Engine(target, eos_token_ids=EOS).generate(prompts, max_new_tokens=40)
    for batch in (prompts[:1], prompts):
        spec = Engine(target, EagleDrafter(head, target, tree=tree), config=EngineConfig(k=4),
                      eos_token_ids=EOS).generate(batch, max_new_tokens=40)
        for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)):
            assert a == b, f"{kind}/{'tree' if tree else 'chain'} row {i} (batch {len(batch)}): {b} != {a}"
    assert spec.tau > 1.4, f"a trained head should be accepted often on the target's own loops (tau {spec.tau:.2f})"


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_unroll_predicts_what_the_chain_drafter_drafts(target, heads, kind):
    """Training-time test is laid out as drafting is: on the sequence prompt + pending + the chain's
    own drafts, unrolled step j at the last prompt position gives the chain's draft j + 1."""
    head = heads[kind][0]
    drafter = EagleDrafter(head, target)
    got = []
    real = drafter.propose
    drafter.propose = lambda state, k: got.append((state.tokens.clone(), real(state, k))) or got[-1][1]
    prompt = _prompts(4)[3]
    Engine(target, drafter, config=EngineConfig(k=4), eos_token_ids=EOS).generate([prompt], max_new_tokens=6)
    tokens, draft = got[0]
    n = len(prompt)
    seq = torch.tensor([prompt + [int(tokens[0, n])] + draft.tokens[0].tolist()])  # [1, n + 1 + K]
    with torch.no_grad():
        _, feats = target(seq, torch.arange(seq.shape[1])[None], target.new_cache(1, seq.shape[1]),
                          logits_at=seq[:, :0], hidden_layers=head.config.feature_layers)
        h0 = head.prepare([f.to(head.dtype) for f in feats])
        outs = head.unroll(lambda t: target.embed_tokens(t).to(head.dtype), seq, h0, 4)
        unrolled = [int(head.to_target_ids(head.draft_logits(o[0, n - 1], target).argmax(-1))) for o in outs]
    assert unrolled == draft.tokens[0].tolist()


class _Recorder:
    """Wraps a drafter and keeps the engine's state of the last commit."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.hidden_layers, self.extra_slots = inner.name, inner.hidden_layers, inner.extra_slots
        self.state = None

    def reset(self, state):
        self.inner.reset(state)

    def propose(self, state, k):
        return self.inner.propose(state, k)

    def commit(self, state):
        self.state = state
        self.inner.commit(state)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_cache_after_tree_steps_holds_exactly_the_accepted_sequence(target, heads, kind):
    """After tree steps and the next catch-up, the head's cache equals a fresh head prefill over the
    committed sequence: rejected branches left nothing behind."""
    head = heads[kind][0]
    rec = _Recorder(EagleDrafter(head, target, tree=TREE))
    prompts = _prompts(4, seed=3)
    Engine(target, rec, config=EngineConfig(k=4, max_steps=6), eos_token_ids=[]).generate(prompts, max_new_tokens=60)
    state = rec.state
    assert int(state.num_accepted.max()) >= 1, "some drafts must have been accepted for this test to bite"
    rec.inner.propose(state, 4)  # runs the catch-up of the last step
    lengths = state.lengths.tolist()
    for row, n in enumerate(lengths):
        toks = state.tokens[row: row + 1, : n + 1]
        _, hidden = target(toks, torch.arange(n + 1)[None], target.new_cache(1, n + 1),
                           hidden_layers=rec.hidden_layers)
        fresh = EagleDrafter(head, target)
        fresh_state = DecodeState(tokens=state.tokens[row: row + 1], lengths=torch.tensor([n]),
                                  prev_lengths=torch.tensor([0]), pending=state.tokens[row: row + 1, n],
                                  prompt_lengths=torch.tensor([n]), done=torch.tensor([False]),
                                  hidden=[h[:, :n] for h in hidden], num_accepted=torch.tensor([0]),
                                  sampling=SamplingConfig(), generator=None, step=0, max_length_bound=n + 1,
                                  target_args=target.args, dtype_bytes=4)
        fresh.reset(fresh_state)
        got = rec.inner.cache.k[0, row, :, :n]
        want = fresh.cache.k[0, 0, :, :n]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"row {row}: head cache is not the sequence's")


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_sampled_drafting_runs_and_respects_the_budget(target, heads, tree):
    head = heads["eagle3"][0]
    gen = torch.Generator().manual_seed(0)
    out = Engine(target, EagleDrafter(head, target, tree=tree),
                 config=EngineConfig(k=3, sampling=SamplingConfig(temperature=1.0)),
                 eos_token_ids=EOS).generate(_prompts(4), max_new_tokens=20, generator=gen)
    assert all(1 <= len(t) <= 20 for t in out.tokens)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_sampling_with_a_one_hot_target_equals_greedy_decoding(target, heads, kind):
    """top_k = 1 makes the warped target its argmax: the sampled tree path must decode exactly
    what plain greedy decoding does, token for token."""
    prompts = _prompts(6)
    plain = Engine(target, eos_token_ids=EOS).generate(prompts, max_new_tokens=24)
    cfg = EngineConfig(k=4, sampling=SamplingConfig(temperature=1.0, top_k=1))
    spec = Engine(target, EagleDrafter(heads[kind][0], target, tree=TREE), config=cfg, eos_token_ids=EOS).generate(
        prompts, max_new_tokens=24, generator=torch.Generator().manual_seed(0))
    assert spec.tokens == plain.tokens
    assert spec.tau > 1.4, "the tree must be accepted for the comparison to bite"


def test_a_sampled_tree_ranks_candidates_by_the_warped_draft_distribution(target, heads):
    """With top_k = 1 only each node's best child has warped mass, so a budget of ``depth`` nodes
    is the head's greedy chain; ranking by the unwarped distribution keeps siblings instead."""
    tree = TreeConfig(topk=3, depth=3, budget=3)
    drafts = {}
    for name, sampling in (("warped", SamplingConfig(temperature=1.0, top_k=1)), ("greedy", SamplingConfig())):
        rec = _Recorder(EagleDrafter(heads["eagle"][0], target, tree=tree))
        Engine(target, rec, config=EngineConfig(k=4, max_steps=1, sampling=sampling)).generate(
            _prompts(6), max_new_tokens=8, generator=torch.Generator().manual_seed(0))
        drafts[name] = rec.inner.propose(rec.state, 4)
    chain = torch.tensor([[0, 1, 2]]).expand(6, 3)
    assert torch.equal(drafts["warped"].tree.parents, chain) and drafts["warped"].probs is None
    assert not torch.equal(drafts["greedy"].tree.parents, chain), "unwarped ranking would pass by luck"


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["t1", "warped"])
def test_sampled_eagle2_tree_follows_the_target(target, heads, cfg):
    """Seeded chi-square through the engine (``tree_stats.assert_follows_target``): each test at
    alpha = 1e-3, so a correct sampler fails this one with probability at most 2e-3 over seeds;
    the fixed seed makes it reproducible."""
    prompt = [5, 9, 11, 4]
    gen = Engine(target, EagleDrafter(heads["eagle"][0], target, tree=TREE), config=EngineConfig(k=4, sampling=cfg)
                 ).generate([prompt] * 2000, max_new_tokens=3, generator=torch.Generator().manual_seed(5))
    assert sum(a >= 1 for a in gen.accepted_per_step[0]) >= 20, "tree nodes must be accepted for the test to bite"
    assert_follows_target(target, prompt, gen.tokens, cfg)


def test_tree_draft_is_well_formed(target, heads):
    """Nodes come after their parents, depths follow parents, and the budget is exact."""
    rec = _Recorder(EagleDrafter(heads["eagle"][0], target, tree=TREE))
    Engine(target, rec, config=EngineConfig(k=4, max_steps=2)).generate(_prompts(3), max_new_tokens=20)
    draft = rec.inner.propose(rec.state, 4)
    parents, depth = draft.tree.parents, draft.tree.depth
    assert draft.tokens.shape == parents.shape == depth.shape == (3, TREE.budget)
    idx = torch.arange(1, TREE.budget + 1)
    assert (parents < idx).all(), "parents precede children"
    par_depth = torch.where(parents == 0, torch.zeros_like(depth), depth.gather(1, (parents - 1).clamp_min(0)))
    assert torch.equal(depth, par_depth + 1)
    assert int(depth.max()) <= TREE.depth


# ---- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_lowers_the_loss(heads, kind):
    res = heads[kind][2]
    assert res.final_loss < 0.5 * res.first_loss, f"{kind}: {res.first_loss:.3f} -> {res.final_loss:.3f}"


def test_eagle3_reduced_vocabulary_maps_draft_ids_to_target_ids(heads):
    head = heads["eagle3"][0]
    assert head.config.draft_vocab_size == 80
    ids = head.to_target_ids(torch.arange(80))
    assert (ids[1:] > ids[:-1]).all(), "draft ids map to ascending target ids"
    assert head.t2d.sum() == 80 and head.t2d[ids].all()


# ---- checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_save_load_round_trip(target, heads, kind, tmp_path):
    head, src, _ = heads[kind]
    prov = json.loads((src / "config.json").read_text())["refspec"]["provenance"]
    assert prov["steps"] == 100 and "final_loss" in prov and "train_time_s" in prov
    save_head(head, tmp_path, provenance=prov)
    back, prov2 = load_head(tmp_path, target.args)
    assert prov2 == prov and back.config == head.config
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    prompts = _prompts(3)
    a = Engine(target, EagleDrafter(head, target), config=EngineConfig(k=3)).generate(prompts, max_new_tokens=16)
    b = Engine(target, EagleDrafter(back, target), config=EngineConfig(k=3)).generate(prompts, max_new_tokens=16)
    assert a.accepted_per_step == b.accepted_per_step


# ---- finding heads ------------------------------------------------------------------------------


def test_a_missing_head_names_the_command_that_trains_one(monkeypatch, tmp_path):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    with pytest.raises(DrafterError) as exc:
        find_head("no-such-model", "eagle3")
    msg = str(exc.value)
    assert "python -m refspec.eval train --drafter eagle3 --model no-such-model" in msg
    assert str(tmp_path / "heads" / "no-such-model-eagle3") in msg


def test_registry_finds_heads_in_refspec_home_and_reads_tree_options(target, heads, monkeypatch, tmp_path):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    save_head(heads["eagle"][0], tmp_path / "heads" / "tiny-eagle")
    ctx = registry.DrafterContext(target=target, target_name="tiny", tokenizer_fingerprint=None,
                                  dtype=torch.float32, device="cpu",
                                  options={"tree": "true", "tree_budget": "12", "tree_topk": "3"})
    d = registry.build("eagle", ctx)
    assert d.tree == TreeConfig(topk=3, depth=5, budget=12) and d.extra_slots == 12
    with pytest.raises(DrafterError, match="no eagle3 head"):
        registry.build("eagle3", ctx)


# ---- the real tier ------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])  # the shipped heads
def test_smollm2_heads_are_lossless_and_accepted(smollm2, smollm2_plain, kind):
    """The shipped SmolLM2 heads in fp32: greedy equality at batch 1 and a ragged batch, chain and tree."""
    m, tok = smollm2.model, smollm2.tokenizer
    texts = ["What are three tips for staying healthy?", "Write a short poem about the sea.",
             "Explain what a binary search does.", "How do I boil an egg?"]
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    eos = list(tok.eos_token_ids)
    head, _ = load_head(find_head("smollm2-135m", kind), m.args)
    for tree in (None, TreeConfig()):
        for batch in (prompts[:1], prompts):
            spec = Engine(m, EagleDrafter(head, m, tree=tree), config=EngineConfig(k=4),
                          eos_token_ids=eos).generate(batch, max_new_tokens=48)
            assert spec.tokens == smollm2_plain(batch, 48, eos)
        # losslessness is the property; the head's quality (tau) is a measured figure, not a test
        assert spec.tau > 1.0, f"{kind} {'tree' if tree else 'chain'}: nothing accepted (tau {spec.tau:.2f})"
