"""Block drafting (in the spirit of DFlash): one drafter forward proposes all K drafts of a step.

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

So drafting costs one head forward of K + 1 tokens per row and an LM head over K tokens per
row, whatever K is; the target verifies the block as a chain. The target's features for the
positions committed by a step arrive in ``commit`` (``state.hidden`` entries
``0..num_accepted``); they are projected into the context cache at the start of the next
``propose`` so the draft phase is billed for it (the engine bills ``commit`` no work).

A head trained with block size ``K_max`` serves every K <= K_max by using the first K mask
embeddings; training mixes block lengths so the shorter prefixes are in-distribution.

Training (the loss and the head's batched training forward) lives here; the data plumbing
(feature collection from the frozen target, checkpoints, the ``train`` CLI) is shared with
the other trained drafters in :mod:`refspec.drafters.training`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from refspec.cache import StaticKVCache
from refspec.config import ModelArgs
from refspec.drafting import DecodeState, Draft, DrafterError
from refspec.models.transformer import Block, RMSNorm, apply_rope, rope_inv_freq
from refspec.phases import ForwardShape
from refspec.sampling import probs_from_logits, sample

log = logging.getLogger(__name__)

HEAD_FORMAT = "refspec-block-head"
HEAD_VERSION = 1
WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_K = 8


class HeadNotFoundError(DrafterError):
    """No trained block head for this target (the message gives the command that makes one)."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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
    """

    feature_layers: tuple[int, ...]
    block_size: int = 16
    num_layers: int = 1
    intermediate_size: int | None = None
    input_fusion: bool = True

    def __post_init__(self) -> None:
        if not self.feature_layers:
            raise DrafterError("a block head needs at least one target feature layer")
        if self.block_size < 1:
            raise DrafterError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_layers < 1:
            raise DrafterError(f"num_layers must be >= 1, got {self.num_layers}")


def head_args(target_args: ModelArgs, config: BlockHeadConfig) -> ModelArgs:
    """Architecture of the head's decoder layers: the target's family, norms, heads and rope,
    with ``config.num_layers`` full-attention layers and the head's MLP width."""
    return dataclasses.replace(
        target_args, num_layers=config.num_layers, layer_types=(), sliding_window=None,
        intermediate_size=config.intermediate_size or target_args.intermediate_size)


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
        layers: Lh refspec decoder :class:`~refspec.models.transformer.Block` s.
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
        self.fc = nn.Linear(len(config.feature_layers) * e, e, bias=False)
        self.ctx_norm = RMSNorm(e, a.rms_norm_eps, a.norm_plus_one)
        self.mask_embed = nn.Parameter(torch.randn(config.block_size, e) * 0.02)
        self.in_fc = None
        if config.input_fusion:
            self.in_fc = nn.Linear(2 * e, e, bias=False)
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

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables ``(cos, sin)``, each ``[B, 1, S, D]``, for ``positions [B, S]``."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        cos, sin = self.rope(positions, ctx.dtype)
        for i, blk in enumerate(self.layers):
            attn = blk.attn
            k = attn.wk(ctx).view(b, s, attn.hkv, attn.d).transpose(1, 2)  # [B, Hkv, S, D]
            v = attn.wv(ctx).view(b, s, attn.hkv, attn.d).transpose(1, 2)
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
        rope = self.rope(positions, x.dtype)
        for blk in self.layers:
            x = blk(x, rope, cache, slots, mask, num_keys)
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
        x = torch.cat([emb[:, :, None], masks.expand(b, m, k, e)], dim=2)  # [B, M, K+1, E]
        if self.in_fc is None:
            return x
        return self.in_fc(torch.cat([x, last_ctx[:, :, None].to(x.dtype).expand(b, m, k + 1, e)], dim=-1))

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

    # ---- persistence ------------------------------------------------------------------------
    def save(self, path: str | Path, *, provenance: dict[str, Any] | None = None,
             dtype: torch.dtype | None = torch.bfloat16) -> Path:
        """Write ``config.json`` and ``head.safetensors`` into the directory ``path``.

        Args:
            path: directory (created).
            provenance: free-form facts about training (command, data, loss, time).
            dtype: storage dtype of the weights (None keeps theirs).

        Returns:
            The directory.
        """
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {n: (p.detach().to(dtype) if dtype is not None else p.detach()).contiguous().cpu()
                   for n, p in self.state_dict().items()}
        tmp = out / (WEIGHTS_FILE + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, out / WEIGHTS_FILE)
        meta = {
            "format": HEAD_FORMAT, "version": HEAD_VERSION,
            "head": {**dataclasses.asdict(self.config), "feature_layers": list(self.config.feature_layers)},
            "target_args": _args_to_json(self.target_args),
            "provenance": provenance or {},
        }
        (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        log.info("saved block head (%d parameters) to %s", sum(p.numel() for p in self.parameters()), out)
        return out

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
        cfg_file, w_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not cfg_file.is_file() or not w_file.is_file():
            raise DrafterError(f"{folder} is not a block head directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        meta = json.loads(cfg_file.read_text())
        if meta.get("format") != HEAD_FORMAT or meta.get("version") != HEAD_VERSION:
            raise DrafterError(f"{cfg_file} is not a {HEAD_FORMAT} v{HEAD_VERSION} config "
                               f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
        trained_for = _args_from_json(meta["target_args"])
        if target_args is not None:
            fields = ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "family")
            diff = {f: (getattr(trained_for, f), getattr(target_args, f)) for f in fields
                    if getattr(trained_for, f) != getattr(target_args, f)}
            if diff:
                raise DrafterError(f"block head {folder} was trained for another target: "
                                   + ", ".join(f"{f} {a} (head) vs {b} (target)" for f, (a, b) in diff.items()))
        h = meta["head"]
        config = BlockHeadConfig(feature_layers=tuple(h["feature_layers"]), block_size=int(h["block_size"]),
                                 num_layers=int(h["num_layers"]), intermediate_size=h.get("intermediate_size"),
                                 input_fusion=bool(h.get("input_fusion", False)))
        head = cls(trained_for if target_args is None else target_args, config)
        state = load_file(str(w_file))
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DrafterError(f"block head {w_file} does not match its config: missing {sorted(missing)[:6]}, "
                               f"unexpected {sorted(unexpected)[:6]}")
        head.provenance = meta.get("provenance", {})
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _args_to_json(args: ModelArgs) -> dict[str, Any]:
    return dataclasses.asdict(args)


def _args_from_json(d: dict[str, Any]) -> ModelArgs:
    d = dict(d)
    for key in ("layer_types", "eos_token_ids"):
        d[key] = tuple(d.get(key) or ())
    return ModelArgs(**d)


# ---- the drafter --------------------------------------------------------------------------------
class BlockDrafter:
    """Drafts K tokens per row with one :class:`BlockHead` forward per step.

    Args:
        head: the trained (or, in tests, random) head; cast to the target's dtype and device.
        target: the target ``Transformer`` (its embedding and LM head are used, frozen).
        kv_bucket: attended context-cache prefix granularity (static shapes per bucket).

    Attributes:
        forwards: head forwards run since the last ``reset`` (one per step).
    """

    name = "block"

    def __init__(self, head: BlockHead, target, *, kv_bucket: int = 64) -> None:
        ta = target.args
        if head.target_args.hidden_size != ta.hidden_size or head.target_args.vocab_size != ta.vocab_size:
            raise DrafterError(f"block head was built for E={head.target_args.hidden_size}, "
                               f"V={head.target_args.vocab_size}; the target has E={ta.hidden_size}, V={ta.vocab_size}")
        if max(head.config.feature_layers) > target.num_layers:
            raise DrafterError(f"block head reads target layer {max(head.config.feature_layers)} but the target has "
                               f"{target.num_layers} layers")
        self.head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.target = target
        self.hidden_layers: tuple[int, ...] = tuple(head.config.feature_layers)
        self.kv_bucket = kv_bucket
        self.cache: StaticKVCache | None = None
        self.forwards = 0
        self._pending: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self._absorbed = 0  # feature positions per row projected by the latest absorb (for the cost model)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (ctx [B, S, E], start [B]) of that absorb

    @property
    def block_size(self) -> int:
        return self.head.block_size

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.target.dtype).bits // 8

    # ---- protocol -----------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, state: DecodeState) -> None:
        b, t = state.tokens.shape
        c = self.cache
        if c is None or c.batch != b or c.max_len != t or c.k.dtype != self.target.dtype:
            self.cache = self.head.new_cache(b, t, self.target.dtype, self.target.device)
        self.cache.reset()
        self._pending = (list(state.hidden), torch.zeros_like(state.prompt_lengths))
        self._absorb()
        self.forwards = 0

    def commit(self, state: DecodeState) -> None:
        # entries 0..num_accepted of state.hidden are the features of positions prev_lengths + i;
        # they are projected at the start of the next propose (billed to the draft phase)
        self._pending = (list(state.hidden), state.prev_lengths)

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Draft:
        if not 1 <= k <= self.block_size:
            raise DrafterError(f"the block head drafts at most {self.block_size} tokens per forward (its block "
                               f"size); got k={k}. Use k <= {self.block_size} or train a head with a larger block")
        self._absorbed = 0
        if self._pending is not None:
            self._absorb()
        assert self.cache is not None, "reset() must run before propose()"
        b, t = state.tokens.shape
        dev = state.tokens.device
        assert state.pending.shape == (b,) and state.lengths.shape == (b,), "pending and lengths are [B]"
        base = state.lengths  # [B] position of the pending token; context is every slot below it
        offs = torch.arange(k + 1, device=dev)
        positions = (base[:, None] + offs).clamp_(max=t - 1)  # [B, K+1]
        num_keys = min(t, _round_up(state.max_length_bound + k, self.kv_bucket))
        visible = torch.arange(num_keys, device=dev)[None] < (base + k + 1)[:, None]  # [B, Tk]
        mask = visible[:, None, None, :].expand(b, 1, k + 1, num_keys)
        ctx, start = self._last
        last_idx = (base - 1 - start).clamp_(0, ctx.shape[1] - 1)  # [B] index of position L-1 in ctx
        last_ctx = ctx.gather(1, last_idx[:, None, None].expand(b, 1, ctx.shape[-1]))  # [B, 1, E]
        x = self.head.block_inputs(self.target, state.pending[:, None], k, last_ctx)[:, 0]  # [B, K+1, E]
        h = self.head.run(x, positions, self.cache, positions, mask, num_keys)  # [B, K+1, E]
        logits = self.target.logits(h[:, 1:])  # [B, K, V] fp32
        self.forwards += 1
        if state.sampling.greedy:
            return Draft(tokens=logits.argmax(-1), probs=None)
        q = probs_from_logits(logits, state.sampling)  # [B, K, V]
        tokens = sample(q.reshape(b * k, -1), state.generator).view(b, k)
        return Draft(tokens=tokens, probs=q)

    def _absorb(self) -> None:
        """Project pending target features into the context cache at their positions."""
        assert self._pending is not None and self.cache is not None
        hidden, start = self._pending
        self._pending = None
        s = hidden[0].shape[1]
        t = self.cache.max_len
        pos = (start[:, None] + torch.arange(s, device=start.device)).clamp_(max=t - 1)  # [B, S]
        ctx = self.head.project([h.to(self.target.dtype) for h in hidden])
        self.head.write_context(self.cache, ctx, pos, pos)
        self._absorbed = s
        self._last = (ctx, start)

    # ---- cost model ---------------------------------------------------------------------------
    def _absorb_shape(self, rows: int, positions: int) -> ForwardShape:
        """The feature projection of ``positions`` per row: ``fc`` and every head layer's K/V
        projection. Modelled as a forward with no decoder layer and no LM head: its FLOPs and
        its weight, feature-read and context-write bytes are declared as extras (the model
        also counts an embedding-sized read and write of E per token, a slight overcount)."""
        a, bts = self.head.args, self.dtype_bytes
        e, n = a.hidden_size, rows * positions
        f = len(self.hidden_layers)
        kv_width = 2 * a.num_kv_heads * a.head_dim
        flops = 2 * n * (f * e * e + self.head.num_layers * e * kv_width)
        weight_bytes = bts * (f * e * e + e + self.head.num_layers * e * kv_width)
        io_bytes = bts * n * (f * e + self.head.num_layers * kv_width)  # features in, context K/V out
        return ForwardShape(args=a, rows=rows, tokens_per_row=positions, context_tokens=0, dtype_bytes=bts,
                            lm_head_tokens=0, layers=0, extra_weight_bytes=weight_bytes + io_bytes, extra_flops=flops)

    def draft_work(self, state: DecodeState, k: int) -> tuple[ForwardShape, ...]:
        """One absorb of the last step's features and one head forward of K+1 tokens per row
        (K of which reach the target's LM head)."""
        b, a = state.batch, self.head.args
        e, n = a.hidden_size, b * (k + 1)
        fusion = 2 * e * e if self.head.in_fc is not None else 0  # in_fc over every block input
        # the model's embedding-gather term (B(K+1) rows) covers the B pending-token rows and the K mask rows
        block = ForwardShape(args=a, rows=b, tokens_per_row=k + 1, context_tokens=b * (state.max_length_bound + k),
                             dtype_bytes=self.dtype_bytes, lm_head_tokens=b * k, layers=self.head.num_layers,
                             extra_weight_bytes=self.dtype_bytes * fusion, extra_flops=2 * n * fusion)
        if self._absorbed:
            return (self._absorb_shape(b, self._absorbed), block)
        return (block,)

    def prefill_work(self, state: DecodeState) -> tuple[ForwardShape, ...]:
        """Projection of the whole (padded) prompt's features into the context cache."""
        s = state.hidden[0].shape[1] if state.hidden else int(state.prompt_lengths.max().item())
        return (self._absorb_shape(state.batch, s),)


# ---- training -----------------------------------------------------------------------------------
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


class _LayerView:
    """``cache.k[layer, ...]`` indexing over a list of per-layer tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, idx: tuple) -> torch.Tensor:
        return self.tensors[idx[0]][idx[1:]]


class _AutogradCache:
    """A training stand-in for :class:`StaticKVCache` with the interface the decoder layers use
    (``write`` and ``k``/``v[layer, ...]``): one tensor per layer, written out of place, so a
    later layer's write does not invalidate what autograd saved of an earlier layer's read."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k, self.v = _LayerView(self._k), _LayerView(self._v)
        self.max_len = max_len

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Same contract as :meth:`StaticKVCache.write` (``slots [B, S]``, ``k, v [B, Hkv, S, D]``)."""
        idx = slots[:, None, :, None].expand_as(k)
        self._k[layer] = self._k[layer].scatter(2, idx, k)
        self._v[layer] = self._v[layer].scatter(2, idx, v)


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
        blocks whose every label is trained, the acceptance length greedy verification would
        give on this text (kept slots only, so a lower bound under slot dropping).
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


@dataclasses.dataclass(frozen=True)
class BlockTrainer:
    """The :class:`refspec.drafters.training.Trainer` of block heads.

    Options: ``block_size`` (K_max, default 16), ``layers`` (head layers, default 1),
    ``intermediate_size`` (default: the target's), ``fusion`` (1: fuse each block input with
    the last context feature, see :class:`BlockHeadConfig`; 0: plain embeddings), ``init`` (``target``: start the head's
    layers from the target's last layers; ``random``), ``anchors_per_row`` (16),
    ``full_block_fraction`` (0.5), ``gamma`` (7.0).
    """

    name: str = "block"
    description: str = "block drafter (DFlash-style): one forward drafts K tokens from fused target features"
    defaults: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"lr": 1e-3, "batch_size": 4, "seq_len": 256, "warmup_steps": 20})

    _OPTIONS = {"block_size": 16, "layers": 1, "intermediate_size": 0, "fusion": 1, "init": "target",
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

    def feature_layers(self, target) -> tuple[int, ...]:
        return default_feature_layers(target.num_layers)

    def build(self, target, dataset, options: dict[str, Any]) -> nn.Module:
        config = BlockHeadConfig(feature_layers=self.feature_layers(target),
                                 block_size=self.option(options, "block_size"),
                                 num_layers=self.option(options, "layers"),
                                 intermediate_size=self.option(options, "intermediate_size") or None,
                                 input_fusion=bool(self.option(options, "fusion")))
        head = BlockHead(target.args, config)
        init = self.option(options, "init")
        if init == "target":
            head.init_from_target(target)
        elif init != "random":
            raise DrafterError(f"option init must be 'target' or 'random', got {init!r}")
        head.loss_config = self.loss_config(options)
        return head.float().to(target.device)

    def loss(self, module: nn.Module, batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        feats = [batch.of(l) for l in module.config.feature_layers]
        return block_loss(module, target, feats, batch.tokens, batch.labels, batch.loss_mask & batch.valid,
                          module.loss_config)

    def export(self, module: nn.Module, out_dir: Path, provenance: dict[str, Any]) -> Path:
        return module.save(out_dir, provenance=provenance)


def register_trainers(register) -> None:
    """Register the ``block`` trainer with :mod:`refspec.drafters.training`."""
    register(BlockTrainer())


# ---- finding heads and the registry ------------------------------------------------------------
def head_name(target_name: str) -> str:
    """Directory name of the block head of a target id or model directory."""
    return f"{Path(str(target_name).rstrip('/')).name}-block"


def head_search_path(target_name: str) -> list[Path]:
    """Where a head for ``target_name`` is looked for, in order: the heads shipped with
    refspec, then ``$REFSPEC_HOME/heads``."""
    from refspec.assets import refspec_home

    name = head_name(target_name)
    return [Path(__file__).resolve().parent / "heads" / name, refspec_home() / "heads" / name]


#: Training settings of the shipped SmolLM2 head (a short CPU run; see its README.md). The
#: shared CLI's defaults (more data, 2000 steps) make a better head in more time.
SHIPPED_RECIPE = ("--dtype fp32 --chat-prompts 24 --math-prompts 8 --code-prompts 8 --reply-tokens 96 "
                  "--chat-references 64 --math-references 16 --code-references 16 --prose-chunks 24 "
                  "--max-len 256 --steps 500 --lr 2e-3 --max-time-min 15 --checkpoint-every 50 "
                  "--option anchors_per_row=16")


def train_command(target_name: str) -> str:
    """The command that trains the block head of ``target_name`` into
    ``$REFSPEC_HOME/heads/<id>-block`` (where :func:`find_head` looks)."""
    return f"python -m refspec.drafters.train --drafter block --model {target_name} {SHIPPED_RECIPE}"


def find_head(target_name: str) -> Path:
    """The directory of the block head for ``target_name``.

    Raises:
        HeadNotFoundError: none exists; the message names the places searched and the
            command that trains one.
    """
    places = head_search_path(target_name)
    for p in places:
        if (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file():
            return p
    raise HeadNotFoundError(
        f"no block head for {target_name!r}: looked in {', '.join(str(p) for p in places)}. "
        f"Train one (the shipped SmolLM2 head's recipe: under 25 min on 2 CPU cores) with:\n"
        f"    {train_command(target_name)}\n"
        "or pass a head directory with the drafter option head=PATH")


def register_builtin(register) -> None:
    """Register ``block`` (options: ``head``, a head directory; default: the trained head of the
    target, see :func:`find_head`)."""

    def build(ctx):
        path = ctx.options.get("head")
        folder = Path(path) if path else find_head(ctx.target_name)
        head = BlockHead.load(folder, target_args=ctx.target.args, dtype=ctx.dtype, device=ctx.device)
        log.info("block head from %s (block size %d, %d layers)", folder, head.block_size, head.num_layers)
        return BlockDrafter(head, ctx.target)

    register("block", build, help="one forward drafts a block of K tokens from the target's features (DFlash-style)",
             default_k=DEFAULT_K)
