"""EAGLE drafters: a one-layer head that extrapolates the target's features (EAGLE-1/2/3).

The heads (``eagle``: EAGLE-1 feature regression; ``eagle3``: three fused target layers and a
reduced draft vocabulary) and their checkpoints live in :mod:`refspec.drafters.eagle_head`,
their training in :mod:`refspec.drafters.training.eagle`; this module drafts with a loaded
head and registers ``eagle`` and ``eagle3`` with the drafter registry.

Alignment: head cache slot j holds the pair ``(x_{j+1}, f_j)`` at rotary position j, and its
output at slot j predicts ``f_{j+1}`` (hence token ``x_{j+2}``).

Cache consistency (catch-up): the head keeps its own static KV cache, valid for every slot
below the target's committed length. Each ``propose`` first feeds the pairs of the features
the verifies since the last draft produced (``state.hidden`` of each step, the accepted path
for trees, held by a :class:`~refspec.drafters.feature_backlog.FeatureBacklog`: one step's
when every step drafts, several when the speculation policy ran steps with K = 0), at slots
from the first one the head lacks (a fixed width, so rows stay ragged without per-row control
flow); the output at slot ``lengths - 1`` gives the first draft. Draft entries written beyond
that are overwritten by the next catch-up before anything attends to them, so after a tree
step the head's cache holds exactly the accepted path. The catch-up of the prompt runs in
``reset`` (it belongs to the prefill phase); a backlog of more than
:data:`~refspec.drafters.feature_backlog.DEFAULT_LIMIT` columns (a long run of K = 0 steps)
is fed in ``commit``, billed there.

Drafting: a chain of K tokens (K - 1 head forwards after the catch-up), or an EAGLE-2 dynamic
tree: expand the ``tree_topk`` best children of the ``tree_topk`` best nodes of each level
(by cumulative log-probability) for ``tree_depth`` levels, then keep the ``tree_budget``
best nodes overall (a set closed under ancestors, because scores strictly decrease along a
path) and let the engine verify the whole tree in one target forward with a tree mask. When
sampling, the scores come from the same warped distribution (temperature, top-k, top-p) the
target is sampled from; the tree stays a deterministic function of the context, so it carries
no ``probs`` and the engine's recursive rejection sampling over it is exact.

Shapes: B batch, S query length, T cache length, K draft length, N tree nodes, E model dim,
V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from refspec.cache import StaticKVCache, causal_mask
from refspec.config import round_up
from refspec.drafters.eagle_head import (CONFIG, KEY_MAP, KINDS, WEIGHTS, Eagle1Head, Eagle3Head, EagleHead,
                                         HeadConfig, eagle3_layers, load_head, new_head, save_head)
from refspec.drafters.feature_backlog import FeatureBacklog
from refspec.drafters.training.eagle import EagleTrainer, EagleTrainingModule
from refspec.drafters.head_files import find_head, head_dir_name, shipped_heads_dir
from refspec.drafting import DecodeState, Draft, DrafterError, DraftTree
from refspec.energy.model.roofline import DrafterModel
from refspec.sampling import probs_from_logits, sample

log = logging.getLogger(__name__)

__all__ = [  # the drafter's own names, then those re-exported from where they live now
    "TreeConfig", "EagleDrafter", "build_drafter", "register_builtin",
    "CONFIG", "KEY_MAP", "KINDS", "WEIGHTS", "Eagle1Head", "Eagle3Head", "EagleHead", "HeadConfig", "eagle3_layers",
    "load_head", "new_head", "save_head", "EagleTrainer", "EagleTrainingModule", "find_head", "head_dir_name",
    "shipped_heads_dir",
]


# ---- the drafter --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeConfig:
    """EAGLE-2 dynamic tree settings.

    Attributes:
        topk: children expanded per node and nodes expanded per level.
        depth: levels drafted (the longest path).
        budget: nodes kept for verification (N).
    """

    topk: int = 4
    depth: int = 5
    budget: int = 16

    def __post_init__(self) -> None:
        if self.topk < 1 or self.depth < 1 or self.budget < 1:
            raise DrafterError(f"tree topk, depth and budget must be >= 1, got {self}")
        if self.budget > self.candidates:
            raise DrafterError(f"tree budget {self.budget} exceeds the {self.candidates} candidates that topk "
                               f"{self.topk} and depth {self.depth} generate")

    @property
    def candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk


class EagleDrafter:
    """Chain or tree drafting with an EAGLE head over a frozen target.

    Args:
        head: a loaded head (its ``feature_layers`` are the target layers the engine returns).
        target: the target ``Transformer`` (its embedding, and for EAGLE-1 its LM head, are used).
        tree: EAGLE-2 tree settings, or None to draft a chain of K tokens.
        kv_bucket: attended cache prefix granularity.
    """

    def __init__(self, head: EagleHead, target, *, tree: TreeConfig | None = None, kv_bucket: int = 64) -> None:
        head.config.check_target(target.args)
        self.head = head
        self.target = target
        self.tree = tree
        self.kv_bucket = kv_bucket
        self.name = head.config.kind
        self.hidden_layers: tuple[int, ...] = tuple(head.config.feature_layers)
        # the target writes the root plus N nodes per step; the engine reserves k + 1 + extra_slots
        self.extra_slots = tree.budget if tree is not None else 0
        self.cache: StaticKVCache | None = None
        # per row, the head's output at the committed length - 1 when its cache is already caught
        # up there (a prompt, a fed backlog): (feature [B, E], logits [B, Vd])
        self._primed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._backlog = FeatureBacklog()
        self._ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=target.device))  # [Vd]

    # -- helpers ----------------------------------------------------------------------------
    @property
    def _span(self) -> int:
        """Head cache slots a step writes past the committed length."""
        return (self.tree.depth - 1) * self.tree.topk + 1 if self.tree is not None else 0

    def _num_keys(self, state: DecodeState, width: int, k: int) -> int:
        return min(self.cache.max_len, round_up(state.max_length_bound + width + max(k, self._span) + 1,
                                                 self.kv_bucket))

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., Vd]`` -> ``[..., V]`` with -inf outside the draft vocabulary."""
        if self.head.config.draft_vocab_size == self.head.config.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.head.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self._ids, logits)

    @staticmethod
    def _tree_logp(logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Log-probabilities ``[..., Vd]`` that rank tree candidates: the warped q when sampling,
        so the budget goes to tokens the warped target can emit.

        Tokens the warp removes get -1e4 instead of -inf, so scores still fall strictly along a
        path and the kept set stays closed under ancestors; they rank below every token the warp keeps.
        """
        if state.sampling.greedy:
            return torch.log_softmax(logits, -1)
        # warping the Vd draft logits equals warping the full-vocabulary ones (-inf elsewhere)
        return probs_from_logits(logits, state.sampling).log().clamp_min(-1e4)

    def _catch_up(self, tokens: torch.Tensor, hidden: list[torch.Tensor], start: torch.Tensor, pick: torch.Tensor,
                  num_keys: int, cache=None):
        """Feed the pairs of ``hidden`` (each ``[B, W, E]``, column i at position ``start + i``)
        with the next ``tokens`` ``[B, T]`` at slots ``start + i`` (of ``cache``, default the
        head's); return the output at column ``pick`` ``[B]``.

        Returns:
            ``(feature [B, E], logits [B, Vd])`` predicted for the position after ``start + pick + 1``.
        """
        head, t = self.head, tokens.shape[1]
        cache = self.cache if cache is None else cache
        b, w = hidden[0].shape[:2]
        positions = (start[:, None] + torch.arange(w, device=start.device)).clamp_(max=cache.max_len - 1)
        nxt = tokens.gather(1, (positions + 1).clamp(max=t - 1))  # x_{j+1}
        emb = self.target.embed_tokens(nxt).to(head.dtype)
        pick = pick.clamp(0, w - 1)[:, None]  # [B, 1]
        out, logits = head.forward_draft(emb, list(hidden), positions, cache, positions,
                                         causal_mask(positions, num_keys), num_keys, self.target, logits_at=pick)
        feat = out.gather(1, pick[..., None].expand(b, 1, out.shape[-1])).squeeze(1)  # [B, E]
        return feat, logits[:, 0]

    def _ensure_cache(self, state: DecodeState) -> bool:
        """Size the head's KV cache for this batch; True when a new one was allocated."""
        b, t = state.tokens.shape
        size = t + self._span + 2
        if self.cache is not None and self.cache.batch == b and self.cache.max_len == size:
            return False
        hc = self.head.config
        self.cache = StaticKVCache(num_layers=1, batch=b, num_kv_heads=hc.num_kv_heads, max_len=size,
                                   head_dim=hc.head_dim, dtype=self.head.dtype, device=state.tokens.device)
        return True

    # -- protocol ---------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, state: DecodeState) -> None:
        b, dev = state.batch, state.tokens.device
        self._ensure_cache(state)
        self.cache.reset()
        w = state.hidden[0].shape[1]
        start = torch.zeros(b, dtype=torch.long, device=dev)
        # the prompt's pairs sit at slots 0..w-1 and attend causally: no key beyond them is read
        num_keys = min(self.cache.max_len, round_up(w, self.kv_bucket))
        self._primed = self._catch_up(state.tokens, state.hidden, start, state.prompt_lengths - 1, num_keys)
        self._backlog.reset(state.prompt_lengths)

    @torch.inference_mode()
    def reset_rows(self, state: DecodeState, rows: torch.Tensor, hidden: list[torch.Tensor]) -> None:
        """Catch up the new prompts of ``rows`` ``[R]`` (features ``hidden``, each ``[R, S, E]``)
        into those rows of the head cache; the next ``propose`` uses their outputs for those rows
        (features the backlog still holds for them belong to the old requests and are dropped)."""
        b, dev = state.batch, state.tokens.device
        if self._ensure_cache(state) or (self._primed is not None and self._primed[0].shape[0] != b):
            self._primed = None  # a previous batch's, of another shape
        w = hidden[0].shape[1]
        num_keys = min(self.cache.max_len, round_up(w, self.kv_bucket))
        zero = torch.zeros(rows.numel(), dtype=torch.long, device=dev)
        plens = state.prompt_lengths.index_select(0, rows)  # [R]
        feat, logits = self._catch_up(state.tokens.index_select(0, rows), list(hidden), zero, plens - 1, num_keys,
                                      cache=self.cache.rows(rows))  # [R, E], [R, Vd]
        if self._primed is None:
            self._primed = (feat.new_zeros(b, feat.shape[-1]), logits.new_zeros(b, logits.shape[-1]))
        feats, all_logits = self._primed
        feats[rows], all_logits[rows] = feat, logits
        self._backlog.reset_rows(rows, plens, b)

    def _feed_backlog(self, state: DecodeState, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up every committed position the head lacks; the head's output at ``lengths - 1``
        of every row ``(feature [B, E], logits [B, Vd])`` (rows with nothing to feed: primed)."""
        assert self._primed is not None, "reset() or reset_rows() must run before propose()"
        taken = self._backlog.take(state.lengths)
        if taken is None:  # nothing committed since the prompts' catch-up or the last feed
            return self._primed
        hidden, start, count = taken
        feat, logits = self._catch_up(state.tokens, hidden, start, count - 1,
                                      self._num_keys(state, hidden[0].shape[1], k))
        fresh = (count > 0)[:, None]  # [B, 1]; rows refilled since the last step keep their prompt's output
        self._primed = (torch.where(fresh, feat, self._primed[0]), torch.where(fresh, logits, self._primed[1]))
        return self._primed

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Draft:
        feat, logits = self._feed_backlog(state, k)
        if self.tree is not None:
            return self._propose_tree(state, feat, logits)
        return self._propose_chain(state, feat, logits, k)

    def _propose_chain(self, state: DecodeState, feat: torch.Tensor, logits: torch.Tensor, k: int) -> Draft:
        head = self.head
        num_keys = self._num_keys(state, 1, k)
        drafts, probs = [], []
        for i in range(k):
            if state.sampling.greedy:
                tok, q = head.to_target_ids(logits.argmax(-1)), None
            else:
                q = probs_from_logits(self._full_logits(logits), state.sampling)
                tok = sample(q, state.generator)
            drafts.append(tok)
            probs.append(q)
            if i == k - 1:
                break
            pos = (state.lengths + i).clamp(max=self.cache.max_len - 1)[:, None]  # [B, 1]
            emb = self.target.embed_tokens(tok[:, None]).to(head.dtype)
            out, logits = head.forward_draft(emb, feat[:, None], pos, self.cache, pos, causal_mask(pos, num_keys),
                                             num_keys, self.target)
            feat, logits = out[:, 0], logits[:, 0]  # [B, E], [B, Vd]
        tokens = torch.stack(drafts, dim=1)  # [B, K]
        return Draft(tokens=tokens, probs=None if state.sampling.greedy else torch.stack(probs, dim=1))

    def _propose_tree(self, state: DecodeState, feat: torch.Tensor, logits: torch.Tensor) -> Draft:
        """EAGLE-2: grow ``depth`` levels of the best ``topk`` nodes, keep the best ``budget``."""
        head, tc = self.head, self.tree
        b, dev = feat.shape[0], feat.device
        kk = tc.topk
        num_keys = self._num_keys(state, 1, 0)
        key_slot = torch.arange(num_keys, device=dev)
        base = state.lengths  # [B] first slot past the committed prefix
        # level 1: the root's top-k
        logp = self._tree_logp(logits, state)
        top = logp.topk(kk, dim=-1)
        score = top.values.double().clamp_max(-1e-6)  # [B, k]; strictly decreasing along any path
        tok = top.indices  # draft-vocabulary ids
        cand_tok, cand_score = [tok], [score]
        cand_parent = [torch.full((b, kk), -1, dtype=torch.long, device=dev)]
        cand_depth = [torch.ones(b, kk, dtype=torch.long, device=dev)]
        node_cand = torch.arange(kk, device=dev)[None].expand(b, kk)  # candidate index of each fed node
        node_feat = feat[:, None].expand(b, kk, feat.shape[-1])  # the feature each node is paired with
        rows = (key_slot[None, None] < base[:, None, None]).expand(b, kk, num_keys)  # committed keys
        n_cand = kk
        for level in range(1, tc.depth):
            slots = (base[:, None] + (level - 1) * kk + torch.arange(kk, device=dev)).clamp_(max=num_keys - 1)
            rows = rows | (key_slot[None, None] == slots[..., None])  # ancestors + self
            pos = (base + level - 1)[:, None].expand(b, kk)
            emb = self.target.embed_tokens(head.to_target_ids(tok)).to(head.dtype)
            out, logits = head.forward_draft(emb, node_feat, pos, self.cache, slots, rows[:, None], num_keys,
                                             self.target)  # [B, k, E], [B, k, Vd]
            logp = self._tree_logp(logits, state)  # [B, k, Vd]
            top = logp.topk(kk, dim=-1)  # [B, k, k]
            child_score = (score[..., None] + top.values.double().clamp_max(-1e-6)).reshape(b, kk * kk)
            child_tok = top.indices.reshape(b, kk * kk)
            child_parent = node_cand[:, :, None].expand(b, kk, kk).reshape(b, kk * kk)
            cand_tok.append(child_tok)
            cand_score.append(child_score)
            cand_parent.append(child_parent)
            cand_depth.append(torch.full((b, kk * kk), level + 1, dtype=torch.long, device=dev))
            # the next level expands the best k children
            best = child_score.topk(kk, dim=-1).indices  # [B, k]
            from_node = best // kk
            score = child_score.gather(1, best)
            tok = child_tok.gather(1, best)
            node_cand = n_cand + best
            node_feat = out.gather(1, from_node[..., None].expand(b, kk, out.shape[-1]))
            rows = rows.gather(1, from_node[..., None].expand(b, kk, num_keys))
            n_cand += kk * kk
        scores = torch.cat(cand_score, 1)  # [B, C]
        keep = scores.topk(tc.budget, dim=-1).indices.sort(dim=-1).values  # [B, N]; parents precede children
        tokens = head.to_target_ids(torch.cat(cand_tok, 1).gather(1, keep))
        parent_cand = torch.cat(cand_parent, 1).gather(1, keep)
        depth = torch.cat(cand_depth, 1).gather(1, keep)
        where = torch.searchsorted(keep, parent_cand.clamp_min(0))  # index of the parent among the kept
        parents = torch.where(parent_cand < 0, torch.zeros_like(where), where + 1)
        # children chosen deterministically from the context: probs None (one-hot q) is exact
        return Draft(tokens=tokens, tree=DraftTree(parents=parents, depth=depth, max_depth=tc.depth))

    @torch.inference_mode()
    def commit(self, state: DecodeState) -> None:
        """Hold the step's features for the next catch-up; feed them now when K = 0 steps have
        piled up more than the backlog's limit."""
        self._backlog.push(state)
        if self._backlog.full:
            self._feed_backlog(state, 0)

    def roofline_model(self, target_args) -> DrafterModel:
        """One decoder layer shaped like the target's, the ``fc`` (2E or 3E wide) and an LM head
        over the draft vocabulary, per draft forward."""
        hc = self.head.config
        return DrafterModel(name=f"{hc.kind}-1layer", layers=1, fc_inputs=2 if hc.kind == "eagle" else 3,
                            lm_head_rows=hc.draft_vocab_size)


# ---- the registry hook --------------------------------------------------------------------------


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off", ""):
            return False
        raise DrafterError(f"expected a boolean option, got {value!r}")
    return bool(value)


def build_drafter(kind: str, ctx) -> EagleDrafter:
    """Registry builder: options ``head`` (path), ``tree`` (bool), ``tree_budget``, ``tree_topk``,
    ``tree_depth``."""
    opts = ctx.options
    path = Path(opts["head"]) if opts.get("head") else find_head(ctx.target_name, kind)
    head, _ = load_head(path, ctx.target.args, device=ctx.device, dtype=ctx.dtype)
    if head.config.kind != kind:
        raise DrafterError(f"{path} holds an {head.config.kind} head, not {kind}; use --drafter {head.config.kind}")
    tree = None
    if _flag(opts.get("tree", False)):
        tree = TreeConfig(topk=int(opts.get("tree_topk", 4)), depth=int(opts.get("tree_depth", 5)),
                          budget=int(opts.get("tree_budget", 16)))
    return EagleDrafter(head, ctx.target, tree=tree)


def register_builtin(register) -> None:
    """Register ``eagle`` and ``eagle3`` with the drafter registry."""
    register("eagle", lambda ctx: build_drafter("eagle", ctx), default_k=4,
             help="EAGLE-1/2 feature head (option tree=true for EAGLE-2 dynamic trees)")
    register("eagle3", lambda ctx: build_drafter("eagle3", ctx), default_k=4,
             help="EAGLE-3 head fusing three target layers (option tree=true for dynamic trees)")

