"""Verification: greedy acceptance tables, the exact closed form and a seeded statistical test."""

import pytest
import torch
from scipy import stats

from refspec.sampling import SamplingConfig, probs_from_logits
from refspec.verify import (acceptance_probability, emitted_tokens, greedy_accept, one_hot_probs,
                            recovery_distribution, speculative_sample)
from refspec.verify_tree import tree_ancestors, tree_greedy_accept


def _logits_with_argmax(argmaxes, vocab=6):
    out = torch.zeros(1, len(argmaxes), vocab)
    for i, a in enumerate(argmaxes):
        out[0, i, a] = 5.0
    return out


@pytest.mark.parametrize("draft, target_argmax, accepted, nxt", [
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted, bonus is the argmax after the last draft
    ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # first mismatch at position 1: recovered token is the target's
    ([1, 2, 3], [0, 2, 3, 4], 0, 0),  # nothing accepted
    ([1, 1, 1], [1, 1, 0, 4], 2, 0),  # a later match after a mismatch does not count
    ([], [3], 0, 3),  # k = 0 is plain decoding
])
def test_greedy_accept_table(draft, target_argmax, accepted, nxt):
    d = torch.tensor([draft], dtype=torch.long).reshape(1, len(draft))
    acc = greedy_accept(d, _logits_with_argmax(target_argmax))
    assert acc.num_accepted.tolist() == [accepted], "accepted count is the longest matching prefix"
    assert acc.next_token.tolist() == [nxt], "the emitted token after the prefix is the target's argmax"
    emit = emitted_tokens(d, acc)[0, : accepted + 1].tolist()
    assert emit == draft[:accepted] + [nxt]


def _first_token_distribution(p, q):
    """Closed form of the first emitted token's distribution, from the sampler's own pieces.

    P(y) = q(y) a(y) + (1 - sum_x q(x) a(x)) r(y), a = acceptance_probability, r = residual.
    """
    v = p.shape[-1]
    drafts = torch.arange(v)[None, :, None]  # every possible draft, one per batch column
    pb = p.expand(v, 2, v).reshape(1, v, 2, v)[0]
    qb = q.expand(v, 1, v)
    a = acceptance_probability(pb[:, 0].gather(1, drafts[0]), qb[:, 0].gather(1, drafts[0])).squeeze(1)  # [V]
    r = recovery_distribution(pb, qb)[0, 0]  # residual row, same for every draft
    accept_mass = (q[0, 0] * a)
    return accept_mass + (1 - accept_mass.sum()) * r


