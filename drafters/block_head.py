"""The block drafter's head and its checkpoint (the drafter is :mod:`refspec.drafters.block`).

The head is a small transformer conditioned on the target's own hidden features:

* **context**: for every committed position the outputs of a few target layers (low, middle,
  high; ``feature_layers``) are concatenated and projected to E by ``fc`` (then RMS-normed).
  Each head layer turns these projected features into keys and values with its own ``wk``/
  ``wv`` (rotated to the position), kept in the drafter's static context cache
  ``[Lh, B, Hkv, T, D]``, a :class:`~refspec.cache.StaticKVCache` indexed like the target's;
* **block**: K + 1 queries per row: the embedding of the pending token (the last emitted
  token, position ``L``) followed by K learned mask embeddings at positions ``L+1 .. L+K``;
* **attention**: every block query sees the row's context slots ``< L`` and the whole block
  (non-causal inside it). The block's own keys are written at slots ``L .. L+K`` of the same
  cache; those slots are overwritten with true context features as soon as the target has
  committed them, exactly like rejected target KV entries;
* **output**: the head's final norm and the target's (frozen) LM head turn the K mask slots
  into K next-token distributions; slot ``i`` predicts the token at position ``L+i``.

Checkpoints: :meth:`BlockHead.save` and :meth:`BlockHead.load`, in the format of
:mod:`refspec.drafters.block_checkpoint`.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from refspec.cache import StaticKVCache
from refspec.drafters.block_checkpoint import (CONFIG_FILE, HEAD_FORMAT, HEAD_VERSION, WEIGHTS_FILE,  # noqa: F401
                                               read_head_config, save_head)
from refspec.config import ModelArgs
from refspec.drafting import DrafterError
from refspec.energy.model.work import ForwardShape, record_forward, recording
from refspec.models.attention import CacheAttention
from refspec.models.layers import Block, Linear, RMSNorm
from refspec.models.ops import apply_rope, attention_bias, rope_inv_freq, rope_tables


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers (EAGLE-3's choice: 2, L/2, L-3), clamped and sorted.

    Args:
        num_target_layers: L of the target.

    Returns:
        Layer indices as ``Transformer.forward(hidden_layers=...)`` takes them.
    """
    n = num_target_layers
    return tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockHeadConfig:
    """Shape of a block head (the target's architecture supplies everything else).

    Attributes:
        feature_layers: target layers whose outputs are fused into the context features.
        block_size: K_max, the most drafts one forward proposes (one mask embedding each).
        num_layers: Lh, decoder layers of the head.
        intermediate_size: MLP width of the head layers (None: the target's).
        input_fusion: every block input is ``in_fc(cat(embedding, c))`` where ``c`` is the
            projected feature of the position just before the block (as EAGLE fuses token and
            feature), so each slot sees the most informative feature without an attention hop;
            False feeds plain embeddings (context only through attention, as DFlash).
        pending_in_slots: every mask slot's input is ``mask_i + embedding(pending token)``, so
            slot 1 reads what EAGLE's first step reads (token and last feature) without an
            attention hop; False: the mask embedding alone.
        layer_args: ``ModelArgs`` fields of the head's layers that differ from the target's
            (a published DFlash draft has Qwen3 layers with heads of its own); None: the target's.
    """

    feature_layers: tuple[int, ...]
    block_size: int = 16
    num_layers: int = 1
    intermediate_size: int | None = None
    input_fusion: bool = True
    pending_in_slots: bool = False
    layer_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.feature_layers:
            raise DrafterError("a block head needs at least one target feature layer")
        if self.block_size < 1:
            raise DrafterError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_layers < 1:
            raise DrafterError(f"num_layers must be >= 1, got {self.num_layers}")


def head_args(target_args: ModelArgs, config: BlockHeadConfig) -> ModelArgs:
    """Architecture of the head's decoder layers: the target's family, norms, heads and rope,
    with ``config.num_layers`` full-attention layers, the head's MLP width and its ``layer_args``."""
    return dataclasses.replace(
        target_args, num_layers=config.num_layers, layer_types=(), sliding_window=None,
        intermediate_size=config.intermediate_size or target_args.intermediate_size, **(config.layer_args or {}))


