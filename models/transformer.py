"""One pure-PyTorch decoder for the llama, qwen2, qwen3 and gemma3 families.

Every forward writes K/V into a :class:`refspec.cache.StaticKVCache` at per-row slots and
attends through a boolean mask built from positions (or an explicit tree mask), so step
shapes never change. Module names are refspec's own; ``refspec.models.loading`` maps
Hugging Face checkpoint names onto them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from refspec.cache import StaticKVCache, causal_mask
from refspec.config import ModelArgs


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


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` that multiplies through :func:`linear`."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        self._copy: WeightCopy | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._copy)


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


class RMSNorm(nn.Module):
    """:func:`rms_norm` with its weight."""

    def __init__(self, dim: int, eps: float, plus_one: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.plus_one)


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
    """Rotary tables ``(cos, sin)``, each ``[B, S, D]``, for ``positions [B, S]``.

    ``sin`` carries the rotate-half sign: its first half is negated, so :func:`apply_rope`
    needs no negation or concatenation per layer."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[..., : sin.shape[-1] // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., D]`` by tables from :func:`rope_tables` made broadcastable to it (the
    model passes ``x [B, S, H, D]`` with ``[B, S, 1, D]``, heads ``[B, H, S, D]`` with
    ``[B, 1, S, D]``).

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
    """Parameters of grouped-query attention: one fused q/k/v projection (saved as
    ``wq``/``wk``/``wv``), the output projection and gemma3/qwen3's q/k norms. The block's
    forward (:meth:`Block.forward`) runs them."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        e, d = args.hidden_size, args.head_dim
        self.layer = layer
        self.h, self.hkv, self.d = args.num_heads, args.num_kv_heads, d
        self.wqkv = Linear(e, (self.h + 2 * self.hkv) * d, bias=args.attention_bias)
        self.wo = Linear(self.h * d, e, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.scale = args.attn_scale

    def _splits(self):
        d = self.d
        return {"wqkv": (("wq", self.h * d), ("wk", self.hkv * d), ("wv", self.hkv * d))}

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before q/k-norm and rope) and values of ``x [B, S, E]``, each ``[B, S, Hkv, D]``."""
        b, s, _ = x.shape
        rows = self.h * self.d
        w, bias = self.wqkv.weight[rows:], (self.wqkv.bias[rows:] if self.wqkv.bias is not None else None)
        k, v = linear(x, w, bias).view(b, s, 2 * self.hkv, self.d).split(self.hkv, dim=2)
        return k, v


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, gate_up_copy: WeightCopy | None, down: torch.Tensor,
              down_copy: WeightCopy | None, gelu: bool) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with the fused ``[2 I, E]`` gate/up matrix (act: SiLU, or
    tanh-approximated GELU for gemma3)."""
    g, u = linear(x, gate_up, None, gate_up_copy).chunk(2, dim=-1)
    g = F.gelu(g, approximate="tanh") if gelu else F.silu(g)
    return linear(g.mul_(u), down, None, down_copy)


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
        gate_up, down = self.gate_up, self.down
        return gated_mlp(x, gate_up.weight, gate_up._copy, down.weight, down._copy, self.gelu)


class _StepPlan(NamedTuple):
    """What a block's forward reads, gathered from its modules once (:meth:`Block._plan`)."""

    guards: tuple  # ((dict, key, object), ...): every lookup the plan was built from
    layer: int
    h: int
    hkv: int
    d: int
    scale: float
    gelu: bool
    attn_norm: tuple  # (weight, eps, plus_one), the arguments of rms_norm after x
    mlp_norm: tuple
    attn_post_norm: tuple | None  # gemma3's sandwich norms
    mlp_post_norm: tuple | None
    q_norm: tuple | None  # qwen3/gemma3
    k_norm: tuple | None
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None  # qwen2
    qkv_copy: WeightCopy | None
    wo: torch.Tensor
    wo_copy: WeightCopy | None
    gate_up: torch.Tensor
    gate_up_copy: WeightCopy | None
    down: torch.Tensor
    down_copy: WeightCopy | None


