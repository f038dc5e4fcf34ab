"""Training of block heads: random training blocks, the head's batched training forward, the loss
and the ``block`` trainer.

A head trained with block size ``K_max`` serves every K <= K_max by using the first K mask
embeddings; training mixes block lengths so the shorter prefixes are in-distribution.

The data plumbing (feature collection from the frozen target, checkpoints, the ``train`` CLI)
is shared with the other trained drafters in :mod:`refspec.drafters.training`, which finds
:func:`register_trainers` here.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from refspec.drafters.block_head import BlockHead, BlockHeadConfig, default_feature_layers
from refspec.drafting import DrafterError


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockLossConfig:
    """How training blocks are drawn and weighted.

    Attributes:
        anchors_per_row: blocks per training sequence (M); each starts at a random trained
            position (its first mask slot's label must be trained on).
        full_block_fraction: share of blocks of the full size K_max; the rest draw a length
            uniformly from 1..K_max, so the head also serves K < K_max.
        gamma: slot ``i`` (1-based) weighs ``exp(-(i - 1) / gamma)``: early drafts decide
            acceptance, later ones only count when every earlier one was right. The weight
            is applied by keeping slot ``i`` with that probability (an unbiased, cheaper
            estimate: the target's LM head only runs on kept slots).
    """

    anchors_per_row: int = 16
    full_block_fraction: float = 0.5
    gamma: float = 7.0


def sample_blocks(loss_mask: torch.Tensor, block_size: int, config: BlockLossConfig,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random training blocks.

    Args:
        loss_mask: ``[B, N]`` bool, positions whose next token is trained on.
        block_size: K_max.
        config: sampling settings.
        generator: random generator on ``loss_mask``'s device (None: the global one).

    Returns:
        ``(anchors [B, M], block_lens [B, M], row_ok [B])``: the pending-token position of each
        block (>= 1, with ``loss_mask`` True there), its number of mask slots, and whether the
        row had any such position (rows without one must not be trained on).
    """
    b, n = loss_mask.shape
    m, dev = config.anchors_per_row, loss_mask.device
    cand = loss_mask.clone()
    cand[:, 0] = False  # inference always has at least one context position
    row_ok = cand.any(1)
    weights = torch.where(row_ok[:, None], cand.float(), torch.ones(b, n, device=dev))
    anchors = torch.multinomial(weights, m, replacement=True, generator=generator)  # [B, M]
    rand_len = torch.randint(1, block_size + 1, (b, m), generator=generator, device=dev)
    full = torch.rand(b, m, generator=generator, device=dev) < config.full_block_fraction
    lens = torch.where(full, torch.full_like(rand_len, block_size), rand_len)
    return anchors, lens, row_ok


class _AutogradCache:
    """A training stand-in for :class:`StaticKVCache` with the interface the decoder layers use
    (``write`` and ``read``): one tensor per layer, written out of place, so a later layer's
    write does not invalidate what autograd saved of an earlier layer's read."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Same contract as :meth:`StaticKVCache.write` (``slots [B, S]``, ``k, v [B, S, Hkv, D]``)."""
        dt = self._k[layer].dtype  # under bf16 autocast the projections come out in bf16
        k, v = k.transpose(1, 2).to(dt), v.transpose(1, 2).to(dt)  # [B, Hkv, S, D], the buffers' layout
        idx = slots[:, None, :, None].expand_as(k)
        self._k[layer] = self._k[layer].scatter(2, idx, k)
        self._v[layer] = self._v[layer].scatter(2, idx, v)

    def read(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as :meth:`StaticKVCache.read`."""
        return self._k[layer][:, :, :num_keys], self._v[layer][:, :, :num_keys]


def block_training_states(head: BlockHead, target, features: Sequence[torch.Tensor], tokens: torch.Tensor,
                          anchors: torch.Tensor, block_lens: torch.Tensor) -> torch.Tensor:
    """Hidden states of every mask slot of many training blocks in one head forward.

    Every block sees the context features of the positions before its anchor and
    (non-causally) the slots of its own block up to its length, exactly as at inference; the M
    blocks of a sequence share one context cache and are kept apart by the mask.

    Args:
        head: the head being trained.
        target: the frozen target (its embedding is used).
        features: one ``[B, N, E]`` per feature layer: the target's features of the sequence.
        tokens: ``[B, N]`` token ids.
        anchors: ``[B, M]`` pending-token position of each block.
        block_lens: ``[B, M]`` mask slots of each block (1..K_max).

    Returns:
        ``[B, M, K_max, E]`` final-normed states of mask slots ``1..K_max``; slot ``i``
        predicts the token at ``anchor + i``; slots beyond a block's length are meaningless.
    """
    b, n = tokens.shape
    m, kmax = anchors.shape[1], head.block_size
    q = kmax + 1
    dev = tokens.device
    ctx = head.project([f.to(head.fc.weight.dtype) for f in features])  # [B, N, E]
    cache = _AutogradCache(head.num_layers, b, head.args.num_kv_heads, n + m * q, head.args.head_dim, ctx.dtype, dev)
    ctx_pos = torch.arange(n, device=dev)[None].expand(b, n)
    head.write_context(cache, ctx, ctx_pos, ctx_pos)
    last_ctx = ctx.gather(1, (anchors - 1).clamp_min(0)[..., None].expand(b, m, ctx.shape[-1]))  # [B, M, E]
    x = head.block_inputs(target, tokens.gather(1, anchors), kmax, last_ctx).reshape(b, m * q, -1)  # [B, M*Q, E]
    offs = torch.arange(q, device=dev)
    positions = (anchors[:, :, None] + offs).reshape(b, m * q)
    slots = (n + torch.arange(m * q, device=dev))[None].expand(b, m * q)
    ctx_vis = torch.arange(n, device=dev)[None, None] < anchors[:, :, None]  # [B, M, N]
    ctx_vis = ctx_vis[:, :, None].expand(b, m, q, n).reshape(b, m * q, n)
    same = torch.eye(m, dtype=torch.bool, device=dev)[None, :, None, :, None]  # [1, M, 1, M', 1]
    key_ok = offs[None, None, :] <= block_lens[:, :, None]  # [B, M', Q'] key inside its block's length
    itself = (offs[:, None] == offs[None, :])[None, None, :, None, :]  # [1, 1, Q, 1, Q']: a query sees itself
    blk_vis = same & (key_ok[:, None, None] | itself)  # [B, M, Q, M', Q']
    mask = torch.cat([ctx_vis, blk_vis.reshape(b, m * q, m * q)], dim=-1)[:, None]  # [B, 1, M*Q, N+M*Q]
    h = head.run(x, positions, cache, slots, mask, n + m * q)
    return h.view(b, m, q, -1)[:, :, 1:]


def text_labels(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels and loss mask of plain text (for tests and raw-text training).

    Args:
        tokens: ``[B, N]``.
        lengths: ``[B]`` valid tokens per row.

    Returns:
        ``(labels [B, N], loss_mask [B, N])``: ``labels[:, p] = tokens[:, p + 1]``, trained
        where ``p + 1 < length``.
    """
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    mask = torch.arange(tokens.shape[1], device=tokens.device)[None] < (lengths[:, None] - 1)
    return labels, mask


def block_loss(head: BlockHead, target, features: Sequence[torch.Tensor], tokens: torch.Tensor,
               labels: torch.Tensor, loss_mask: torch.Tensor, config: BlockLossConfig = BlockLossConfig(),
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of every block slot against the next token ``i`` steps ahead.

    Slot ``i`` of a block anchored at ``a`` is trained on ``labels[a + i - 1]`` (the token
    that follows position ``a + i - 1``: with :mod:`refspec.drafters.training` data the
    target's own greedy choice, which is what greedy verification accepts), where
    ``loss_mask[a + i - 1]`` holds; slots are kept with probability ``exp(-(i-1)/gamma)``.

    Args:
        head: the head being trained.
        target: the frozen target (embedding and LM head).
        features: one ``[B, N, E]`` per feature layer (the target's, on ``tokens``).
        tokens: ``[B, N]`` the sequence.
        labels: ``[B, N]`` next token after each position.
        loss_mask: ``[B, N]`` bool, positions whose label is trained on.
        config: block sampling and slot weights.
        generator: random generator (None: the global one, checkpointed by the training loop).

    Returns:
        ``(loss, stats)``: the scalar loss and floats ``acc@1`` (slot-1 accuracy) and
        ``tau@4``, ``tau@8``, ``tau@16``: 1 + mean leading correct slots of full-length
        blocks whose every label is trained (kept slots only, so lower under slot dropping).
        On the target's greedy text that is the acceptance greedy verification gives at each
        sampled anchor; decoding the same text scores less, since its anchors are where the
        previous block stopped, more often in hard stretches than uniform anchors are.
    """
    b, n = tokens.shape
    kmax, dev = head.block_size, tokens.device
    anchors, lens, row_ok = sample_blocks(loss_mask, kmax, config, generator)
    slot = torch.arange(1, kmax + 1, device=dev)
    idx = anchors[:, :, None] + slot - 1  # [B, M, K] position whose label slot i predicts
    inside = idx < n
    idx = idx.clamp(max=n - 1)
    trained = loss_mask.gather(1, idx.reshape(b, -1)).view_as(idx) & inside & row_ok[:, None, None]
    valid = trained & (slot <= lens[:, :, None])
    keep_p = torch.exp(-(slot.float() - 1) / config.gamma)
    keep = valid & (torch.rand(valid.shape, generator=generator, device=dev) < keep_p)
    keep[..., 0] |= valid[..., 0]  # slot 1 always (p = 1); also keeps the loss defined
    if not keep.any():
        raise ValueError("no trained position in this batch (loss_mask is all False)")
    y = labels.gather(1, idx.reshape(b, -1)).view_as(idx)
    h = block_training_states(head, target, features, tokens, anchors, lens)  # [B, M, K, E]
    logits = target.logits(h[keep].to(target.dtype))  # [n_keep, V] fp32
    loss = F.cross_entropy(logits, y[keep])
    with torch.no_grad():
        correct = torch.zeros_like(keep)
        correct[keep] = logits.argmax(-1) == y[keep]
        stats = {"acc@1": float(correct[..., 0][keep[..., 0]].float().mean())}
        lead = torch.cumprod(correct.long(), dim=-1).sum(-1)  # leading correct slots per block
        for kk in (4, 8, 16):
            if kk > kmax:
                continue
            full = trained[..., :kk].all(-1) & (lens >= kk)
            stats[f"tau@{kk}"] = float(1 + lead[full].clamp(max=kk).float().mean()) if full.any() else math.nan
    return loss, stats


@torch.no_grad()
def accepted_runs(head: BlockHead, target, features: Sequence[torch.Tensor], tokens: torch.Tensor,
                  labels: torch.Tensor, loss_mask: torch.Tensor, k: int, chunk: int = 64) -> torch.Tensor:
    """``[B, N]`` leading slots equal to ``labels`` of a full block of ``k`` anchored at every
    position (a slot whose label is not trained on ends the run; position 0 gets 0)."""
    b, n = tokens.shape
    runs = torch.zeros(b, n, dtype=torch.long, device=tokens.device)
    slot = torch.arange(1, k + 1, device=tokens.device)
    for start in range(1, n, chunk):
        anchors = torch.arange(start, min(start + chunk, n), device=tokens.device)[None].expand(b, -1)  # [B, M]
        h = block_training_states(head, target, features, tokens, anchors, torch.full_like(anchors, k))
        at = anchors[:, :, None] + slot - 1  # [B, M, k] position whose label slot i predicts
        idx = at.clamp(max=n - 1).reshape(b, -1)
        ok = loss_mask.gather(1, idx).view_as(at) & (at < n)
        guess = target.logits(h[:, :, :k].to(target.dtype)).argmax(-1)  # [B, M, k]
        hit = ok & (guess == labels.gather(1, idx).view_as(at))
        runs[:, start:start + anchors.shape[1]] = torch.cumprod(hit.long(), dim=-1).sum(-1)
    return runs


def walk(runs: torch.Tensor, loss_mask: torch.Tensor) -> list[list[int]]:
    """Tokens each block emits when every row is walked as greedy verification advances: from its
    first trained anchor ``a`` (>= 1) to ``a + runs[a] + 1``, while ``loss_mask`` holds there.

    Args:
        runs: ``[B, N]`` from :func:`accepted_runs`.
        loss_mask: ``[B, N]`` bool.
    """
    out = []
    for run, mask in zip(runs.tolist(), loss_mask.tolist()):
        a, emitted = next((i for i in range(1, len(mask)) if mask[i]), len(mask)), []
        while a < len(mask) and mask[a]:
            emitted.append(run[a] + 1)
            a += run[a] + 1
        out.append(emitted)
    return out


def walk_tau(head: BlockHead, target, features: Sequence[torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor,
             loss_mask: torch.Tensor, k: int) -> float:
    """Greedy decoding's acceptance replayed on text (``walk@k``): emitted tokens per block when
    blocks start where the last one stopped. On the target's own greedy text this is the tau
    decoding gives; ``block_loss``'s ``tau@k`` draws anchors uniformly, so it sits less often
    where blocks fail and reads higher."""
    emitted = [e for row in walk(accepted_runs(head, target, features, tokens, labels, loss_mask, k), loss_mask)
               for e in row]
    return sum(emitted) / len(emitted) if emitted else math.nan


@dataclasses.dataclass(frozen=True)
class BlockTrainer:
    """The :class:`refspec.drafters.training.Trainer` of block heads.

    Options: ``block_size`` (K_max, default 16), ``layers`` (head layers, default 1),
    ``intermediate_size`` (default: the target's), ``fusion`` (1: fuse each block input with
    the last context feature, see :class:`BlockHeadConfig`; 0: plain embeddings), ``pending`` (1: every mask slot
    also reads the pending token's embedding, ``BlockHeadConfig.pending_in_slots``), ``init`` (``target``: start the head's
    layers from the target's last layers; ``random``; or a saved head's directory, whose shape must
    be the options' own), ``anchors_per_row`` (16),
    ``full_block_fraction`` (0.5), ``gamma`` (7.0).
    """

    name: str = "block"
    description: str = "block drafter (DFlash-style): one forward drafts K tokens from fused target features"
    defaults: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"lr": 1e-3, "batch_size": 4, "seq_len": 256, "warmup_steps": 20})

    _OPTIONS = {"block_size": 16, "layers": 1, "intermediate_size": 0, "fusion": 1, "pending": 0, "init": "target",
                "anchors_per_row": 16, "full_block_fraction": 0.5, "gamma": 7.0}

    def option(self, options: dict[str, Any], key: str) -> Any:
        unknown = set(options) - set(self._OPTIONS)
        if unknown:
            raise DrafterError(f"unknown block training options {sorted(unknown)}; known: {sorted(self._OPTIONS)}")
        base = self._OPTIONS[key]
        return type(base)(options.get(key, base))

    def loss_config(self, options: dict[str, Any]) -> BlockLossConfig:
        return BlockLossConfig(anchors_per_row=self.option(options, "anchors_per_row"),
                               full_block_fraction=self.option(options, "full_block_fraction"),
                               gamma=self.option(options, "gamma"))

    def feature_layers(self, target, options: dict[str, Any] | None = None) -> tuple[int, ...]:
        return default_feature_layers(target.num_layers)

    def build(self, target, dataset, options: dict[str, Any]) -> nn.Module:
        config = BlockHeadConfig(feature_layers=self.feature_layers(target),
                                 block_size=self.option(options, "block_size"),
                                 num_layers=self.option(options, "layers"),
                                 intermediate_size=self.option(options, "intermediate_size") or None,
                                 input_fusion=bool(self.option(options, "fusion")),
                                 pending_in_slots=bool(self.option(options, "pending")))
        init = self.option(options, "init")
        if init in ("target", "random"):
            head = BlockHead(target.args, config)
            if init == "target":
                head.init_from_target(target)
        else:
            head = self._warm_start(init, target, config)
        head.loss_config = self.loss_config(options)
        return head.float().to(target.device)

    @staticmethod
    def _warm_start(folder: str, target, config: BlockHeadConfig) -> BlockHead:
        """The head saved in ``folder``, trainable, which must have the shape the options ask for."""
        if not Path(folder).is_dir():
            raise DrafterError(f"option init must be 'target', 'random' or a saved block head's directory, "
                               f"got {folder!r}")
        saved = BlockHead.load(folder, target_args=target.args)
        if saved.config != config:
            raise DrafterError(f"option init={folder} holds a head of another shape: {saved.config} (the options ask "
                               f"for {config})")
        return saved.requires_grad_(True).train()

    def loss(self, module: nn.Module, batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        feats = [batch.of(l) for l in module.config.feature_layers]
        mask = batch.loss_mask & batch.valid
        return block_loss(module, target, feats, batch.tokens, batch.labels, mask, module.loss_config)

    def held_out_metrics(self, module: nn.Module, batch, target) -> dict[str, float]:
        """The walked acceptance ``walk@K``, what greedy decoding would give (too dear for every step)."""
        feats = [batch.of(l) for l in module.config.feature_layers]
        mask = batch.loss_mask & batch.valid
        return {f"walk@{module.block_size}": walk_tau(module, target, feats, batch.tokens, batch.labels, mask,
                                                      module.block_size)}

    def export(self, module: nn.Module, out_dir: Path, provenance: dict[str, Any]) -> Path:
        return module.save(out_dir, provenance=provenance)


def register_trainers(register) -> None:
    """Register the ``block`` trainer with :mod:`refspec.drafters.training`."""
    register(BlockTrainer())

