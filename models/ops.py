"""Tensor functions of the decoder, shared by the target models and the drafter heads: RMSNorm,
rotary embedding, grouped-query attention and the gated MLP's activation. Modules holding
parameters live in :mod:`refspec.models.layers`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """RMSNorm over the last axis, computed in fp32; gemma3 scales by ``1 + w`` instead of ``w``."""
    if x.dtype is torch.float32 and weight.dtype is torch.float32 and not plus_one:
        return torch.rms_norm(x, weight.shape, weight, eps)  # one ATen call, same arithmetic as below
    # x * rsqrt(mean(x^2) + eps) in fp32 (one call, bit-identical to the spelled-out ops), then
    # the weight as Hugging Face applies it: after the cast, in the input dtype
    normed = torch.rms_norm(x.float(), weight.shape, None, eps)
    if plus_one:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` with optional linear or llama3 rope scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled).float()
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables ``(cos, sin)``, each ``[B, S, 1, D]`` (broadcast over the heads of
    ``[B, S, H, D]`` queries and keys), for ``positions [B, S]``.

    ``sin`` carries the rotate-half sign: its first half is negated, so :func:`apply_rope`
    needs no negation or concatenation per layer."""
    freqs = positions[..., None, None].float() * inv_freq.to(positions.device)  # [B, S, 1, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[..., : sin.shape[-1] // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, H, D]`` by the ``[B, S, 1, D]`` tables of :func:`rope_tables`.

    Rotate-half convention: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
    (-x2, x1)``; rolling ``x`` by D/2 gives ``(x2, x1)`` and the sign lives in ``sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def attention_bias(mask: torch.Tensor, num_kv_heads: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias laid out for :func:`attend`, built once per forward.

    Args:
        mask: ``[B, 1, S, Tk]`` bool, True where visible.
        num_kv_heads: Hkv.
        groups: query heads per K/V head (G = H / Hkv).
        dtype: score dtype (fp32 on CPUs, where :func:`attend` computes in fp32).

    Returns:
        ``[B*Hkv, G*S, Tk]``: 0 where visible, -inf elsewhere.
    """
    if mask.device.type == "cpu":
        dtype = torch.float32
    b, _, s, tk = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[:, None].expand(b, num_kv_heads, groups, s, tk).reshape(b * num_kv_heads, groups * s, tk)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Grouped-query attention in two batched GEMMs, softmax in fp32; K/V are never copied.

    Args:
        q: ``[B, S, H, D]`` queries.
        keys: ``[B, Hkv, Tk, D]`` (a prefix view of the cache).
        values: ``[B, Hkv, Tk, D]``.
        bias: ``[B*Hkv, G*S, Tk]`` from :func:`attention_bias`.
        scale: score scale.

    Returns:
        ``[B*S, H*D]``, rows in (B, S) order.
    """
    b, s, h, d = q.shape
    hkv, tk = keys.shape[1], keys.shape[2]
    g = h // hkv
    out_dtype = q.dtype
    if q.is_cpu and q.dtype is not torch.float32:
        # CPUs without bf16/fp16 matrix units emulate these GEMMs several times slower than
        # fp32; the attended K/V are small next to the weights, so compute in fp32 there
        q, keys, values = q.float(), keys.float(), values.float()  # the bias is fp32 on CPUs
    # query head i uses K/V head i // G; fold a group's heads into the query axis (with one
    # query per row, [B, 1, H, D] already lies as [B*Hkv, G, D])
    if s == 1:
        qg = q.reshape(b * hkv, g, d)
    else:
        qg = q.reshape(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * s, d)
    scores = torch.baddbmm(bias, qg, keys.reshape(b * hkv, tk, d).transpose(1, 2), alpha=scale)
    if scores.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1)  # [B*Hkv, G*S, Tk]
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.bmm(probs, values.reshape(b * hkv, tk, d))  # [B*Hkv, G*S, D]
    if s == 1:
        out = out.view(b, h * d)
    else:
        out = out.view(b, hkv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b * s, h * d)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def gated_act(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` of a gated MLP (act: SiLU, or tanh-approximated GELU for gemma3)."""
    g = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return g.mul_(up)