@pytest.mark.parametrize("case", ["random", "q_zeros", "p_equals_q", "one_hot_q", "p_zeros"])
def test_closed_form_output_distribution_equals_target(case):
    g = torch.Generator().manual_seed(7)
    v = 6
    for _ in range(20):
        p = torch.softmax(torch.randn(1, 2, v, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(1, 1, v, generator=g) * 2, -1)
        if case == "q_zeros":
            q[0, 0, :3] = 0
            q = q / q.sum(-1, keepdim=True)
        elif case == "p_equals_q":
            q = p[:, :1].clone()
        elif case == "one_hot_q":
            q = one_hot_probs(torch.tensor([[int(torch.randint(v, (1,), generator=g))]]), v)
        elif case == "p_zeros":
            p[0, 0, 2:4] = 0
            p = p / p.sum(-1, keepdim=True)
        got = _first_token_distribution(p, q)
        assert torch.allclose(got, p[0, 0], atol=1e-6), f"{case}: sampler emits {got.tolist()} not p={p[0, 0].tolist()}"


def test_chain_sampler_follows_target_distribution_statistically():
    """Seeded Monte Carlo of the whole chain sampler (K = 3, V = 5).

    For each position i we test, among runs whose emitted sequence reaches position i with the
    fixed prefix that p_i is conditioned on, that the token emitted there follows p_i; the
    bonus position is K. Each chi-square test runs at alpha = 1e-4; with 4 positions the
    false-failure probability of this test is at most 4e-4 (Bonferroni), and the seed fixes it.
    """
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    v, k, n = 5, 3, 200_000
    p = torch.softmax(torch.randn(1, k + 1, v) * 1.5, -1)
    q = torch.softmax(torch.randn(1, k, v) * 1.5, -1)
    # drafts are sampled from q; the target distributions do not depend on the drafts here, which is
    # the case of a fixed context (the i-th emitted token follows p_i given acceptance up to i)
    draft = torch.multinomial(q[0].repeat(n, 1, 1).reshape(n * k, v), 1, generator=g).reshape(n, k)
    acc = speculative_sample(draft, q.expand(n, k, v), p.expand(n, k + 1, v), g)
    emit = emitted_tokens(draft, acc)
    for i in range(k + 1):
        reached = acc.num_accepted >= i  # the emitted token at index i exists
        tokens = emit[reached, i]
        counts = torch.bincount(tokens, minlength=v).double()
        expected = p[0, i].double() / p[0, i].double().sum() * counts.sum()
        _, pval = stats.chisquare(counts.numpy(), expected.numpy())
        assert pval > 1e-4, f"position {i}: emitted {counts.tolist()} vs expected {expected.tolist()} (p={pval:.2e})"


def test_deterministic_drafter_is_one_hot_case():
    g = torch.Generator().manual_seed(3)
    v, n = 4, 100_000
    p = torch.softmax(torch.randn(1, 2, v), -1)
    draft = torch.full((n, 1), 2, dtype=torch.long)
    acc = speculative_sample(draft, None, p.expand(n, 2, v), g)
    first = emitted_tokens(draft, acc)[:, 0]
    counts = torch.bincount(first, minlength=v).double()
    _, pval = stats.chisquare(counts.numpy(), (p[0, 0].double() / p[0, 0].double().sum() * n).numpy())
    assert pval > 1e-4, "one-hot q: first emitted token must follow p (false-failure rate 1e-4)"
    assert abs(acc.num_accepted.double().mean().item() - p[0, 0, 2].item()) < 0.01, "acceptance rate is p(draft)"


def test_top_k_top_p_processing():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    pk = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (pk[0, 2:] == 0).all() and torch.isclose(pk.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)
    pp = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=float(full[0, 0] + 0.01)))
    assert (pp[0, :2] > 0).all() and (pp[0, 2:] == 0).all(), "top-p keeps the smallest set reaching the mass"


def test_tree_ancestors_and_greedy_tree_equals_paths():
    # root -> a(1) -> c(3); root -> b(2) -> d(4) -> e(5)
    parents = torch.tensor([[0, 0, 1, 2, 4]])
    depth = torch.tensor([[1, 1, 2, 2, 3]])
    anc = tree_ancestors(parents)[0]
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 2, 4, 5}}
    for i, s in expect.items():
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == s, f"node {i} must see exactly its ancestors"
    tokens = torch.tensor([[7, 8, 9, 10, 11]])
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        logits = torch.randn(1, 6, 12, generator=g)
        # force some agreement so deep paths occur
        for blk, tok in ((0, int(torch.randint(7, 9, (1,), generator=g))), (2, 10), (4, 11)):
            if torch.rand(1, generator=g) < 0.7:
                logits[0, blk, tok] = 10
        acc, path = tree_greedy_accept(tokens, parents, depth, logits)
        # reference: verify each root-to-leaf path as a chain and keep the longest acceptance
        best = (-1, None)
        for leaf_path in ([0, 1, 3], [0, 2, 4, 5]):
            chain = tokens[:, [j - 1 for j in leaf_path[1:]]]
            chain_acc = greedy_accept(chain, logits[:, leaf_path])
            if chain_acc.num_accepted.item() > best[0]:
                best = (chain_acc.num_accepted.item(), chain_acc.next_token.item())
        assert (acc.num_accepted.item(), acc.next_token.item()) == best
        assert path[0, 0].item() == 0
