"""The shared body of the EAGLE heads: their configuration and the one-decoder-layer module
(:class:`EagleHead`) that the EAGLE-1 (:mod:`refspec.drafters.eagle_head`) and EAGLE-3
(:mod:`refspec.drafters.eagle3_head`) heads specialise.

A head forward (:meth:`EagleHead.forward_draft`) is one decoder layer over S new pairs and the
draft logits of some of its outputs; it records its own work
(:func:`refspec.energy.model.work.record_forward`) from the tensors it ran.

Shapes: B batch, S query length, T cache length, E model dim, V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from refspec.cache import StaticKVCache
from refspec.config import ModelArgs
from refspec.drafting import DrafterError
from refspec.energy.model.roofline import layer_parameters
from refspec.energy.model.work import ForwardShape, record_forward, recording
from refspec.models.layers import MLP, Linear, RMSNorm
from refspec.models.ops import apply_rope, attend, attention_bias, rope_inv_freq, rope_tables

KINDS = ("eagle", "eagle3")


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low, middle and high layers for an L-layer target, in refspec numbering.

    EAGLE-3 takes the inputs of layers ``2, L // 2, L - 3``; refspec numbers a hidden state
    by the block that produced it, so these are the outputs of blocks ``1, L//2 - 1, L - 4``.
    Targets of fewer than 8 layers (test models) use ``0, (L-1)//2, L-1``.
    """
    if num_layers < 8:
        return (0, (num_layers - 1) // 2, num_layers - 1)
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """Architecture of an EAGLE head.

    Attributes:
        kind: ``eagle`` or ``eagle3``.
        hidden_size: E (the target's).
        num_heads: attention heads.
        num_kv_heads: key/value heads.
        head_dim: D.
        intermediate_size: MLP width.
        vocab_size: V, the target's vocabulary.
        draft_vocab_size: Vd (``eagle``: always V).
        feature_layers: target layers read (``eagle``: the final-normed layer L).
        rms_norm_eps: norm epsilon.
        rope_theta: rotary base.
        rope_scaling: rotary scaling (as in ``config.json``) or None.
        hidden_act: ``silu`` or ``gelu_tanh``.
        fc_bias: whether ``fc`` has a bias (published EAGLE-1 heads do).
        norm_before_residual: EAGLE-3 only: the residual is the hidden-normed feature rather than
            the raw one (``norm_before_residual`` in some published EAGLE-3 configs).
    """

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    fc_bias: bool = False
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DrafterError(f"unknown EAGLE head kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "eagle" and self.draft_vocab_size != self.vocab_size:
            raise DrafterError("an EAGLE-1 head drafts over the target's whole vocabulary (draft_vocab_size == V)")
        if self.num_heads % self.num_kv_heads:
            raise DrafterError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        want = 1 if self.kind == "eagle" else 3
        if len(self.feature_layers) != want:
            raise DrafterError(f"an {self.kind} head reads {want} target layer(s), got {self.feature_layers}")

    @classmethod
    def for_target(cls, kind: str, args, *, draft_vocab_size: int | None = None,
                   feature_layers: tuple[int, ...] | None = None) -> "HeadConfig":
        """A head shaped like one decoder layer of the target ``args`` (``ModelArgs``)."""
        if feature_layers is None:
            feature_layers = (args.num_layers,) if kind == "eagle" else eagle3_layers(args.num_layers)
        vd = args.vocab_size if kind == "eagle" or not draft_vocab_size else min(draft_vocab_size, args.vocab_size)
        return cls(kind=kind, hidden_size=args.hidden_size, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                   head_dim=args.head_dim, intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                   draft_vocab_size=vd, feature_layers=tuple(feature_layers), rms_norm_eps=args.rms_norm_eps,
                   rope_theta=args.rope_theta, rope_scaling=args.rope_scaling, hidden_act=args.hidden_act)

    def check_target(self, args) -> None:
        """Raise a :class:`DrafterError` if this head cannot serve a target of ``args``."""
        if self.hidden_size != args.hidden_size:
            raise DrafterError(f"the {self.kind} head has hidden size {self.hidden_size} but the target has "
                               f"{args.hidden_size}: it was trained for another model")
        if self.vocab_size != args.vocab_size:
            raise DrafterError(f"the {self.kind} head has vocabulary {self.vocab_size} but the target has "
                               f"{args.vocab_size}: it was trained for another model")
        bad = [l for l in self.feature_layers if not 0 <= l <= args.num_layers]
        if bad:
            raise DrafterError(f"the head reads target layers {bad}, outside 0..{args.num_layers}")


# ---- the head -----------------------------------------------------------------------------------


class _HeadAttention(nn.Module):
    """Self-attention of the head's decoder layer; its input width may differ from E (EAGLE-3)."""

    def __init__(self, cfg: HeadConfig, in_dim: int) -> None:
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.hkv, self.d = h, hkv, d
        self.wq = Linear(in_dim, h * d, bias=False)
        self.wk = Linear(in_dim, hkv * d, bias=False)
        self.wv = Linear(in_dim, hkv * d, bias=False)
        self.wo = Linear(h * d, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [B, S, in]`` -> rotated ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` (the layout the
        cache's ``write`` and :func:`attend` take)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d)
        k = self.wk(x).view(b, s, self.hkv, self.d)
        v = self.wv(x).view(b, s, self.hkv, self.d)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, S, H, D]`` over ``keys, values [B, Hkv, Tk, D]`` with ``mask [B, 1, S, Tk]`` -> ``[B, S, E]``."""
        bias = attention_bias(mask, self.hkv, self.h // self.hkv, q.dtype)
        b, s = q.shape[:2]
        return self.wo(attend(q, keys, values, bias, 1.0 / math.sqrt(self.d)).view(b, s, -1))


class EagleHead(nn.Module):
    """Shared body of the EAGLE-1 and EAGLE-3 heads (one decoder layer with rotary attention).

    Subclasses define how target features enter (:meth:`prepare`), what the attention reads
    (:meth:`_attn_input`) and how a head output becomes draft logits (:meth:`draft_logits`).
    The target's embedding (and for EAGLE-1 its LM head) are passed in, never stored: saving
    a head saves only its own weights.
    """

    def __init__(self, cfg: HeadConfig, attn_in: int) -> None:
        super().__init__()
        self.config = cfg
        self.attn = _HeadAttention(cfg, attn_in)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plus_one=False)
        self.mlp = MLP(cfg)  # reads hidden_size, intermediate_size, hidden_act, which HeadConfig has
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    # -- pieces subclasses define -----------------------------------------------------------
    def prepare(self, feats: list[torch.Tensor]) -> torch.Tensor:
        """Target features of ``feature_layers`` (each ``[B, S, E]``) -> the head's ``[B, S, E]`` input."""
        raise NotImplementedError

    def _attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention input, residual)`` from embeddings and features, both ``[B, S, E]``."""
        raise NotImplementedError

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        """Head outputs ``[..., E]`` -> float32 draft logits ``[..., Vd]``."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity without a reduced vocabulary)."""
        return draft_ids

    def _step_matrices(self) -> list[nn.Linear]:
        """The matrices :meth:`step` multiplies every token through."""
        return [self.attn.wq, self.attn.wk, self.attn.wv, self.attn.wo, self.mlp.gate_up, self.mlp.down]

    def _prepare_matrices(self) -> list[nn.Linear]:
        """The matrices :meth:`prepare` multiplies every target feature position through."""
        return []

    # -- shared body ------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.mlp.gate_up.weight.dtype

    def _finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out
        return x + self.mlp(self.mlp_norm(x))

    @property
    def cost_args(self) -> ModelArgs:
        """The head's decoder layer as the cost model reads it (one layer, draft vocabulary)."""
        c = self.config
        return ModelArgs(family="llama", vocab_size=c.draft_vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_layers=1, num_heads=c.num_heads,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)

    def forward_shape(self, rows: int, tokens_per_row: int, num_keys: int, lm_head_tokens: int, lm_head_rows: int,
                      prepared: bool, lm_head_bytes: int | None = None) -> ForwardShape:
        """The work of one :meth:`forward_draft`: the matrices beyond a standard decoder layer's
        (EAGLE-1's ``fc``, EAGLE-3's wider q/k/v and, over prepared features, its ``fc``) are
        counted from the head's own weights; ``lm_head_bytes`` is the element size the LM head
        streams in products of 2+ rows when it differs (the target's fp32 CPU copy)."""
        n = rows * tokens_per_row
        run = self._step_matrices() + (self._prepare_matrices() if prepared else [])
        extra = sum(lin.weight.numel() for lin in run) - layer_parameters(self.cost_args)[0]
        b = torch.finfo(self.dtype).bits // 8
        copy_bytes = 0  # the head's own matrices have no copies; only a borrowed LM head may
        if lm_head_bytes is not None and lm_head_tokens > 1:
            copy_bytes = (lm_head_bytes - b) * lm_head_rows * self.config.hidden_size
        return ForwardShape(args=self.cost_args, rows=rows, tokens_per_row=tokens_per_row,
                            context_tokens=rows * num_keys, dtype_bytes=b, lm_head_tokens=lm_head_tokens,
                            lm_head_rows=lm_head_rows, layers=1, extra_weight_bytes=b * extra + copy_bytes,
                            extra_flops=2 * n * extra)

    def lm_head_bytes(self, target) -> int | None:
        """Element size the draft LM head streams in multi-row products when it differs from
        the head's dtype (None: the head's own LM head, no copy)."""
        return None

    def forward_draft(self, emb: torch.Tensor, h: torch.Tensor | list[torch.Tensor], positions: torch.Tensor,
                      cache: StaticKVCache, slots: torch.Tensor, mask: torch.Tensor, num_keys: int, target, *,
                      logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward: :meth:`step`, then :meth:`draft_logits`; records its work.

        Args:
            emb, positions, cache, slots, mask, num_keys: as for :meth:`step`.
            h: ``[B, S, E]`` features, or the target's raw features of ``feature_layers`` (each
                ``[B, S, E]``), prepared here.
            target: the target (its LM head, for EAGLE-1).
            logits_at: ``[B, M]`` output indices that get draft logits (default all S).

        Returns:
            ``(out [B, S, E], logits [B, M, Vd] fp32)``.
        """
        prepared = isinstance(h, (list, tuple))
        if prepared:
            h = self.prepare([x.to(self.dtype) for x in h])
        out = self.step(emb, h, positions, cache, slots, mask, num_keys)
        b, s, e = out.shape
        picked = out if logits_at is None else out.gather(1, logits_at[..., None].expand(b, logits_at.shape[1], e))
        logits = self.draft_logits(picked, target)  # [B, M, Vd]
        if recording():
            record_forward(self.forward_shape(b, s, num_keys, logits.shape[0] * logits.shape[1], logits.shape[-1],
                                              prepared, self.lm_head_bytes(target)))
        return out, logits

    def step(self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
             slots: torch.Tensor, mask: torch.Tensor, num_keys: int) -> torch.Tensor:
        """One cached forward over S new pairs.

        Args:
            emb: ``[B, S, E]`` embeddings of the tokens ``x_{j+1}``.
            h: ``[B, S, E]`` features ``f_j`` (prepared target features or the head's own outputs).
            positions: ``[B, S]`` rotary positions.
            cache: the head's one-layer static cache; entries are written at ``slots``.
            slots: ``[B, S]`` cache slots.
            mask: ``[B, 1, S, num_keys]`` bool visibility.
            num_keys: attended prefix of the cache.

        Returns:
            ``[B, S, E]`` the head's outputs (predicted next features).
        """
        x, residual = self._attn_input(emb, h)
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype)
        q, k, v = self.attn.project(x, cos, sin)
        cache.write(0, slots, k, v)
        out = self.attn.attend(q, *cache.read(0, num_keys), mask)
        return self._finish(residual, out)

    def unroll(self, emb_fn, tokens: torch.Tensor, h0: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training forward with training-time test: ``steps`` chained predictions per position.

        Step 0 at index i reads ``(x_{i+1}, h0_i)``; step j reads ``(x_{i+j+1}, out^{j-1}_i)``,
        sits at rotary position ``i + j`` and attends to step 0's keys at indices ``<= i`` and
        to step s's key at index i for ``s = 1..j`` -- exactly what drafting j tokens after
        position i sees. Tokens past the window's end are 0 (their outputs are masked by the
        loss).

        Args:
            emb_fn: token ids ``[B, S]`` -> embeddings ``[B, S, E]`` (the target's).
            tokens: ``[B, S]`` window tokens.
            h0: ``[B, S, E]`` prepared target features.
            steps: unrolled steps (1 = plain teacher forcing).

        Returns:
            ``steps`` tensors ``[B, S, E]``: ``out^j_i`` predicts the feature of position ``i + j + 1``.
        """
        b, s = tokens.shape
        dev = tokens.device
        idx = torch.arange(s, device=dev)
        causal = idx[None, :] <= idx[:, None]  # [S, S]
        eye = torch.eye(s, dtype=torch.bool, device=dev)
        keys, values, outs = [], [], []
        h = h0
        for j in range(steps):
            shifted = torch.cat([tokens[:, j + 1:], tokens.new_zeros(b, j + 1)], dim=1)  # x_{i+j+1}
            x, residual = self._attn_input(emb_fn(shifted).to(h.dtype), h)
            cos, sin = rope_tables((idx + j)[None].expand(b, s), self.inv_freq, x.dtype)
            q, k, v = self.attn.project(x, cos, sin)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [eye] * j, dim=1)[None, None].expand(b, 1, s, s * (j + 1))
            kv = [torch.cat(t, 1).transpose(1, 2) for t in (keys, values)]  # [B, Hkv, S*(j+1), D]
            out = self._finish(residual, self.attn.attend(q, *kv, mask))
            outs.append(out)
            h = out
        return outs
