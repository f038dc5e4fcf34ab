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


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; gemma3 scales by ``1 + w`` instead of ``w``."""

    def __init__(self, dim: int, eps: float, plus_one: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    """Rotate ``x [B, H, S, D]`` by ``cos, sin [B, 1, S, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Grouped-query attention without copying K/V; softmax in fp32.

    Args:
        q: ``[B, H, S, D]`` queries.
        keys: ``[B, Hkv, Tk, D]``.
        values: ``[B, Hkv, Tk, D]``.
        mask: ``[B, 1, S, Tk]`` bool, True where visible.
        scale: score scale.

    Returns:
        ``[B, S, H*D]``.
    """
    b, h, s, d = q.shape
    hkv, tk = keys.shape[1], keys.shape[2]
    g = h // hkv
    # fold the query heads of a group into the query axis so K/V are never copied
    q = q.reshape(b, hkv, g * s, d)  # [B, Hkv, G*S, D]
    if g > 1:
        mask = mask[:, :, None].expand(b, 1, g, s, tk).reshape(b, 1, g * s, tk)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, G*S, Tk]
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, Hkv, G*S, D]
    return out.reshape(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        e, d = args.hidden_size, args.head_dim
        self.layer = layer
        self.h, self.hkv, self.d = args.num_heads, args.num_kv_heads, d
        self.wq = nn.Linear(e, self.h * d, bias=args.attention_bias)
        self.wk = nn.Linear(e, self.hkv * d, bias=args.attention_bias)
        self.wv = nn.Linear(e, self.hkv * d, bias=args.attention_bias)
        self.wo = nn.Linear(self.h * d, e, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, args.norm_plus_one) if args.qk_norm else None
        self.scale = args.attn_scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: StaticKVCache,
                slots: torch.Tensor, mask: torch.Tensor, num_keys: int) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d).transpose(1, 2)  # [B, H, S, D]
        k = self.wk(x).view(b, s, self.hkv, self.d).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.wv(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(self.layer, slots, k, v)
        keys = cache.k[self.layer, :, :, :num_keys]  # [B, Hkv, Tk, D]
        values = cache.v[self.layer, :, :, :num_keys]
        return self.wo(grouped_attention(q, keys, values, mask, self.scale))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gelu = args.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down(g * self.up(x))


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

    def forward(self, x, rope, cache, slots, mask, num_keys):
        a = self.attn(self.attn_norm(x), rope, cache, slots, mask, num_keys)
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
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
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

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(hidden_layers)
        for i, blk in enumerate(self.layers):
            if blk.sliding:
                x = blk(x, rope_l, cache, slots, sliding_mask, tk)
            else:
                x = blk(x, rope_g, cache, slots, mask, tk)
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
