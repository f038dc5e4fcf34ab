"""Tensor functions of the decoder, shared by the target models and the drafter heads: the
CPU GEMM paths and their weight copies, RMSNorm, rotary embedding, grouped-query attention
and the gated MLP. Modules holding parameters live in :mod:`refspec.models.layers`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class WeightCopy:
    """A copy of a weight in the layout or dtype a CPU kernel streams fastest, for decoding.

    Two kinds, both measured on the project's CPU (torch 2.13, 2 threads, SmolLM2-135M's
    matrices, see the README's CPU notes):

    - ``column`` (fp32 models): a column-major ``[in, out]`` copy. A one-row product streams it
      about 1.25x faster than a row-major matrix; for 2 or more rows ``(W @ x^T)^T`` on the
      weight itself is best.
    - ``fp32`` (bf16/fp16 models): an fp32 ``[out, in]`` copy. CPUs without bf16/fp16 matrix
      units emulate half-precision products: one row streams the half-precision weight near
      bandwidth, but 2-8 rows take 2.3-4x as long as one, while an fp32 product of 2-8 rows
      costs about what one fp32 row does (5 rows: 78 ms bf16 against 40 ms fp32 over the
      model's matrices). Verification and batched steps multiply through this copy; the
      result is rounded to the model's dtype, as the half-precision kernel rounds its fp32
      accumulator, so only the summation order differs.

    The copy is used only while the weight is the very tensor it was made from, unmodified
    (same storage, same version counter), and no gradient to it is being recorded; otherwise
    :func:`linear` falls back to the weight.
    """

    __slots__ = ("ptr", "version", "t", "kind")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:  # noqa: D107
        if weight.is_inference():
            raise ValueError("an inference-mode tensor has no version counter to guard a copy with")
        if kind not in ("column", "fp32"):
            raise ValueError(f"kind must be 'column' or 'fp32', got {kind!r}")
        self.ptr, self.version, self.kind = weight.data_ptr(), weight._version, kind
        w = weight.detach()
        self.t = w.t().contiguous() if kind == "column" else w.float().contiguous()

    def of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy if ``weight`` is unchanged since it was made, else None (also while
        gradients to ``weight`` are being recorded: the copy is detached)."""
        if weight.data_ptr() != self.ptr or weight.is_inference():
            return None
        if weight.requires_grad and torch.is_grad_enabled():
            return None
        return self.t if weight._version == self.version else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           copy: WeightCopy | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, with the GEMM layout and dtype chosen for CPUs.

    Measured on the project's CPU (torch 2.13, 2 threads, SmolLM2-135M's matrices streamed
    from memory): in fp32, for 2 to 320 rows ``(W @ x^T)^T`` runs 1.2-2.4x faster than
    ``F.linear``, and for one row a column-major copy is about 1.25x faster than either; in
    bf16/fp16, one row runs ``F.linear`` on the weight and 2 or more rows the fp32 copy (see
    :class:`WeightCopy`). Other devices use ``F.linear``. The result may be a column-major
    view; later ops accept it as is. The decoder passes 2-D ``[rows, in]`` activations.
    """
    if x.dim() != 2:
        lead = x.shape[:-1]
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, copy).view(*lead, weight.shape[0])
    if not x.is_cpu:
        return F.linear(x, weight, bias)
    if x.dtype is not torch.float32:
        if copy is None or x.shape[0] == 1 or copy.kind != "fp32" or (w32 := copy.of(weight)) is None:
            return F.linear(x, weight, bias)
        # row-major fp32 rows (see below), one fp32 GEMM, rounded back to the model's dtype
        xt = x.to(torch.float32, memory_format=torch.contiguous_format).t()
        out = torch.mm(w32, xt) if bias is None else torch.addmm(bias.float()[:, None], w32, xt)
        return out.t().to(x.dtype)
    if copy is not None and x.shape[0] == 1 and copy.kind == "column" and (wt := copy.of(weight)) is not None:
        return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
    # x must be row-major: with a column-major x (as this function returns) MKL takes a
    # 1.7-2.9x slower path for 2-8 rows; copying the few rows is cheap
    xt = x.contiguous().t()
    return (torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)).t()


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


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, gate_up_copy: WeightCopy | None, down: torch.Tensor,
              down_copy: WeightCopy | None, gelu: bool) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with the fused ``[2 I, E]`` gate/up matrix (act: SiLU, or
    tanh-approximated GELU for gemma3)."""
    g, u = linear(x, gate_up, None, gate_up_copy).chunk(2, dim=-1)
    g = F.gelu(g, approximate="tanh") if gelu else F.silu(g)
    return linear(g.mul_(u), down, None, down_copy)
