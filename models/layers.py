"""Decoder modules: :class:`Linear`, :class:`Attention`, :class:`MLP`, :class:`RMSNorm` and
:class:`Block`, the residual form that calls them. The tensor functions they use live in
:mod:`refspec.models.ops`; where a step's keys and values go lives in
:mod:`refspec.models.attention`.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from refspec.config import ModelArgs
from refspec.models.gemm_forms import GemmChoice, linear
from refspec.models.moe import MoE
from refspec.models.ops import apply_rope, gated_act, rms_norm


class AttentionContext(Protocol):
    """Where a forward's keys and values go and which keys each query sees
    (:class:`~refspec.models.attention.CacheAttention`, :class:`~refspec.models.attention.PackedAttention`)."""

    rope: tuple  # ((cos, sin) of full-attention layers, (cos, sin) of sliding layers or None)

    def __call__(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Write ``k, v [B, S, Hkv, D]``, attend with ``q [B, S, H, D]``; returns ``[B, S, H*D]``."""


class Linear(nn.Linear):
    """``nn.Linear`` whose product takes the CPU GEMM form chosen for it.

    ``gemm`` is the choice (forms per row count, the weight copy they read), set on a built model
    by :func:`refspec.models.cpu_speed.plan_gemms`; without one the product is ``F.linear``.
    """

    gemm: GemmChoice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        return linear(x, self.weight, self.bias, self.gemm)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with its weight."""

    def __init__(self, dim: int, eps: float, plus_one: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.plus_one)


class _SplitNames:
    """Mixin for a module holding fused projections (one GEMM for several linears that read
    the same input) whose state dict keeps the split Hugging Face-style names, so checkpoints,
    saved heads and ``load_state_dict`` see ``wq``/``wk``/``wv`` (``gate``/``up``) while the
    forward runs one ``wqkv`` (``gate_up``) matrix."""

    def _splits(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """fused Linear name -> ((part name, output rows), ...) in order."""
        raise NotImplementedError

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for fused, parts in self._splits().items():
            for kind in ("weight", "bias"):
                keys = [f"{prefix}{name}.{kind}" for name, _ in parts]
                if all(k in state_dict for k in keys):
                    state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for fused, parts in self._splits().items():
            for kind in ("weight", "bias"):
                key = f"{prefix}{fused}.{kind}"
                if key in out:
                    pieces = out.pop(key).split([rows for _, rows in parts])
                    for (name, _), piece in zip(parts, pieces):
                        out[f"{prefix}{name}.{kind}"] = piece
        return out


class Attention(_SplitNames, nn.Module):
    """Grouped-query attention: one fused q/k/v projection (saved as ``wq``/``wk``/``wv``), the
    output projection and gemma3/qwen3's q/k norms; rotary positions, and a sliding window on
    the layers that have one."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        e, d = args.hidden_size, args.head_dim
        self.layer = layer
        self.sliding = args.is_sliding(layer)
        self.h, self.hkv, self.d = args.num_heads, args.num_kv_heads, d
        self.wqkv = Linear(e, (self.h + 2 * self.hkv) * d, bias=args.attention_bias)
        self.wo = Linear(self.h * d, e, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.scale = args.attn_scale

    def _splits(self):
        d = self.d
        return {"wqkv": (("wq", self.h * d), ("wk", self.hkv * d), ("wv", self.hkv * d))}

    def forward(self, x: torch.Tensor, ctx: AttentionContext, b: int, s: int) -> torch.Tensor:
        """``x [B*S, E]`` (normed rows of ``b`` sequences of ``s`` positions) -> ``[B*S, E]``; ``ctx``
        writes K/V and attends."""
        h, hkv = self.h, self.hkv
        qkv = self.wqkv(x).view(b, s, h + 2 * hkv, self.d)  # [B, S, H + 2 Hkv, D]
        cos, sin = ctx.rope[self.sliding]  # [B, S, 1, D] each
        if self.q_norm is None:  # q and k rotated in one op (each head alike)
            qk, v = qkv.split_with_sizes((h + hkv, hkv), dim=2)  # [B, S, H + Hkv | Hkv, D]
            q, k = apply_rope(qk, cos, sin).split_with_sizes((h, hkv), dim=2)
        else:
            q, k, v = qkv.split_with_sizes((h, hkv, hkv), dim=2)  # [B, S, H | Hkv | Hkv, D]
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        return self.wo(ctx(self.layer, self.sliding, q, k, v, self.scale).view(b * s, -1))  # [B*S, H*D] -> [B*S, E]

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before q/k-norm and rope) and values of ``x [B, S, E]``, each ``[B, S, Hkv, D]``."""
        b, s, _ = x.shape
        rows = self.h * self.d
        w, bias = self.wqkv.weight[rows:], (self.wqkv.bias[rows:] if self.wqkv.bias is not None else None)
        k, v = F.linear(x, w, bias).view(b, s, 2 * self.hkv, self.d).split(self.hkv, dim=2)
        return k, v


class MLP(_SplitNames, nn.Module):
    """Gated MLP with one fused gate/up projection (saved as ``gate``/``up``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate = args.intermediate_size
        self.gate_up = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down = Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gelu = args.hidden_act == "gelu_tanh"

    def _splits(self):
        return {"gate_up": (("gate", self.intermediate), ("up", self.intermediate))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., E]`` -> ``[..., E]``: ``down(act(gate x) * up x)`` (act: SiLU, or
        tanh-approximated GELU for gemma3)."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(gated_act(gate, up, self.gelu))


class Block(nn.Module):
    """One decoder block: attention and gated MLP (or a routed :class:`~refspec.models.moe.MoE`),
    each behind an RMSNorm with a residual add (gemma3 also norms each branch's output)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        eps, p1 = args.rms_norm_eps, args.norm_plus_one
        self.attn = Attention(args, layer)
        self.mlp = MoE(args) if args.is_moe_layer(layer) else MLP(args)
        self.attn_norm = RMSNorm(args.hidden_size, eps, p1)
        self.mlp_norm = RMSNorm(args.hidden_size, eps, p1)
        self.sandwich = args.sandwich_norms
        if self.sandwich:
            self.attn_post_norm = RMSNorm(args.hidden_size, eps, p1)
            self.mlp_post_norm = RMSNorm(args.hidden_size, eps, p1)
        self.sliding = args.is_sliding(layer)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``x [B, S, E]`` -> ``[B, S, E]``; ``ctx`` places this step's K/V and masks the keys
        (:mod:`refspec.models.attention`)."""
        shape, (b, s) = x.shape, x.shape[:2]
        x = x.reshape(b * s, shape[-1])  # [B*S, E]: norms and products on 2-D rows (no reshape per product)
        h = self.attn(self.attn_norm(x), ctx, b, s)
        x = x + (self.attn_post_norm(h) if self.sandwich else h)
        h = self.mlp(self.mlp_norm(x))
        x = x + (self.mlp_post_norm(h) if self.sandwich else h)
        return x.view(shape)
