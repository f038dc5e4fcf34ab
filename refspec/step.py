"""One decode step's verify forward and acceptance decision (steps 2 and 3 of the engine loop).

:func:`verify_forward` runs the target over every row's pending token and drafts (a chain, or
a tree with its mask); :func:`decide` applies the pure acceptance functions of
:mod:`refspec.verify` / :mod:`refspec.verify_tree` and, for trees, compacts the accepted path's
KV and features onto the chain slots.
"""
from __future__ import annotations

import torch

from refspec.cache import tree_mask
from refspec.drafting import Draft
from refspec.sampling import probs_from_logits
from refspec.slots import Batch
from refspec.verify import greedy_accept, speculative_sample
from refspec.verify_tree import tree_ancestors, tree_greedy_accept, tree_speculative_sample


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def verify_forward(engine, run: Batch, draft: Draft, base: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One target forward over ``[pending, drafts]`` of every row at slots ``base + i``.

    Returns:
        ``(logits [B, N+1, V], hidden states the drafter asked for, each [B, N+1, E])``.
    """
    dev, n = engine.target.device, draft.tokens.shape[1]
    inp = torch.cat([run.state.pending[:, None], draft.tokens], dim=1)  # [B, N+1]
    num_keys = min(run.slots, _round_up(max(run.lengths_host) + n + 1, engine.config.kv_bucket))
    slots = (base[:, None] + torch.arange(n + 1, device=dev)).clamp_(max=run.slots - 1)  # [B, N+1]
    hidden_layers = tuple(engine.drafter.hidden_layers) if engine.drafter is not None else ()
    fwd_kw: dict = {}
    positions = slots
    if draft.tree is not None:
        anc = tree_ancestors(draft.tree.parents)  # [B, N+1, N+1]
        depth = torch.cat([torch.zeros_like(draft.tree.depth[:, :1]), draft.tree.depth], dim=1)  # [B, N+1]
        positions = base[:, None] + depth  # a node sits at its depth past the committed prefix
        fwd_kw["slots"] = slots
        fwd_kw["mask"] = tree_mask(base, anc, positions, num_keys)
        window = getattr(engine.target.args, "sliding_window", None)
        if window:
            fwd_kw["sliding_mask"] = tree_mask(base, anc, positions, num_keys, window)
    return engine.verify_fn(inp, positions, run.cache, num_keys=num_keys, hidden_layers=hidden_layers, **fwd_kw)


def decide(engine, run: Batch, draft: Draft, logits: torch.Tensor, hidden: list[torch.Tensor],
           base: torch.Tensor, generator: torch.Generator | None):
    """Acceptance of a chain, or of a tree path (greedy match, or recursive rejection sampling
    over each node's children), its KV and features compacted onto the chain slots ``base + 1 ..``.

    Returns:
        ``(Acceptance, chain [B, D] drafted tokens in emission order, hidden)``.
    """
    if draft.tree is None:
        if engine.acceptance_fn is not None:
            return engine.acceptance_fn(draft, logits, generator), draft.tokens, hidden
        if engine.config.sampling.greedy:
            return greedy_accept(draft.tokens, logits), draft.tokens, hidden
        p = probs_from_logits(logits, engine.config.sampling)  # [B, K+1, V] target distributions
        return speculative_sample(draft.tokens, draft.probs, p, generator), draft.tokens, hidden
    b, dev, t = base.shape[0], base.device, run.slots
    tr, p = draft.tree, None if engine.config.sampling.greedy else probs_from_logits(logits, engine.config.sampling)
    acc, path = tree_greedy_accept(draft.tokens, tr.parents, tr.depth, logits) if p is None else \
        tree_speculative_sample(draft.tokens, tr.parents, tr.depth, draft.probs, p, generator)  # path [B, D+1]
    chain = draft.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))  # [B, D] tokens on the path
    src = (base[:, None] + path[:, 1:]).clamp_(max=t - 1)
    dst = (base[:, None] + 1 + torch.arange(path.shape[1] - 1, device=dev)).clamp_(max=t - 1)
    run.cache.compact(src, dst)
    hidden = [h.gather(1, path[..., None].expand(b, path.shape[1], h.shape[-1])) for h in hidden]
    return acc, chain, hidden


__all__ = ["verify_forward", "decide"]
