"""One pure-PyTorch decoder for the llama, qwen2, qwen3 and gemma3 families.

Every forward writes K/V into a :class:`refspec.cache.StaticKVCache` at per-row slots and
attends through a boolean mask built from positions (or an explicit tree mask), so step
shapes never change. Module names are refspec's own; ``refspec.models.loading`` maps
Hugging Face checkpoint names onto them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from refspec.cache import StaticKVCache, causal_mask
from refspec.config import ModelArgs


class ColumnCopy:
    """A column-major (``[in, out]`` contiguous) copy of a weight for one-row products.

    On the project's CPU a one-row product streams a column-major matrix about 1.25x faster
    than a row-major one, while for 2 or more rows the row-major ``(W @ x^T)^T`` is best, so
    CPU decoding may keep both layouts (:meth:`Transformer.add_column_copies`). The copy is
    used only while the weight is the very tensor it was made from, unmodified (same storage,
    same version counter); otherwise :func:`linear` falls back to the weight itself.
    """

    __slots__ = ("ptr", "version", "t")

    def __init__(self, weight: torch.Tensor) -> None:  # noqa: D107
        if weight.is_inference():
            raise ValueError("an inference-mode tensor has no version counter to guard a copy with")
        self.ptr, self.version = weight.data_ptr(), weight._version
        self.t = weight.detach().t().contiguous()  # [in, out]

    def of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy if ``weight`` is unchanged since it was made, else None."""
        if weight.data_ptr() != self.ptr or weight.is_inference():
            return None
        return self.t if weight._version == self.version else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           column: ColumnCopy | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, with the GEMM layout chosen for fp32 on CPUs.

    Measured on the project's CPU (torch 2.13, 2 threads, SmolLM2-135M's matrices streamed
    from memory): for 2 to 320 rows ``(W @ x^T)^T`` runs 1.2-2.4x faster than ``F.linear``;
    for one row a column-major copy (``column``) is about 1.25x faster than either. Other
    devices and dtypes use ``F.linear``. The result may be a column-major view; later ops
    accept it as is.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 2 or x.numel() == 0:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    wt = column.of(weight) if column is not None and rows.shape[0] == 1 else None
    if wt is not None:
        out = torch.mm(rows, wt) if bias is None else torch.addmm(bias, rows, wt)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    out = torch.mm(weight, rows.t()) if bias is None else torch.addmm(bias[:, None], weight, rows.t())
    return out.t().reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` that multiplies through :func:`linear`."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        self._col: ColumnCopy | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._col)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; gemma3 scales by ``1 + w`` instead of ``w``."""

    def __init__(self, dim: int, eps: float, plus_one: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not self.plus_one and self.weight.dtype == torch.float32:
            # one fused kernel; the same arithmetic as below (x * rsqrt(mean(x^2) + eps) * w)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., D]`` by ``cos, sin`` broadcastable to it (rotate-half convention): the
    model passes ``x [B, S, H, D]`` with tables ``[B, S, 1, D]``, heads pass ``[B, H, S, D]``
    with ``[B, 1, S, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
        ``[B, S, H*D]``.
    """
    b, s, h, d = q.shape
    hkv, tk = keys.shape[1], keys.shape[2]
    g = h // hkv
    out_dtype = q.dtype
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # CPUs without bf16/fp16 matrix units emulate these GEMMs several times slower than
        # fp32; the attended K/V are small next to the weights, so compute in fp32 there
        q, keys, values = q.float(), keys.float(), values.float()  # the bias is fp32 on CPUs
    # query head i uses K/V head i // G; fold a group's heads into the query axis
    qg = q.reshape(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * s, d)
    scores = torch.baddbmm(bias, qg, keys.reshape(b * hkv, tk, d).transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)  # [B*Hkv, G*S, Tk]
    out = torch.bmm(probs, values.reshape(b * hkv, tk, d))  # [B*Hkv, G*S, D]
    return out.view(b, hkv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d).to(out_dtype)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input into one
    tensor and make each linear's parameters views of it, so no memory is duplicated and
    one GEMM replaces several. Inference only: the views are frozen."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _still_fused(fused: torch.Tensor | None, linears: tuple[nn.Linear, ...]) -> bool:
    """Whether every linear's weight is still the view :func:`fuse_linears` made (a
    ``.to()`` or an ``assign`` load replaces parameters; the split path is used then)."""
    if fused is None:
        return False
    ptr, step = fused.data_ptr(), fused.element_size() * fused.shape[1]
    for lin in linears:
        if lin.weight.data_ptr() != ptr:
            return False
        ptr += step * lin.weight.shape[0]
    return True


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        e, d = args.hidden_size, args.head_dim
        self.layer = layer
        self.h, self.hkv, self.d = args.num_heads, args.num_kv_heads, d
        self.wq = Linear(e, self.h * d, bias=args.attention_bias)
        self.wk = Linear(e, self.hkv * d, bias=args.attention_bias)
        self.wv = Linear(e, self.hkv * d, bias=args.attention_bias)
        self.wo = Linear(self.h * d, e, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.scale = args.attn_scale
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._qkv_col: ColumnCopy | None = None

    def fuse(self) -> None:
        """One ``[(H + 2 Hkv) * D, E]`` projection instead of three (frozen weights)."""
        self._qkv = fuse_linears([self.wq, self.wk, self.wv])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: StaticKVCache,
                slots: torch.Tensor, bias: torch.Tensor, num_keys: int) -> torch.Tensor:
        """Attend over the cache prefix after writing this step's K/V.

        Args:
            x: ``[B, S, E]`` normed input.
            rope: ``(cos, sin)``, each ``[B, S, 1, D]``.
            cache: static cache.
            slots: ``[B, S]`` where this step's K/V go.
            bias: ``[B*Hkv, G*S, Tk]`` from :func:`attention_bias`.
            num_keys: Tk.
        """
        b, s, _ = x.shape
        h, hkv = self.h, self.hkv
        lins = (self.wq, self.wk, self.wv)
        if _still_fused(self._qkv[0] if self._qkv else None, lins):
            qkv = linear(x, *self._qkv, column=self._qkv_col)
        else:
            qkv = torch.cat([lin(x) for lin in lins], dim=-1)
        qkv = qkv.view(b, s, h + 2 * hkv, self.d)
        cos, sin = rope
        if self.q_norm is None:
            qk = apply_rope(qkv[:, :, : h + hkv], cos, sin)  # q and k rotated together
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q = apply_rope(self.q_norm(qkv[:, :, :h]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, :, h: h + hkv]), cos, sin)
        v = qkv[:, :, h + hkv:]
        cache.write(self.layer, slots, k.transpose(1, 2), v.transpose(1, 2))
        keys = cache.k[self.layer, :, :, :num_keys]  # [B, Hkv, Tk, D]
        values = cache.v[self.layer, :, :, :num_keys]
        return self.wo(attend(q, keys, values, bias, self.scale))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down = Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gelu = args.hidden_act == "gelu_tanh"
        self._gate_up: tuple[torch.Tensor, None] | None = None
        self._gate_up_col: ColumnCopy | None = None

    def fuse(self) -> None:
        """One ``[2 I, E]`` projection for gate and up (frozen weights)."""
        self._gate_up = fuse_linears([self.gate, self.up])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _still_fused(self._gate_up[0] if self._gate_up else None, (self.gate, self.up)):
            g, u = linear(x, self._gate_up[0], column=self._gate_up_col).chunk(2, dim=-1)
        else:
            g, u = self.gate(x), self.up(x)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down(g * u)


class Block(nn.Module):
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

    def forward(self, x, rope, cache, slots, bias, num_keys):
        """One decoder block; ``rope`` and ``bias`` as :meth:`Attention.forward` takes them."""
        a = self.attn(self.attn_norm(x), rope, cache, slots, bias, num_keys)
        x = x + (self.attn_post_norm(a) if self.sandwich else a)
        m = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_post_norm(m) if self.sandwich else m)


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

    def fuse_projections(self) -> "Transformer":
        """Fuse q/k/v and gate/up projections of every block for inference (no extra memory:
        the original parameters become views). Call after the weights are on their device;
        a later ``.to()`` silently falls back to the unfused path."""
        for blk in self.layers:
            blk.attn.fuse()
            blk.mlp.fuse()
        return self

    def add_column_copies(self, max_bytes: int) -> bool:
        """Keep a column-major copy of every fused block matrix and of the LM head for
        one-row (batch-1 decode) products on CPUs (:class:`ColumnCopy`), unless the copies
        would take more than ``max_bytes``. Returns whether they were made."""
        mats = [(self.lm_head, "_col", self.lm_head.weight)]
        for blk in self.layers:
            attn, mlp = blk.attn, blk.mlp
            mats += [(attn.wo, "_col", attn.wo.weight), (mlp.down, "_col", mlp.down.weight)]
            if attn._qkv is not None:
                mats.append((attn, "_qkv_col", attn._qkv[0]))
            if mlp._gate_up is not None:
                mats.append((mlp, "_gate_up_col", mlp._gate_up[0]))
        extra = sum(w.numel() * w.element_size() for _, _, w in mats)
        if extra > max_bytes or any(w.is_inference() for _, _, w in mats):
            return False  # too big, or weights made under inference_mode (no version counter)
        for owner, attr, weight in mats:
            setattr(owner, attr, ColumnCopy(weight))
        return True

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # [B, S, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        rope_g = self._rope(positions, self.inv_freq_global, dtype)
        has_sliding = any(blk.sliding for blk in self.layers)
        if has_sliding:
            rope_l = self._rope(positions, self.inv_freq_local, dtype)
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