class BlockHead(nn.Module):
    """The trainable part of the block drafter (the target's embedding and LM head are reused).

    Args:
        target_args: architecture of the target the head drafts for.
        config: head shape.

    Attributes:
        fc: ``[E, F*E]`` projection of the concatenated features of F target layers.
        ctx_norm: RMSNorm of the projected context features.
        mask_embed: ``[K_max, E]`` learned input of mask slot ``1..K_max``.
        in_fc: ``[E, 2E]`` fusion of each block input with the last context feature (only
            with ``config.input_fusion``; initialised to pass the embedding through).
        layers: Lh refspec decoder :class:`~refspec.models.layers.Block` s.
        norm: final RMSNorm before the target's LM head.
    """

    def __init__(self, target_args: ModelArgs, config: BlockHeadConfig) -> None:
        super().__init__()
        bad = [i for i in config.feature_layers if not 0 <= i <= target_args.num_layers]
        if bad:
            raise DrafterError(f"feature layers {bad} are out of range for a target of {target_args.num_layers} "
                               "layers (valid: 0..L, L being the final-normed state)")
        self.config = config
        self.target_args = target_args
        self.args = head_args(target_args, config)
        a, e = self.args, target_args.hidden_size
        self.fc = Linear(len(config.feature_layers) * e, e, bias=False)
        self.ctx_norm = RMSNorm(e, a.rms_norm_eps, a.norm_plus_one)
        self.mask_embed = nn.Parameter(torch.randn(config.block_size, e) * 0.02)
        self.in_fc = None
        if config.input_fusion:
            self.in_fc = Linear(2 * e, e, bias=False)
            with torch.no_grad():
                self.in_fc.weight[:, :e].copy_(torch.eye(e))
                self.in_fc.weight[:, e:].normal_(0.0, 0.02 / math.sqrt(e))
        self.layers = nn.ModuleList(Block(a, i) for i in range(config.num_layers))
        self.norm = RMSNorm(e, a.rms_norm_eps, a.norm_plus_one)
        self.register_buffer("inv_freq", rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), persistent=False)

    # ---- pieces shared by inference and training ----------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> StaticKVCache:
        """A context cache ``[Lh, B, Hkv, T, D]`` for this head."""
        a = self.args
        return StaticKVCache(num_layers=a.num_layers, batch=batch, num_kv_heads=a.num_kv_heads, max_len=max_len,
                             head_dim=a.head_dim, dtype=dtype, device=device)

    def project(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        """Fuse target features into context features.

        Args:
            features: one ``[B, S, E]`` per feature layer, in ``config.feature_layers`` order.

        Returns:
            ``[B, S, E]`` projected, normed context features.
        """
        assert len(features) == len(self.config.feature_layers), "one feature tensor per feature layer"
        assert all(f.shape[-1] == self.target_args.hidden_size for f in features), "features are [B, S, E]"
        return self.ctx_norm(self.fc(torch.cat(list(features), dim=-1)))

    def write_context(self, cache, ctx: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor) -> None:
        """Turn context features into every head layer's keys/values and store them.

        Args:
            cache: the context cache.
            ctx: ``[B, S, E]`` projected context features.
            positions: ``[B, S]`` rotary position of each feature.
            slots: ``[B, S]`` cache slot of each feature.
        """
        b, s, _ = ctx.shape
        assert positions.shape == (b, s) and slots.shape == (b, s), "positions and slots are [B, S]"
        cos, sin = rope_tables(positions, self.inv_freq, ctx.dtype)
        for i, blk in enumerate(self.layers):
            attn = blk.attn
            k, v = attn.project_kv(ctx)  # [B, S, Hkv, D]
            if attn.k_norm is not None:
                k = attn.k_norm(k)
            cache.write(i, slots, apply_rope(k, cos, sin), v)

    def run(self, x: torch.Tensor, positions: torch.Tensor, cache, slots: torch.Tensor,
            mask: torch.Tensor, num_keys: int) -> torch.Tensor:
        """The head's decoder layers over block queries (their K/V are written at ``slots``).

        Args:
            x: ``[B, S, E]`` block inputs.
            positions: ``[B, S]`` rotary positions.
            cache: the context cache (holds the context K/V).
            slots: ``[B, S]`` slots the block's own K/V go to.
            mask: ``[B, 1, S, Tk]`` bool visibility of key slots.
            num_keys: Tk.

        Returns:
            ``[B, S, E]`` final-normed hidden states.
        """
        b, s, _ = x.shape
        assert positions.shape == (b, s) and slots.shape == (b, s), "positions and slots are [B, S]"
        assert mask.shape == (b, 1, s, num_keys), f"mask must be [B, 1, S, Tk], got {tuple(mask.shape)}"
        rope = rope_tables(positions, self.inv_freq, x.dtype)
        attn = self.layers[0].attn
        bias = attention_bias(mask, attn.hkv, attn.h // attn.hkv, x.dtype)
        ctx = CacheAttention(cache, slots, num_keys, (rope, None), (bias, None))  # full-attention layers only
        for blk in self.layers:
            x = blk(x, ctx)
        return self.norm(x)

    def block_inputs(self, target, first: torch.Tensor, k: int, last_ctx: torch.Tensor) -> torch.Tensor:
        """Inputs of blocks: the first token's embedding then ``k`` mask embeddings, each fused
        with the block's last context feature when ``config.input_fusion``.

        Args:
            target: the target (its embedding is used, frozen).
            first: ``[B, M]`` first token of each block.
            k: mask slots per block.
            last_ctx: ``[B, M, E]`` projected context feature of the position before each block.

        Returns:
            ``[B, M, k+1, E]``.
        """
        b, m = first.shape
        masks = self.mask_embed[:k]
        e = masks.shape[-1]
        assert last_ctx.shape == (b, m, e), "last_ctx is [B, M, E]"
        emb = target.embed_tokens(first).to(masks.dtype)  # [B, M, E]
        slots = masks.expand(b, m, k, e)
        if self.config.pending_in_slots:
            slots = slots + emb[:, :, None]
        x = torch.cat([emb[:, :, None], slots], dim=2)  # [B, M, K+1, E]
        if self.in_fc is None:
            return x
        return self.in_fc(torch.cat([x, last_ctx[:, :, None].to(x.dtype).expand(b, m, k + 1, e)], dim=-1))

    def absorb(self, cache, features: Sequence[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """:meth:`project` target features and :meth:`write_context` them at ``positions [B, S]``
        (slots = positions); records the work. Returns the ``[B, S, E]`` context features."""
        ctx = self.project(features)
        self.write_context(cache, ctx, positions, positions)
        if recording():
            record_forward(self.absorb_shape(*ctx.shape[:2]))
        return ctx

    def absorb_shape(self, rows: int, positions: int) -> ForwardShape:
        """The work of :meth:`absorb` over ``positions`` per row: ``fc`` and every head layer's
        K/V projection. A forward with no decoder layer and no LM head: its FLOPs and its weight,
        feature-read and context-write bytes are extras (the cost model also counts an
        embedding-sized read and write of E per token, a slight overcount)."""
        a, bts = self.args, torch.finfo(self.fc.weight.dtype).bits // 8
        e, n = a.hidden_size, rows * positions
        kv_width = 2 * a.num_kv_heads * a.head_dim
        matrices = self.fc.weight.numel() + self.num_layers * e * kv_width  # fc + each layer's wk, wv
        io_bytes = bts * n * (self.fc.weight.shape[1] + self.num_layers * kv_width)  # features in, K/V out
        return ForwardShape(args=a, rows=rows, tokens_per_row=positions, context_tokens=0, dtype_bytes=bts,
                            lm_head_tokens=0, layers=0, extra_weight_bytes=bts * (matrices + e) + io_bytes,
                            extra_flops=2 * n * matrices)

    def draft(self, target, first: torch.Tensor, k: int, last_ctx: torch.Tensor, positions: torch.Tensor, cache,
              mask: torch.Tensor, num_keys: int) -> torch.Tensor:
        """One drafting forward: :meth:`block_inputs`, :meth:`run` and the target's LM head over
        the K mask slots; records the work.

        Args:
            target: the target (embedding and LM head, frozen).
            first: ``[B]`` pending token of each row.
            k: mask slots.
            last_ctx: ``[B, 1, E]`` context feature of the position before the block.
            positions, cache, mask, num_keys: as for :meth:`run` (slots = positions).

        Returns:
            ``[B, K, V]`` fp32 logits of the mask slots.
        """
        x = self.block_inputs(target, first[:, None], k, last_ctx)[:, 0]  # [B, K+1, E]
        h = self.run(x, positions, cache, positions, mask, num_keys)  # [B, K+1, E]
        logits = target.logits(h[:, 1:])  # [B, K, V]
        if recording():
            b, s, e = x.shape
            bts = torch.finfo(x.dtype).bits // 8
            fusion = self.in_fc.weight.numel() if self.in_fc is not None else 0
            lm_tokens, vocab = logits.shape[0] * logits.shape[1], logits.shape[-1]
            copy = target.multirow_matrix_bytes(lm_tokens)  # the target's LM head streams its CPU copy, if kept
            copy_bytes = (copy - bts) * vocab * e if copy is not None and lm_tokens > 1 else 0
            # the embedding-gather term (B(K+1) rows) covers the B pending-token rows and the K mask rows
            record_forward(ForwardShape(args=self.args, rows=b, tokens_per_row=s, context_tokens=b * num_keys,
                                        dtype_bytes=bts, lm_head_tokens=lm_tokens, lm_head_rows=vocab,
                                        layers=self.num_layers, extra_weight_bytes=bts * fusion + copy_bytes,
                                        extra_flops=2 * b * s * fusion))
        return logits

    def init_from_target(self, target) -> None:
        """Start from the target's last ``Lh`` layers and final norm (same shapes required),
        the mask embeddings from the mean token embedding: a warm start for short training."""
        if self.args.intermediate_size != target.args.intermediate_size:
            raise DrafterError("init_from_target needs the target's MLP width (intermediate_size=None)")
        with torch.no_grad():
            src = list(target.layers)[-self.num_layers:]
            for dst, blk in zip(self.layers, src):
                dst.load_state_dict(blk.state_dict())
            self.norm.load_state_dict(target.norm.state_dict())
            mean = target.embed.weight.float().mean(0)
            std = target.embed.weight.float().std()
            self.mask_embed.copy_(mean + std * torch.randn_like(self.mask_embed))

    # ---- persistence (drafters/block_checkpoint.py) ------------------------------------------
    def save(self, path: str | Path, *, provenance: dict[str, Any] | None = None,
             dtype: torch.dtype | None = torch.bfloat16) -> Path:
        """Write ``config.json`` and ``head.safetensors`` into the directory ``path`` (created);
        ``provenance``: free-form facts about training; ``dtype``: storage dtype (None keeps theirs)."""
        return save_head(self, path, provenance=provenance, dtype=dtype)

    @classmethod
    def load(cls, path: str | Path, *, target_args: ModelArgs | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> "BlockHead":
        """Read a head written by :meth:`save`.

        Args:
            path: the head directory.
            target_args: the target it will serve; a head trained for another architecture is
                refused (hidden size, vocabulary or layer count differ).
            dtype: parameter dtype.
            device: parameter device.

        Raises:
            DrafterError: missing files, another format, a mismatched target, or bad keys.
        """
        from safetensors.torch import load_file

        folder = Path(path)
        meta, trained_for = read_head_config(folder, target_args)
        h = meta["head"]
        config = BlockHeadConfig(feature_layers=tuple(h["feature_layers"]), block_size=int(h["block_size"]),
                                 num_layers=int(h["num_layers"]), intermediate_size=h.get("intermediate_size"),
                                 input_fusion=bool(h.get("input_fusion", False)),
                                 pending_in_slots=bool(h.get("pending_in_slots", False)), layer_args=h.get("layer_args"))
        head = cls(trained_for if target_args is None else target_args, config)
        w_file = folder / WEIGHTS_FILE
        missing, unexpected = head.load_state_dict(load_file(str(w_file)), strict=False)
        if missing or unexpected:
            raise DrafterError(f"block head {w_file} does not match its config: missing {sorted(missing)[:6]}, "
                               f"unexpected {sorted(unexpected)[:6]}")
        head.provenance = meta.get("provenance", {})
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