class Block(nn.Module):
    """One decoder block: attention and gated MLP, each behind an RMSNorm with a residual add
    (gemma3 also norms each branch's output)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        eps, p1 = args.rms_norm_eps, args.norm_plus_one
        self.attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.attn_norm = RMSNorm(args.hidden_size, eps, p1)
        self.mlp_norm = RMSNorm(args.hidden_size, eps, p1)
        self.sandwich = args.sandwich_norms
        if self.sandwich:
            self.attn_post_norm = RMSNorm(args.hidden_size, eps, p1)
            self.mlp_post_norm = RMSNorm(args.hidden_size, eps, p1)
        self.sliding = args.is_sliding(layer)

    def _plan(self) -> _StepPlan:
        """The tensors the forward reads, reused while every sub-module, parameter and weight
        copy they came from is still the same object (a replaced parameter or module, a
        ``load_state_dict(assign=True)``, new weight copies: the plan is rebuilt). In-place
        changes and ``.data`` swaps need no rebuild: the plan holds the parameters themselves.
        Plain attributes (``eps``, ``scale``, head counts) are read when the plan is built."""
        plan = self.__dict__.get("_step_plan")
        if plan is not None and all(d.get(k) is o for d, k, o in plan.guards):
            return plan
        guards: list = []

        def sub(mod: nn.Module, name: str):
            m = mod._modules.get(name)
            guards.append((mod._modules, name, m))
            return m

        def param(mod: nn.Module, name: str):
            t = mod._parameters.get(name)
            guards.append((mod._parameters, name, t))
            return t

        def norm(mod: nn.Module | None):
            return None if mod is None else (param(mod, "weight"), mod.eps, mod.plus_one)

        def lin(mod: nn.Linear):
            copy = mod.__dict__.get("_copy")
            guards.append((mod.__dict__, "_copy", copy))
            return param(mod, "weight"), param(mod, "bias"), copy

        attn, mlp = sub(self, "attn"), sub(self, "mlp")
        wqkv, bqkv, qkv_copy = lin(sub(attn, "wqkv"))
        wo, _, wo_copy = lin(sub(attn, "wo"))
        gate_up, _, gate_up_copy = lin(sub(mlp, "gate_up"))
        down, _, down_copy = lin(sub(mlp, "down"))
        norms = {name: norm(sub(owner, name)) for owner, name in
                 ((self, "attn_norm"), (self, "mlp_norm"), (attn, "q_norm"), (attn, "k_norm"))}
        post = [norm(sub(self, name)) if self.sandwich else None for name in ("attn_post_norm", "mlp_post_norm")]
        plan = _StepPlan(
            guards=tuple(guards), layer=attn.layer, h=attn.h, hkv=attn.hkv, d=attn.d, scale=attn.scale,
            gelu=mlp.gelu, **norms, attn_post_norm=post[0], mlp_post_norm=post[1],
            wqkv=wqkv, bqkv=bqkv, qkv_copy=qkv_copy, wo=wo, wo_copy=wo_copy,
            gate_up=gate_up, gate_up_copy=gate_up_copy, down=down, down_copy=down_copy)
        self.__dict__["_step_plan"] = plan
        return plan

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: StaticKVCache,
                slots: torch.Tensor, bias: torch.Tensor, num_keys: int) -> torch.Tensor:
        """One decoder block: write this step's K/V, attend over the cache prefix, then the MLP.

        The step is spelled out here over the tensors of :meth:`_plan` rather than as calls of
        the sub-modules: on the project's CPU every module call, attribute lookup, indexing
        or ``Tensor.split`` costs microseconds, some 1,500 times per SmolLM2 decode step
        (against calling the sub-modules, the plan saved ~1.5 ms of ~12 ms of pure overhead per
        step on a 30-layer SmolLM2-shaped toy). Forward hooks on the sub-modules therefore do
        not fire; hooks on the block do.

        Args:
            x: ``[B, S, E]`` input.
            rope: ``(cos, sin)`` from :func:`rope_tables`, each ``[B, S, 1, D]``.
            cache: static cache (or anything with its ``write``/``read``).
            slots: ``[B, S]`` where this step's K/V go.
            bias: ``[B*Hkv, G*S, Tk]`` from :func:`attention_bias`.
            num_keys: Tk.

        Returns:
            ``[B, S, E]``.
        """
        p = self._plan()
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [B*S, E] rows: every projection is one 2-D GEMM
        b, s = slots.shape
        h, hkv = p.h, p.hkv
        qkv = linear(rms_norm(x, *p.attn_norm), p.wqkv, p.bqkv, p.qkv_copy).view(b, s, h + 2 * hkv, p.d)
        cos, sin = rope
        if p.q_norm is None:
            qk, v = qkv.split_with_sizes((h + hkv, hkv), dim=2)
            q, k = apply_rope(qk, cos, sin).split_with_sizes((h, hkv), dim=2)  # q and k rotated together
        else:
            q, k, v = qkv.split_with_sizes((h, hkv, hkv), dim=2)
            q, k = apply_rope(rms_norm(q, *p.q_norm), cos, sin), apply_rope(rms_norm(k, *p.k_norm), cos, sin)
        cache.write(p.layer, slots, k, v)
        keys, values = cache.read(p.layer, num_keys)  # [B, Hkv, Tk, D] each
        a = linear(attend(q, keys, values, bias, p.scale), p.wo, None, p.wo_copy)
        x = x + (a if p.attn_post_norm is None else rms_norm(a, *p.attn_post_norm))
        m = gated_mlp(rms_norm(x, *p.mlp_norm), p.gate_up, p.gate_up_copy, p.down, p.down_copy, p.gelu)
        x = x + (m if p.mlp_post_norm is None else rms_norm(m, *p.mlp_post_norm))
        return x.view(shape)


class Transformer(nn.Module):
    """Decoder-only transformer built from :class:`ModelArgs`.

    Args:
        args: architecture.
        num_layers: build only the first ``num_layers`` blocks (a cheap self-draft); the
            final norm and LM head are kept.
    """

    def __init__(self, args: ModelArgs, num_layers: int | None = None) -> None:
        super().__init__()
        self.args = args
        n = args.num_layers if num_layers is None else num_layers
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(n))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_plus_one)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_buffers()

    # ---- set-up -------------------------------------------------------------------------------
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute rotary frequencies; call after loading weights onto a device."""
        a = self.args
        dev = device if device is not None else (self.embed.weight.device if self.embed.weight.device.type != "meta" else "cpu")
        global_scaling = a.rope_scaling
        self.inv_freq_global = rope_inv_freq(a.head_dim, a.rope_theta, global_scaling).to(dev)
        self.inv_freq_local = rope_inv_freq(a.head_dim, a.rope_local_theta, None).to(dev)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A static cache sized for this model."""
        a = self.args
        return StaticKVCache(num_layers=self.num_layers, batch=batch, num_kv_heads=a.num_kv_heads, max_len=max_len,
                             head_dim=a.head_dim, dtype=self.dtype, device=self.device)

    def truncated(self, num_layers: int) -> "Transformer":
        """A model that shares this one's weights but runs only its first blocks."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.num_layers}, got {num_layers}")
        small = Transformer.__new__(Transformer)
        nn.Module.__init__(small)
        small.args = self.args
        small.embed, small.norm, small.lm_head = self.embed, self.norm, self.lm_head
        small.layers = nn.ModuleList(list(self.layers)[:num_layers])
        small.inv_freq_global, small.inv_freq_local = self.inv_freq_global, self.inv_freq_local
        return small

    def _copied_linears(self) -> list[nn.Linear]:
        return [self.lm_head] + [lin for blk in self.layers
                                 for lin in (blk.attn.wqkv, blk.attn.wo, blk.mlp.gate_up, blk.mlp.down)]

    def weight_copy_bytes(self) -> int:
        """Memory :meth:`add_weight_copies` would take (both kinds are fp32: 4 bytes an element)."""
        return 4 * sum(lin.weight.numel() for lin in self._copied_linears())

    def add_weight_copies(self, max_bytes: int) -> str | None:
        """Keep a :class:`WeightCopy` of every block matrix and of the LM head for decoding on
        CPUs: column-major copies for one-row products of an fp32 model, fp32 copies for
        multi-row products of a bf16/fp16 model. Skipped when the copies would take more than
        ``max_bytes``; returns the kind made, or None."""
        kind = "column" if self.dtype == torch.float32 else "fp32"
        lins = self._copied_linears()
        if self.weight_copy_bytes() > max_bytes or any(lin.weight.is_inference() for lin in lins):
            return None  # too big, or weights made under inference_mode (no version counter)
        for lin in lins:
            lin._copy = WeightCopy(lin.weight, kind)
        return kind

    def multirow_matrix_bytes(self) -> int | None:
        """Bytes per element its matrices stream in products of 2 or more rows when that
        differs from the parameter size: 4 where a half-precision model multiplies them through
        its fp32 copies (on a CPU, see :func:`linear`), else None. Read from the LM head's copy;
        for :attr:`refspec.phases.ForwardShape.matrix_bytes`."""
        head = self.lm_head
        copy = head.__dict__.get("_copy")
        if copy is not None and copy.kind == "fp32" and copy.of(head.weight) is not None:
            return 4
        return None

    def attention_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:func:`attention_bias` for this model's head layout."""
        a = self.args
        return attention_bias(mask, a.num_kv_heads, a.num_heads // a.num_kv_heads, dtype)

    # ---- forward ------------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[B, S, E]`` (scaled by sqrt(E) for gemma3)."""
        x = self.embed(tokens)
        if self.args.embed_scale:
            x = x * torch.tensor(self.args.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head on final-normed hidden states; returns fp32 logits."""
        out = self.lm_head(h).float()
        cap = self.args.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, *,
                slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                sliding_mask: torch.Tensor | None = None, num_keys: int | None = None,
                logits_at: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                inputs_embeds: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run the decoder over new tokens, writing their K/V into ``cache``.

        Args:
            tokens: ``[B, S]`` token ids.
            positions: ``[B, S]`` rotary positions.
            cache: static cache; entries are written at ``slots``.
            slots: ``[B, S]`` cache slots (default: ``positions``).
            mask: ``[B, 1, S, Tk]`` bool visibility for full-attention layers (default:
                causal on slots, from ``positions``).
            sliding_mask: same for sliding-window layers (default: causal + window).
            num_keys: Tk, the prefix of cache slots attended (default T). Must cover every
                slot any query may see.
            logits_at: ``[B, M]`` query indices whose logits are wanted (default all S);
                an empty ``[B, 0]`` tensor skips the LM head.
            hidden_layers: layer outputs to return: ``i < L`` is the residual stream after
                block ``i``; ``i == L`` the final-normed state.
            inputs_embeds: ``[B, S, E]`` to use instead of embedding ``tokens``.

        Returns:
            ``(logits [B, M, V] fp32 or None, [hidden [B, S, E] per requested layer])``.
        """
        b, s = positions.shape
        tk = cache.max_len if num_keys is None else num_keys
        slots = positions if slots is None else slots
        if mask is None:
            mask = causal_mask(positions, tk)
        x = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds
        dtype = x.dtype
        rope_g = tuple(t[:, :, None] for t in rope_tables(positions, self.inv_freq_global, dtype))
        has_sliding = any(blk.sliding for blk in self.layers)
        if has_sliding:
            rope_l = tuple(t[:, :, None] for t in rope_tables(positions, self.inv_freq_local, dtype))
            if sliding_mask is None:
                sliding_mask = causal_mask(positions, tk, self.args.sliding_window)
        bias = self.attention_bias(mask, dtype)
        sliding_bias = self.attention_bias(sliding_mask, dtype) if has_sliding else None
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(hidden_layers)
        for i, blk in enumerate(self.layers):
            if blk.sliding:
                x = blk(x, rope_l, cache, slots, sliding_bias, tk)
            else:
                x = blk(x, rope_g, cache, slots, bias, tk)
            if i in wanted:
                hidden[i] = x
        final_idx = self.num_layers
        need_logits = logits_at is None or logits_at.shape[1] > 0
        if need_logits or final_idx in wanted:
            if logits_at is not None and final_idx not in wanted:
                x = x.gather(1, logits_at[..., None].expand(b, logits_at.shape[1], x.shape[-1]))
                h = self.norm(x)
            else:
                h = self.norm(x)
                hidden[final_idx] = h
                if logits_at is not None:
                    h = h.gather(1, logits_at[..., None].expand(b, logits_at.shape[1], h.shape[-1]))
        logits = self.logits(h) if need_logits else None
        missing = wanted - hidden.keys()
        if missing:
            raise ValueError(f"hidden layers {sorted(missing)} are out of range for {self.num_layers} layers")
        return logits, [hidden[i] for i in hidden_layers]
