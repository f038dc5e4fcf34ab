"""One decode step, as the engine's loop calls it: verify, accept, commit; and filling slots.

Every function here takes what it works on as arguments and returns what it decided; none
sees the engine. The loop in :meth:`refspec.engine.Engine._serve` calls them in order:

1. draft: ``drafter.propose(state, k)`` (the drafter's own file);
2. :func:`verify_forward`: one target forward over each row's pending token and drafts;
3. :func:`decide`: how many drafts each row keeps (:mod:`refspec.verify`,
   :mod:`refspec.verify_tree`), a tree's accepted path compacted onto the chain slots;
4. :func:`commit`: emit, advance the cache by accepted + 1, the step's one host sync;
5. :func:`prefill`: freed slots take new requests (one packed target forward over their
   prompts), the drafter forgets those rows.

:class:`Batch` is what the loop carries between steps.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from refspec.cache import tree_mask
from refspec.config import round_up
from refspec.drafting import DecodeState, Draft, Drafter
from refspec.sampling import SamplingConfig, choose, probs_from_logits
from refspec.target import TargetForward
from refspec.verify import Acceptance, emitted_tokens, greedy_accept, speculative_sample
from refspec.verify_tree import tree_ancestors, tree_greedy_accept, tree_speculative_sample

AcceptFn = Callable[[Draft, torch.Tensor, SamplingConfig, "torch.Generator | None"], Acceptance]
"""Decides a chain: ``(draft, logits [B, K+1, V], sampling, generator) -> Acceptance``."""


@dataclasses.dataclass
class Batch:
    """The B static slots between steps: device tensors, and host copies of the step's one sync.

    Attributes:
        state: what drafters see (tokens, lengths, pending token, done, features, ...).
        cache: the target's static KV cache (or a CUDA-graph runner's view of its pool).
        slots: T, cache slots per row.
        out: ``[B, max budget + K + 1]`` tokens emitted per slot.
        n_out: ``[B]`` tokens emitted so far.
        budget: ``[B]`` each slot's request budget (max_new_tokens).
        eos_on: ``[B]`` an end-of-sequence token ends the slot's request (False: it ignores EOS).
        done_host: per slot, no live request is generating in it.
        lengths_host: per slot, committed cache length.
    """

    state: DecodeState
    cache: object
    slots: int
    out: torch.Tensor
    n_out: torch.Tensor
    budget: torch.Tensor
    eos_on: torch.Tensor
    done_host: list[bool]
    lengths_host: list[int]

    @property
    def active(self) -> int:
        """Slots generating now."""
        return len(self.done_host) - sum(self.done_host)


def verify_forward(forward: TargetForward, run: Batch, draft: Draft, base: torch.Tensor, *, kv_bucket: int,
                   hidden_layers: tuple[int, ...], sliding_window: int | None
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One target forward over ``[pending, drafts]`` of every row, at slots ``base + i``.

    Args:
        forward: the target (its steps run eagerly, compiled or through CUDA graphs).
        run: the batch; its cache receives the N+1 new entries of every row.
        draft: the step's chain ``[B, K]`` or tree of N nodes.
        base: ``[B]`` committed cache length of each row before the step.
        kv_bucket: attended keys are rounded up to a multiple of this (few distinct shapes).
        hidden_layers: target layers whose states the drafter reads.
        sliding_window: the target's window, for a tree's sliding mask (None: no sliding layer).

    Returns:
        ``(logits [B, N+1, V], hidden states, each [B, N+1, E])``.
    """
    n = draft.tokens.shape[1]
    inp = torch.cat([run.state.pending[:, None], draft.tokens], dim=1)  # [B, N+1]
    num_keys = min(run.slots, round_up(max(run.lengths_host) + n + 1, kv_bucket))
    slots = (base[:, None] + torch.arange(n + 1, device=base.device)).clamp_(max=run.slots - 1)  # [B, N+1]
    if draft.tree is None:  # a chain: slot = rotary position, the causal mask follows from it
        return forward(inp, slots, run.cache, num_keys=num_keys, hidden_layers=hidden_layers)
    anc = tree_ancestors(draft.tree.parents)  # [B, N+1, N+1]
    depth = torch.cat([torch.zeros_like(draft.tree.depth[:, :1]), draft.tree.depth], dim=1)  # [B, N+1]
    positions = base[:, None] + depth  # a node sits at its depth past the committed prefix
    sliding = tree_mask(base, anc, positions, num_keys, sliding_window) if sliding_window else None
    return forward(inp, positions, run.cache, slots=slots, mask=tree_mask(base, anc, positions, num_keys),
                   sliding_mask=sliding, num_keys=num_keys, hidden_layers=hidden_layers)


def accept_chain(draft: Draft, logits: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator | None) -> Acceptance:
    """The default :data:`AcceptFn`: greedy prefix match, or lossless rejection sampling."""
    if sampling.greedy:
        return greedy_accept(draft.tokens, logits)
    return speculative_sample(draft.tokens, draft.probs, probs_from_logits(logits, sampling), generator)


