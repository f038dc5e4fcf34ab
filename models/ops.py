"""Tensor functions of the decoder, shared by the target models and the drafter heads: the
CPU GEMM paths and their weight copies, RMSNorm, rotary embedding, grouped-query attention
and the gated MLP. Modules holding parameters live in :mod:`refspec.models.layers`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from refspec.models.calibration import COPY_FORMS, REFERENCE, GemmPlan, make_copy, packed_product, without_onednn


class WeightCopy:
    """A copy of a weight in the layout or dtype a CPU GEMM form needs (see
    :mod:`refspec.models.calibration`, which chooses the forms by timing them on the machine).

    Three kinds: ``column``, a column-major ``[in, out]`` copy in the weight's dtype; ``fp32``,
    an fp32 ``[out, in]`` copy of a bf16/fp16 weight whose product is rounded back to the
    model's dtype (as a half-precision kernel rounds its fp32 accumulator: only the summation
    order differs); ``packed``, the weight reordered once into oneDNN's blocked layout.

    The copy is used only while the weight is the very tensor it was made from, unmodified
    (same storage, same version counter), and no gradient to it is being recorded; otherwise
    :func:`linear` falls back to the weight.
    """

    __slots__ = ("ptr", "version", "t", "kind")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:  # noqa: D107
        if weight.is_inference():
            raise ValueError("an inference-mode tensor has no version counter to guard a copy with")
        if kind not in COPY_FORMS:
            raise ValueError(f"kind must be one of {COPY_FORMS}, got {kind!r}")
        self.ptr, self.version, self.kind = weight.data_ptr(), weight._version, kind
        self.t = make_copy(kind, weight)

    def of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy if ``weight`` is unchanged since it was made, else None (also while
        gradients to ``weight`` are being recorded: the copy is detached). While compiling, the
        copy: a :class:`~refspec.models.compiled.CompiledStep` checks every copy before each call,
        and pointers and version counters cannot be traced."""
        if torch.compiler.is_compiling():
            return self.t
        if weight.data_ptr() != self.ptr or weight.is_inference():
            return None
        if weight.requires_grad and torch.is_grad_enabled():
            return None
        return self.t if weight._version == self.version else None


_plan: GemmPlan = REFERENCE


def use_gemm_plan(plan: GemmPlan) -> None:
    """Make ``plan`` the forms every CPU :func:`linear` takes (one machine, one plan)."""
    global _plan
    _plan = plan


def gemm_plan() -> GemmPlan:
    """The plan :func:`linear` follows now."""
    return _plan


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           copy: WeightCopy | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in the GEMM form the active plan chose for this dtype and row
    count on CPUs (``F.linear`` elsewhere, and where a form's copy is missing or stale).

    The result may be a column-major view; later ops accept it as is. The decoder passes 2-D
    ``[rows, in]`` activations.
    """
    if x.dim() != 2:
        lead = x.shape[:-1]
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, copy).view(*lead, weight.shape[0])
    form = _plan.form(x.dtype, x.shape[0]) if x.is_cpu else "linear"
    if form == "wxt":
        # (W @ x^T)^T with a row-major x: a column-major x sends some BLAS down a slow path
        xt = x.contiguous().t()
        return (torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)).t()
    if form == "nodnn":
        # ATen's own half-precision kernels: on some CPUs oneDNN's one-row products run at half their speed
        return F.linear(x, weight, bias) if torch.compiler.is_compiling() else without_onednn(F.linear, x, weight, bias)
    if form == "packed" and (torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled())):
        # oneDNN's packed product has no backward, and a graph cannot take its opaque layout
        return F.linear(x, weight, bias)
    c = copy.of(weight) if form != "linear" and copy is not None and copy.kind == form else None
    if c is None:
        return F.linear(x, weight, bias)
    if form == "packed":
        return packed_product(x, c, bias)
    if form == "column":
        return torch.mm(x, c) if bias is None else torch.addmm(bias, x, c)
    xt = x.to(torch.float32, memory_format=torch.contiguous_format).t()  # fp32 copy: one fp32 GEMM, rounded back
    out = torch.mm(c, xt) if bias is None else torch.addmm(bias.float()[:, None], c, xt)
    return out.t().to(x.dtype)


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
