"""Exact target distributions of the first emitted tokens and a pooled chi-square, for the
seeded distribution tests of sampled decoding through the engine."""
from __future__ import annotations

import torch
from scipy import stats

from refspec.sampling import SamplingConfig, probs_from_logits


@torch.no_grad()
def exact_first_three(model, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """``[V, V, V]`` float64: P(first three emitted tokens = x, y, z) under plain sampling."""
    s = len(prompt)
    v = model.args.vocab_size

    def dist(prefixes: torch.Tensor) -> torch.Tensor:  # [R, S'] -> [R, V] warped next-token laws
        r, w = prefixes.shape
        logits, _ = model(prefixes, torch.arange(w)[None].expand(r, w), model.new_cache(r, w))
        return probs_from_logits(logits[:, -1], cfg).double()

    base = torch.tensor(prompt)[None]
    p1 = dist(base)[0]  # [V]
    xs = torch.arange(v)
    p2 = dist(torch.cat([base.expand(v, s), xs[:, None]], 1))  # [V, V]
    pairs = torch.cartesian_prod(xs, xs)  # [V*V, 2], x major
    p3 = dist(torch.cat([base.expand(v * v, s), pairs], 1)).reshape(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def pooled_chisquare(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of observed counts against exact cell probabilities; cells expecting fewer than
    5 counts are pooled into one so the chi-square approximation holds, and cells of probability
    0 must be empty."""
    obs, prob = observed.flatten().double(), expected_probs.flatten().double()
    assert obs.shape == prob.shape and abs(float(prob.sum()) - 1) < 1e-6, "one probability per cell, summing to 1"
    prob = prob / prob.sum()  # exact in float64: scipy >= 1.17 requires the expected counts to sum to the observed
    impossible = prob == 0
    assert obs[impossible].sum() == 0, f"{int(obs[impossible].sum())} emissions the target gives probability 0"
    n = obs.sum()
    keep, pool = prob * n >= 5, ~impossible & (prob * n < 5)
    o, e = obs[keep], prob[keep] * n
    if pool.any():
        o = torch.cat([o, obs[pool].sum()[None]])
        e = torch.cat([e, prob[pool].sum()[None] * n])
    assert len(o) >= 2, "too few cells for a chi-square test"
    return float(stats.chisquare(o.numpy(), e.numpy()).pvalue)


def counts(tokens: list[list[int]], positions: tuple[int, ...], v: int) -> torch.Tensor:
    """Counts of the emitted tokens at ``positions`` per row, as a tensor of ``v`` per position."""
    idx = torch.tensor([[row[i] for i in positions] for row in tokens])  # [R, P]
    flat = torch.zeros(len(tokens), dtype=torch.long)
    for j in range(len(positions)):
        flat = flat * v + idx[:, j]
    return torch.bincount(flat, minlength=v ** len(positions)).reshape((v,) * len(positions))


def marginal(joint: torch.Tensor, positions: tuple[int, ...]) -> torch.Tensor:
    """The law of the tokens at ``positions`` (0-based) from a joint ``[V, V, V]``."""
    drop = tuple(i for i in range(joint.dim()) if i not in positions)
    return joint.sum(drop) if drop else joint


_EXACT: dict = {}


def assert_follows_target(model, prompt: list[int], tokens: list[list[int]], cfg: SamplingConfig,
                          alpha: float = 1e-3) -> None:
    """Chi-square of rows' first three emitted tokens against the target's exact law, each test
    at ``alpha`` (the chance a correct sampler fails it over seeds).

    With the full vocabulary (no top-k / top-p): the 2nd and the 3rd token's marginals (the 1st
    comes from prefill), two tests; with a warp: the joint of the first three tokens, one test.
    The 2nd and 3rd tokens come from the first tree step whenever a node is accepted, so
    acceptance at depth 1 and 2 are both tested.
    """
    key = (id(model), tuple(prompt), cfg)
    if key not in _EXACT:
        _EXACT[key] = exact_first_three(model, prompt, cfg)
    joint, v = _EXACT[key], model.args.vocab_size
    full = cfg.top_k == 0 and cfg.top_p == 1.0
    for pos in ([(1,), (2,)] if full else [(0, 1, 2)]):
        pval = pooled_chisquare(counts(tokens, pos, v), marginal(joint, pos))
        assert pval > alpha, f"tokens at {pos} do not follow the target (p = {pval:.2e}, alpha = {alpha})"