def decide(draft: Draft, logits: torch.Tensor, hidden: list[torch.Tensor], base: torch.Tensor, cache, *,
           sampling: SamplingConfig, generator: torch.Generator | None, accept: AcceptFn
           ) -> tuple[Acceptance, torch.Tensor, list[torch.Tensor]]:
    """Each row's accepted drafts and its recovered or bonus token.

    A chain is decided by ``accept``. A tree is decided by greedy match along its nodes, or by
    recursive rejection sampling over each node's children; its accepted path's KV entries are
    then copied onto the chain slots ``base + 1 ..`` and its features gathered along the path.

    Returns:
        ``(acceptance, chain [B, P] drafted tokens in emission order, hidden [B, P+1, E] each)``,
        P = K for a chain, the tree's depth bound for a tree.
    """
    if draft.tree is None:
        return accept(draft, logits, sampling, generator), draft.tokens, hidden
    tr = draft.tree
    if sampling.greedy:
        acc, path = tree_greedy_accept(draft.tokens, tr.parents, tr.depth, logits)  # path [B, P+1]
    else:
        p = probs_from_logits(logits, sampling)  # [B, N+1, V]
        acc, path = tree_speculative_sample(draft.tokens, tr.parents, tr.depth, draft.probs, p, generator)
    b, t = base.shape[0], cache.max_len
    chain = draft.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))  # [B, P] tokens on the path
    src = (base[:, None] + path[:, 1:]).clamp_(max=t - 1)
    dst = (base[:, None] + 1 + torch.arange(path.shape[1] - 1, device=base.device)).clamp_(max=t - 1)
    cache.compact(src, dst)
    hidden = [h.gather(1, path[..., None].expand(b, path.shape[1], h.shape[-1])) for h in hidden]
    return acc, chain, hidden


@dataclasses.dataclass(frozen=True)
class Committed:
    """What one step did, per slot, on the host (the step's one device-to-host sync)."""

    accepted: list[int]  # drafts accepted; -1: the slot held no generating request
    emitted: list[int]  # tokens emitted (0 for a done row or an empty slot)
    done: list[bool]  # finished after the step
    advance: list[int]  # cache entries kept: accepted + 1, the pending token's included


def commit(run: Batch, acc: Acceptance, chain: torch.Tensor, hidden: list[torch.Tensor], base: torch.Tensor,
           eos: torch.Tensor) -> Committed:
    """Emit each row's accepted drafts and its bonus or recovered token (up to its first EOS,
    within its budget), keep their KV (accepted + 1 entries, the pending token's included), and
    make the new token pending. Rejected entries beyond the new length are never read again.

    Args:
        run: the batch, updated in place.
        acc: the step's acceptance.
        chain: ``[B, P]`` drafted tokens in emission order.
        hidden: target features along the kept path, each ``[B, P+1, E]`` (for the drafter).
        base: ``[B]`` committed cache length before the step.
        eos: ``[X]`` token ids that end a request.
    """
    state, cache = run.state, run.cache
    emit = emitted_tokens(chain, acc)  # [B, P+1]: accepted drafts, then the bonus/recovered token
    idx = torch.arange(emit.shape[1], device=emit.device)[None]  # [1, P+1]
    is_eos = torch.isin(emit, eos) & (idx <= acc.num_accepted[:, None]) & run.eos_on[:, None]
    first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(acc.num_accepted, emit.shape[1]))
    n_emit = torch.minimum(torch.minimum(acc.num_accepted + 1, first_eos + 1), run.budget - run.n_out)
    done = state.done  # finished rows and empty slots emit nothing and keep their cache
    n_emit = torch.where(done, torch.zeros_like(n_emit), n_emit)
    out_idx = (run.n_out[:, None] + idx).clamp_(max=run.out.shape[1] - 1)
    run.out.scatter_(1, out_idx, torch.where(idx < n_emit[:, None], emit, run.out.gather(1, out_idx)))
    advance = torch.where(done, torch.zeros_like(n_emit), acc.num_accepted + 1)
    tok_idx = (cache.lengths[:, None] + 1 + idx).clamp_(max=run.slots - 1)
    state.tokens.scatter_(1, tok_idx, torch.where(idx < advance[:, None], emit, state.tokens.gather(1, tok_idx)))
    state.prev_lengths = base
    cache.lengths.add_(advance)  # state.lengths is the cache's
    state.pending = torch.where(done, state.pending, acc.next_token)
    run.n_out = run.n_out + n_emit
    newly_done = ~done & ((first_eos <= acc.num_accepted) | (run.n_out >= run.budget))
    accepted = torch.where(done, torch.full_like(n_emit, -1), acc.num_accepted)  # -1: nothing generated here
    state.done = done | newly_done
    state.hidden = hidden
    state.num_accepted = accepted.clamp_min(0)
    acc_h, emit_h, done_h, adv_h = torch.stack([accepted, n_emit, state.done.long(), advance]).tolist()
    run.done_host = [bool(x) for x in done_h]
    run.lengths_host = [n + a for n, a in zip(run.lengths_host, adv_h)]
    return Committed(accepted=acc_h, emitted=emit_h, done=run.done_host, advance=adv_h)


