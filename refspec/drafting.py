"""The drafter protocol: what the engine asks of a drafter and what it gives it.

A drafter proposes up to K tokens per row after the row's pending token. The engine never
imports a concrete drafter; ``refspec.drafters`` registers them by CLI name.

Life cycle per batch: ``reset(state)`` once after the target's prefill (``state.hidden`` then
holds prompt features), then per step ``propose(state, k)`` and, after verification and the
engine's own bookkeeping, ``commit(state)`` (``state.hidden`` then holds the features of
the pending token and the accepted drafts, ``state.num_accepted`` the counts). The speculation
policy (:mod:`refspec.policy`) picks k per step, below the engine's K or 0: a step with k = 0
calls ``commit`` without ``propose`` (one position per row committed, its features in
``state.hidden``), and the drafter's state must stay exact across such steps.

Continuous batching (:meth:`refspec.engine.Engine.serve`) refills a slot whose request finished
with a new request: after its prefill the engine calls ``reset_rows(state, rows, hidden)`` for
those rows only (see :class:`Drafter`), between one step's ``commit`` and the next ``propose``.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from refspec.sampling import SamplingConfig


@dataclasses.dataclass
class DraftTree:
    """Topology of a draft tree (EAGLE-2), shared by every row's own tree shape.

    Attributes:
        parents: ``[B, N]`` block index of each node's parent; block index 0 is the root
            (pending token), node ``j`` is block index ``j + 1``; parents precede children.
            Sampled verification tries a node's children in node order.
        depth: ``[B, N]`` depth of each node (root children: 1).
        max_depth: maximum depth (a host int, so the engine needs no sync to size buffers).
    """

    parents: torch.Tensor
    depth: torch.Tensor
    max_depth: int


@dataclasses.dataclass
class Draft:
    """What a drafter proposes for one step.

    Attributes:
        tokens: ``[B, K']`` drafted tokens; a chain has ``K' <= K`` (a drafter may cut the
            whole batch's draft short; 0 makes a plain step); for
            trees, N nodes.
        probs: the drafter's processed distributions q when it samples, or None for
            deterministic drafts (one-hot q) and for greedy decoding. A chain gives ``[B, K', V]``,
            the distribution each draft was drawn from. A tree gives ``[B, N, V]``: per node the
            law its token was drawn from given the path to its parent and its earlier siblings
            (for children drawn without replacement, q without the earlier siblings' tokens,
            renormalised); None when the children are chosen deterministically from the
            context (EAGLE-2's top-k), which :mod:`refspec.verify_tree` verifies exactly too.
        tree: tree topology, or None for a chain.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    tree: DraftTree | None = None


@dataclasses.dataclass
class DecodeState:
    """The engine's per-batch state, as drafters see it (read-only for them).

    Attributes:
        tokens: ``[B, T]`` every token of each row: prompt then emitted; ``tokens[b, i]`` is
            valid for ``i <= lengths[b]``; ``tokens[b, lengths[b]]`` is the pending token.
        lengths: ``[B]`` tokens in the target's KV cache (the pending token is not yet).
        prev_lengths: ``[B]`` ``lengths`` before the latest commit.
        pending: ``[B]`` last emitted token of each row (not yet in the target cache).
        prompt_lengths: ``[B]``.
        done: ``[B]`` rows that finished (EOS or budget).
        hidden: target hidden states requested by the drafter, each ``[B, S, E]``; after
            prefill S is the padded prompt length, after a step ``S >= num_accepted + 1``
            and entry ``i`` belongs to position ``prev_lengths + i``.
        num_accepted: ``[B]`` drafts accepted in the latest step (zeros after prefill).
        sampling: the sampling settings (drafters that sample must use the same).
        generator: explicit random generator.
        step: index of the step about to run (or that just ran, in ``commit``).
        max_length_bound: host-side upper bound of ``lengths + 1`` over rows.
        target_args: architecture of the target.
        dtype_bytes: bytes per element of the target's weights.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prev_lengths: torch.Tensor
    pending: torch.Tensor
    prompt_lengths: torch.Tensor
    done: torch.Tensor
    hidden: list[torch.Tensor]
    num_accepted: torch.Tensor
    sampling: SamplingConfig
    generator: torch.Generator | None
    step: int
    max_length_bound: int
    target_args: object
    dtype_bytes: int

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    """A source of draft tokens.

    Attributes:
        name: registry name (``ngram``, ``draft-model``, ...).
        hidden_layers: target layers whose hidden states the drafter reads (see
            ``Transformer.forward``); empty for drafters that need none.
        extra_slots: optional; cache slots beyond K+1 the drafter may make the target write
            (tree drafters: nodes beyond K).

    Billing: a drafter declares no cost. The work of ``reset`` (billed to ``prefill``) and of
    ``propose`` (billed to ``draft``) is what the forwards it runs record through
    :func:`refspec.energy.model.work.record_forward`: refspec's ``Transformer`` and drafter heads
    record themselves; a drafter running modules of its own records a
    :class:`~refspec.energy.model.work.ForwardShape` per forward, computed from the tensors it ran.
    ``commit`` should run no forward (the engine bills it as bookkeeping).

    Method ``reset_rows(self, state, rows, hidden) -> None`` (needed by continuous batching; a
    drafter without it serves only the static schedule): ``rows`` is a ``[R]`` long tensor of
    slots just prefilled with new requests; ``state`` is the whole batch, already updated for
    those rows (``tokens``, ``lengths``, ``prompt_lengths``, ``pending``, ``done``,
    ``num_accepted`` = 0, ``prev_lengths`` = ``lengths``); ``hidden`` holds the requested target
    features of the R prompts, each ``[R, S, E]`` (S the padded prompt length of the refill;
    ``state.hidden`` still holds the last verify's, for every row). The drafter forgets
    everything about those rows and rebuilds their state from the prompt, leaving the other
    rows untouched; its work is billed to the refill's ``prefill`` phase. It may be the first
    call of a run (slots filled before all are busy), so it sizes its buffers as ``reset`` does.
    The next ``propose`` sees every row, the refilled ones included.

    Optional method ``roofline_model(self, target_args) -> refspec.energy.model.roofline.DrafterModel |
    None``: the drafter's cost per draft forward for roofline predictions of a steady-state step
    (``target_args`` is the target's ``ModelArgs``); None means a free drafter that runs no
    forwards (n-gram lookup). A drafter without the method gets no prediction.
    """

    name: str
    hidden_layers: tuple[int, ...]

    def reset(self, state: DecodeState) -> None: ...

    def propose(self, state: DecodeState, k: int) -> Draft: ...

    def commit(self, state: DecodeState) -> None: ...

    def reset_rows(self, state: DecodeState, rows: torch.Tensor, hidden: list[torch.Tensor]) -> None: ...


class DrafterError(ValueError):
    """A drafter that cannot serve this target or these settings (with the reason)."""
