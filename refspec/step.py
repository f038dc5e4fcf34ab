"""One decode step's verify forward, acceptance decision and commit (steps 2-4 of the engine loop).

:func:`verify_forward` runs the target over every row's pending token and drafts (a chain, or
a tree with its mask); :func:`decide` applies the pure acceptance functions of
:mod:`refspec.verify` / :mod:`refspec.verify_tree` and, for trees, compacts the accepted path's
KV and features onto the chain slots; :func:`commit` emits the accepted tokens and advances
every row's cache and decode state.
"""
from __future__ import annotations

import dataclasses

import torch

from refspec.cache import tree_mask
from refspec.drafting import Draft
from refspec.sampling import probs_from_logits
from refspec.slots import Batch
from refspec.verify import Acceptance, emitted_tokens, greedy_accept, speculative_sample
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


@dataclasses.dataclass(frozen=True)
class Committed:
    """What one step did, per row, on the host (the step's one device-to-host sync)."""

    accepted: list[int]  # drafts accepted; -1: the row was done before the step
    emitted: list[int]  # tokens emitted (0 for a done row or an empty slot)
    done: list[bool]  # finished after the step
    advance: list[int]  # cache entries kept: accepted + 1, the pending token's included


def _emission_counts(engine, run: Batch, emit: torch.Tensor, idx: torch.Tensor,
                     acc: Acceptance) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, how many of ``emit`` [B, D+1] (``idx`` [1, D+1] its positions) it emits: accepted
    + 1, cut after its first EOS and at its budget, 0 when done; and the index of that first EOS
    (D+1 when none)."""
    n_emit = acc.num_accepted + 1
    is_eos = torch.isin(emit, engine.eos) & (idx < n_emit[:, None])
    first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(n_emit, emit.shape[1]))
    n_emit = torch.minimum(torch.minimum(n_emit, first_eos + 1), run.budget - run.n_out)
    return torch.where(run.state.done, torch.zeros_like(n_emit), n_emit), first_eos


def commit(engine, run: Batch, acc: Acceptance, chain: torch.Tensor, hidden: list[torch.Tensor],
           base: torch.Tensor) -> Committed:
    """Emit each row's accepted drafts and its bonus/recovered token, append what the cache
    keeps to its tokens, advance its cache by accepted + 1 and hand the drafter the new state."""
    state, cache = run.state, run.cache
    emit = emitted_tokens(chain, acc)  # [B, D+1]: accepted drafts, then the bonus/recovered token
    idx = torch.arange(emit.shape[1], device=emit.device)[None]
    n_emit, first_eos = _emission_counts(engine, run, emit, idx, acc)
    done = state.done  # finished rows and empty slots emit nothing and keep their cache
    out_idx = (run.n_out[:, None] + idx).clamp_(max=run.out.shape[1] - 1)
    run.out.scatter_(1, out_idx, torch.where(idx < n_emit[:, None], emit, run.out.gather(1, out_idx)))
    advance = torch.where(done, torch.zeros_like(n_emit), acc.num_accepted + 1)  # KV of accepted + pending
    tok_idx = (cache.lengths[:, None] + 1 + idx).clamp_(max=run.slots - 1)
    state.tokens.scatter_(1, tok_idx, torch.where(idx < advance[:, None], emit, state.tokens.gather(1, tok_idx)))
    state.prev_lengths = base
    cache.lengths.add_(advance)  # rejected entries beyond the new length are never read again
    state.pending = torch.where(done, state.pending, acc.next_token)
    run.n_out = run.n_out + n_emit
    newly_done = ~done & ((first_eos < acc.num_accepted + 1) | (run.n_out >= run.budget))
    num_acc_active = torch.where(done, torch.full_like(n_emit, -1), acc.num_accepted)  # -1: row was done
    state.done = done | newly_done
    state.hidden = hidden
    state.num_accepted = num_acc_active.clamp_min(0)
    if engine.drafter is not None:
        engine.drafter.commit(state)
    accepted, emitted, done_row, adv = torch.stack([num_acc_active, n_emit, state.done.long(), advance]).tolist()
    return Committed(accepted=accepted, emitted=emitted, done=[bool(x) for x in done_row], advance=adv)


__all__ = ["verify_forward", "decide", "commit", "Committed"]