def new_batch(cache, batch: int, t_slots: int, max_budget: int, k: int, *, sampling: SamplingConfig,
              target_args, dtype_bytes: int) -> Batch:
    """B empty slots (all ``done``) over ``cache`` (its lengths are the state's)."""
    dev = cache.lengths.device
    zeros = torch.zeros(batch, dtype=torch.long, device=dev)
    state = DecodeState(tokens=torch.zeros(batch, t_slots, dtype=torch.long, device=dev), lengths=cache.lengths,
                        prev_lengths=zeros.clone(), pending=zeros.clone(), prompt_lengths=zeros.clone(),
                        done=torch.ones(batch, dtype=torch.bool, device=dev), hidden=[], num_accepted=zeros.clone(),
                        sampling=sampling, generator=None, step=0, max_length_bound=1,
                        target_args=target_args, dtype_bytes=dtype_bytes)
    out = torch.zeros(batch, max_budget + k + 1, dtype=torch.long, device=dev)
    return Batch(state=state, cache=cache, slots=t_slots, out=out, n_out=zeros.clone(), budget=zeros.clone(),
                 eos_on=torch.ones(batch, dtype=torch.bool, device=dev), done_host=[True] * batch,
                 lengths_host=[0] * batch)


def prefill(target: TargetForward, run: Batch, rows: Sequence[int], prompts: Sequence[Sequence[int]],
            budgets: Sequence[int], *, drafter: Drafter | None, sampling: SamplingConfig, eos: torch.Tensor,
            generator: torch.Generator | None, ignore_eos: Sequence[bool] = ()) -> None:
    """Fill slots ``rows`` (ascending) with new requests: one packed target forward over only
    their prompts' tokens (each written into its slot's cache row, the first token from each
    prompt's last logits), then the drafter forgets those rows and reads their prompts.

    Args:
        target: the target (:meth:`~refspec.target.TargetForward.prefill`).
        run: the batch, updated in place (``done_host`` and ``lengths_host`` included).
        rows: the R slots.
        prompts: R prompts (token ids).
        budgets: R budgets (max_new_tokens, the first token included).
        drafter: reset for those rows (``reset(state)`` when every slot fills at once).
        sampling / eos / generator: how the first token is chosen, and what ends a request.
        ignore_eos: R flags, True where the request generates past EOS to its budget (empty: none).
    """
    state, dev, b, r = run.state, run.cache.lengths.device, run.state.batch, len(rows)
    idx = torch.tensor(rows, dtype=torch.long, device=dev)  # [R]
    plens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)  # [R]
    packed = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)  # [sum S]
    hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    logits, hidden = target.prefill(packed, [len(p) for p in prompts], run.cache, idx,
                                    hidden_layers=hidden_layers)  # logits [R, V], hidden [R, S_max, E] each
    state.generator = generator
    first = choose(logits, sampling, generator)  # [R]
    tokens = torch.zeros(r, run.slots, dtype=torch.long, device=dev)  # [R, T]
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    tokens.scatter_(1, plens[:, None], first[:, None])
    whole = r == b  # every slot at once: the drafter's whole-batch reset
    state.tokens[idx] = tokens
    run.cache.lengths[idx] = plens
    state.prev_lengths[idx] = torch.zeros_like(plens) if whole else plens
    state.prompt_lengths[idx] = plens
    state.pending[idx] = first
    state.num_accepted[idx] = 0
    run.eos_on[idx] = ~torch.tensor(list(ignore_eos) or [False] * r, dtype=torch.bool, device=dev)
    state.done[idx] = (torch.isin(first, eos) & run.eos_on[idx]) | (torch.tensor(budgets, device=dev) <= 1)
    run.out.index_fill_(0, idx, 0)
    run.out[idx, 0] = first
    run.n_out[idx] = 1
    run.budget[idx] = torch.tensor(budgets, dtype=torch.long, device=dev)
    for slot, p in zip(rows, prompts):
        run.lengths_host[slot] = len(p)
    state.max_length_bound = max(run.lengths_host) + 1
    if whole:
        state.hidden = hidden
    elif not state.hidden:  # no step yet: a column of zero features per slot until the first verify
        state.hidden = [h.new_zeros(b, 1, h.shape[-1]) for h in hidden]
    if drafter is not None:
        drafter.reset(state) if whole else drafter.reset_rows(state, idx, hidden)
    for slot, d in zip(rows, state.done[idx].tolist()):  # host sync
        run.done_host[slot] = bool(d)


__all__ = ["AcceptFn", "Batch", "Committed", "accept_chain", "commit", "decide", "new_batch", "prefill",
           "verify_forward"]
