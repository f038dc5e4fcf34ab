"""EAGLE drafters: a one-layer head that extrapolates the target's features (EAGLE-1/2/3).

Two heads, one drafter:

- ``eagle`` (EAGLE-1, Li et al. 2024): the head reads the target's final-normed feature
  ``f_i`` of position i and the embedding of token ``x_{i+1}``, fuses them with
  ``fc: 2E -> E`` and one decoder layer, and predicts ``f_{i+1}``; the target's own LM head
  turns a predicted feature into draft logits. Embedding and LM head are the target's.
- ``eagle3`` (EAGLE-3, Li et al. 2025): the head fuses a low, a middle and a high target layer
  (``fc: 3E -> E``), its decoder layer attends over ``[norm(embed), norm(feature)]`` (2E), and
  it has its own final norm and LM head over an optional reduced draft vocabulary (``d2t``
  maps a draft id d to target id ``d + d2t[d]``; ``t2d`` marks target ids in the draft
  vocabulary). It is trained with training-time test: during training it feeds on its own
  predictions for a few steps, as it does when drafting.

Alignment: head cache slot j holds the pair ``(x_{j+1}, f_j)`` at rotary position j, and its
output at slot j predicts ``f_{j+1}`` (hence token ``x_{j+2}``).

Cache consistency (catch-up): the head keeps its own static KV cache, valid for every slot
below the target's committed length. Each ``propose`` first re-feeds, at slots
``prev_lengths + i``, the pairs of the features the last verify produced (``state.hidden``,
the accepted path for trees; a fixed width, so rows stay ragged without per-row control
flow); the output at slot ``lengths - 1`` gives the first draft. Draft entries written beyond
that are overwritten by the next catch-up before anything attends to them, so after a tree
step the head's cache holds exactly the accepted path. The catch-up of the prompt runs in
``reset`` (it belongs to the prefill phase).

Drafting: a chain of K tokens (K - 1 head forwards after the catch-up), or an EAGLE-2 dynamic
tree: expand the ``tree_topk`` best children of the ``tree_topk`` best nodes of each level
(by cumulative log-probability) for ``tree_depth`` levels, then keep the ``tree_budget``
best nodes overall (a set closed under ancestors, because scores strictly decrease along a
path) and let the engine verify the whole tree in one target forward with a tree mask.

Checkpoints: :func:`load_head` reads the published EAGLE-1/2 layout (``fc.weight``,
``fc.bias``, ``layers.0.self_attn.q_proj.weight``, ``layers.0.mlp.gate_proj.weight``,
``layers.0.post_attention_layernorm.weight``; no input norm; ``config.json`` LlamaConfig
fields) and the EAGLE-3 layout (``fc.weight``, ``midlayer.self_attn.*``, ``midlayer.mlp.*``,
``midlayer.input_layernorm.weight``, ``midlayer.hidden_norm.weight``,
``midlayer.post_attention_layernorm.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
``t2d``; ``config.json`` with ``draft_vocab_size`` and optionally
``eagle_config.eagle_aux_hidden_state_layer_ids``), from ``model.safetensors`` or
``pytorch_model.bin`` (read with ``weights_only=True``). :func:`save_head` writes the same
layouts (so published tooling reads ours), with a ``refspec`` section in ``config.json``
holding the fused layers and the training provenance.

Shapes: B batch, S query length, T cache length, K draft length, N tree nodes, E model dim,
V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from refspec.cache import StaticKVCache, causal_mask
from refspec.drafting import DecodeState, Draft, DrafterError, DraftTree
from refspec.models.transformer import RMSNorm, apply_rope, grouped_attention, rope_inv_freq
from refspec.phases import ForwardShape
from refspec.sampling import probs_from_logits, sample

log = logging.getLogger(__name__)

KINDS = ("eagle", "eagle3")
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---- configuration ------------------------------------------------------------------------------


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
        self.wq = nn.Linear(in_dim, h * d, bias=False)
        self.wk = nn.Linear(in_dim, hkv * d, bias=False)
        self.wv = nn.Linear(in_dim, hkv * d, bias=False)
        self.wo = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [B, S, in]`` -> rotated ``q [B, H, S, D]``, ``k, v [B, Hkv, S, D]``."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.wk(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        v = self.wv(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, H, S, D]`` over ``keys, values [B, Hkv, Tk, D]`` with ``mask [B, 1, S, Tk]`` -> ``[B, S, E]``."""
        return self.wo(grouped_attention(q, keys, values, mask, 1.0 / math.sqrt(self.d)))


class _HeadMLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        return self.down((F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)) * self.up(x))


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
        self.mlp = _HeadMLP(cfg)
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

    # -- shared body ------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.mlp.up.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [B, 1, S, D]`` for ``positions [B, S]``."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out
        return x + self.mlp(self.mlp_norm(x))

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
        cos, sin = self.rope(positions, x.dtype)
        q, k, v = self.attn.project(x, cos, sin)
        cache.write(0, slots, k, v)
        out = self.attn.attend(q, cache.k[0, :, :, :num_keys], cache.v[0, :, :, :num_keys], mask)
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
            cos, sin = self.rope((idx + j)[None].expand(b, s), x.dtype)
            q, k, v = self.attn.project(x, cos, sin)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [eye] * j, dim=1)[None, None].expand(b, 1, s, s * (j + 1))
            out = self._finish(residual, self.attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
            outs.append(out)
            h = out
        return outs


class Eagle1Head(EagleHead):
    """EAGLE-1/2 head: ``fc(cat(embed, feature))`` then one decoder layer without input norm."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)

    def prepare(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return feats[0]

    def _attn_input(self, emb, h):
        x = self.fc(torch.cat([emb, h], dim=-1))
        return x, x

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        w = target.lm_head.weight
        logits = F.linear(out.to(w.dtype), w).float()
        cap = target.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


class Eagle3Head(EagleHead):
    """EAGLE-3 head: ``fc`` fuses three target layers; attention reads ``[norm(embed), norm(h)]``;
    own final norm and LM head over the draft vocabulary."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, 2 * cfg.hidden_size)
        e = cfg.hidden_size
        self.fc = nn.Linear(3 * e, e, bias=cfg.fc_bias)
        self.input_norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.hidden_norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.lm_head = nn.Linear(e, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install a reduced vocabulary: ``draft_to_target [Vd]`` ascending target ids."""
        vd = self.config.draft_vocab_size
        assert draft_to_target.shape == (vd,), f"expected {vd} target ids"
        self.d2t.copy_(draft_to_target - torch.arange(vd, device=draft_to_target.device))
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    def prepare(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(feats, dim=-1).to(self.fc.weight.dtype))

    def _attn_input(self, emb, h):
        return torch.cat([self.input_norm(emb), self.hidden_norm(h)], dim=-1), h

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def new_head(cfg: HeadConfig) -> EagleHead:
    """An untrained head of ``cfg``."""
    return Eagle1Head(cfg) if cfg.kind == "eagle" else Eagle3Head(cfg)


# ---- checkpoints: published layouts and ours -----------------------------------------------------

# (published name, refspec name) per layout; one table each, strict both ways.
_LAYER = [
    ("self_attn.q_proj.weight", "attn.wq.weight"), ("self_attn.k_proj.weight", "attn.wk.weight"),
    ("self_attn.v_proj.weight", "attn.wv.weight"), ("self_attn.o_proj.weight", "attn.wo.weight"),
    ("mlp.gate_proj.weight", "mlp.gate.weight"), ("mlp.up_proj.weight", "mlp.up.weight"),
    ("mlp.down_proj.weight", "mlp.down.weight"), ("post_attention_layernorm.weight", "mlp_norm.weight"),
]
KEY_MAP: dict[str, list[tuple[str, str]]] = {
    "eagle": [("fc.weight", "fc.weight"), ("fc.bias", "fc.bias")] + [(f"layers.0.{a}", b) for a, b in _LAYER],
    "eagle3": [("fc.weight", "fc.weight"), ("norm.weight", "norm.weight"), ("lm_head.weight", "lm_head.weight"),
               ("d2t", "d2t"), ("t2d", "t2d"), ("midlayer.input_layernorm.weight", "input_norm.weight"),
               ("midlayer.hidden_norm.weight", "hidden_norm.weight")] + [(f"midlayer.{a}", b) for a, b in _LAYER],
}
# Published heads sometimes carry a copy of the target's embedding; refspec uses the target's own.
_IGNORED = re.compile(r"^(model\.)?embed_tokens\.weight$")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / WEIGHTS, path / "pytorch_model.bin"
    if st.exists():
        from safetensors.torch import load_file

        return load_file(str(st))
    if pt.exists():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise DrafterError(f"{path} holds no {WEIGHTS} or pytorch_model.bin")


def _config_from_published(cfg: dict[str, Any], kind: str, weights: dict[str, torch.Tensor],
                           target_args) -> HeadConfig:
    """Build a :class:`HeadConfig` from a published ``config.json`` (LlamaConfig fields)."""
    own = cfg.get("refspec", {})
    if cfg.get("num_hidden_layers", 1) != 1:
        raise DrafterError(f"the head has {cfg['num_hidden_layers']} decoder layers; refspec loads one-layer heads")
    e, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = own.get("feature_layers")
    if layers is None and kind == "eagle3":
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        # published ids name the layer whose *input* is taken; refspec numbers by producing block
        layers = [i - 1 for i in ids] if ids else eagle3_layers(target_args.num_layers)
    if layers is None:
        layers = [target_args.num_layers]
    act = cfg.get("hidden_act", "silu")
    return HeadConfig(
        kind=kind, hidden_size=e, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or e // heads), intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg.get("vocab_size", target_args.vocab_size)),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg.get("vocab_size", target_args.vocab_size)),
        feature_layers=tuple(int(l) for l in layers), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
        hidden_act="gelu_tanh" if "gelu" in act else "silu", fc_bias="fc.bias" in weights)


def load_head(path: str | Path, target_args, *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[EagleHead, dict[str, Any]]:
    """Load an EAGLE-1/2 or EAGLE-3 head directory (published layout or refspec's).

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``).
        target_args: the target's ``ModelArgs`` (the head must match its E and V).
        device: where to put the head.
        dtype: parameter dtype.

    Returns:
        ``(head, provenance)``; provenance is the ``refspec.provenance`` section of
        ``config.json`` (empty for published heads).

    Raises:
        DrafterError: missing files, an unknown layout, shapes or keys that do not match.
    """
    path = Path(path)
    if not (path / CONFIG).exists():
        raise DrafterError(f"{path} holds no {CONFIG}; is it an EAGLE head directory?")
    cfg = json.loads((path / CONFIG).read_text())
    weights = {k: v for k, v in _read_weights(path).items() if not _IGNORED.match(k)}
    kind = "eagle3" if any(k.startswith("midlayer.") for k in weights) else "eagle"
    if kind == "eagle" and not any(k.startswith("layers.0.") for k in weights):
        raise DrafterError(f"{path}: neither the EAGLE-1 (layers.0.*) nor the EAGLE-3 (midlayer.*) layout; "
                           f"keys start with {sorted({k.split('.')[0] for k in weights})}")
    hc = _config_from_published(cfg, kind, weights, target_args)
    hc.check_target(target_args)
    head = new_head(hc)
    table = dict(KEY_MAP[kind])
    state, unexpected = {}, []
    for name, tensor in weights.items():
        if name in table:
            state[table[name]] = tensor
        else:
            unexpected.append(name)
    expected = set(head.state_dict())
    missing = sorted(expected - state.keys())
    if kind == "eagle3" and {"d2t", "t2d"} & set(missing):
        if hc.draft_vocab_size != hc.vocab_size:
            raise DrafterError(f"{path}: a reduced draft vocabulary ({hc.draft_vocab_size}) needs d2t and t2d")
        missing = [m for m in missing if m not in ("d2t", "t2d")]  # full vocabulary: identity maps
    if missing or unexpected:
        raise DrafterError(f"{path} does not match the {kind} layout: missing {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        want = head.state_dict()[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise DrafterError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
        state["d2t"] = state["d2t"].long()
    head.load_state_dict(state, strict=False)
    head.to(device=device)
    _cast_params(head, dtype)
    head.eval().requires_grad_(False)
    log.info("loaded %s head from %s (feature layers %s, draft vocabulary %d)", kind, path, hc.feature_layers,
             hc.draft_vocab_size)
    return head, cfg.get("refspec", {}).get("provenance", {})


def _cast_params(head: EagleHead, dtype: torch.dtype) -> None:
    """Cast floating parameters (not the integer/boolean vocabulary maps or rotary buffers)."""
    for p in head.parameters():
        p.data = p.data.to(dtype)


def save_head(head: EagleHead, path: str | Path, *, provenance: dict[str, Any] | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write a head in the published layout of its kind plus refspec's config section.

    Args:
        head: the head.
        path: output directory (created).
        provenance: training provenance recorded under ``config.json: refspec.provenance``.
        dtype: dtype of the stored floating weights (default: the head's).

    Returns:
        The directory written.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hc = head.config
    back = {ours: theirs for theirs, ours in KEY_MAP[hc.kind]}
    tensors = {back[k]: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in head.state_dict().items()}
    if hc.kind == "eagle3":
        tensors["t2d"] = tensors["t2d"].to(torch.bool)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hc.hidden_size,
        "num_attention_heads": hc.num_heads, "num_key_value_heads": hc.num_kv_heads, "head_dim": hc.head_dim,
        "intermediate_size": hc.intermediate_size, "num_hidden_layers": 1, "vocab_size": hc.vocab_size,
        "rms_norm_eps": hc.rms_norm_eps, "rope_theta": hc.rope_theta, "rope_scaling": hc.rope_scaling,
        "hidden_act": "gelu_pytorch_tanh" if hc.hidden_act == "gelu_tanh" else "silu",
        "bias": hc.fc_bias, "tie_word_embeddings": False, "torch_dtype": str(dtype or head.dtype).replace("torch.", ""),
        "refspec": {"kind": hc.kind, "feature_layers": list(hc.feature_layers), "provenance": provenance or {}},
    }
    if hc.kind == "eagle3":
        cfg["draft_vocab_size"] = hc.draft_vocab_size
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [l + 1 for l in hc.feature_layers]}
    tmp = path / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / WEIGHTS)
    (path / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


# ---- the drafter --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeConfig:
    """EAGLE-2 dynamic tree settings.

    Attributes:
        topk: children expanded per node and nodes expanded per level.
        depth: levels drafted (the longest path).
        budget: nodes kept for verification (N).
    """

    topk: int = 4
    depth: int = 5
    budget: int = 16

    def __post_init__(self) -> None:
        if self.topk < 1 or self.depth < 1 or self.budget < 1:
            raise DrafterError(f"tree topk, depth and budget must be >= 1, got {self}")
        if self.budget > self.candidates:
            raise DrafterError(f"tree budget {self.budget} exceeds the {self.candidates} candidates that topk "
                               f"{self.topk} and depth {self.depth} generate")

    @property
    def candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk


class EagleDrafter:
    """Chain or tree drafting with an EAGLE head over a frozen target.

    Args:
        head: a loaded head (its ``feature_layers`` are the target layers the engine returns).
        target: the target ``Transformer`` (its embedding, and for EAGLE-1 its LM head, are used).
        tree: EAGLE-2 tree settings, or None to draft a chain of K tokens.
        kv_bucket: attended cache prefix granularity.
    """

    def __init__(self, head: EagleHead, target, *, tree: TreeConfig | None = None, kv_bucket: int = 64) -> None:
        head.config.check_target(target.args)
        self.head = head
        self.target = target
        self.tree = tree
        self.kv_bucket = kv_bucket
        self.name = head.config.kind
        self.hidden_layers: tuple[int, ...] = tuple(head.config.feature_layers)
        # the target writes the root plus N nodes per step; the engine reserves k + 1 + extra_slots
        self.extra_slots = tree.budget if tree is not None else 0
        self.cache: StaticKVCache | None = None
        self._primed: tuple[torch.Tensor, torch.Tensor] | None = None  # (feature [B, E], logits [B, Vd])
        self._ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=target.device))  # [Vd]

    # -- helpers ----------------------------------------------------------------------------
    @property
    def _span(self) -> int:
        """Head cache slots a step writes past the committed length."""
        return (self.tree.depth - 1) * self.tree.topk + 1 if self.tree is not None else 0

    def _num_keys(self, state: DecodeState, width: int, k: int) -> int:
        return min(self.cache.max_len, _round_up(state.max_length_bound + width + max(k, self._span) + 1,
                                                 self.kv_bucket))

    def _head_args(self, args):
        hc = self.head.config
        return dataclasses.replace(args, num_layers=1, vocab_size=hc.draft_vocab_size, layer_types=(),
                                   tie_word_embeddings=False)

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., Vd]`` -> ``[..., V]`` with -inf outside the draft vocabulary."""
        if self.head.config.draft_vocab_size == self.head.config.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.head.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self._ids, logits)

    def _catch_up(self, state: DecodeState, start: torch.Tensor, pick: torch.Tensor, num_keys: int):
        """Feed the pairs of ``state.hidden`` at slots ``start + i``; return the output at ``pick``.

        Returns:
            ``(feature [B, E], logits [B, Vd])`` predicted for the position after the pending token.
        """
        head, t = self.head, state.tokens.shape[1]
        b, w = state.hidden[0].shape[:2]
        positions = (start[:, None] + torch.arange(w, device=start.device)).clamp_(max=self.cache.max_len - 1)
        nxt = state.tokens.gather(1, (positions + 1).clamp(max=t - 1))  # x_{j+1}
        emb = self.target.embed_tokens(nxt).to(head.dtype)
        h = head.prepare([x.to(head.dtype) for x in state.hidden])
        out = head.step(emb, h, positions, self.cache, positions, causal_mask(positions, num_keys), num_keys)
        feat = out.gather(1, pick.clamp(0, w - 1)[:, None, None].expand(b, 1, out.shape[-1])).squeeze(1)
        return feat, head.draft_logits(feat, self.target)

    # -- protocol ---------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, state: DecodeState) -> None:
        b, t = state.tokens.shape
        size = t + self._span + 2
        hc, dev = self.head.config, state.tokens.device
        if self.cache is None or self.cache.batch != b or self.cache.max_len != size:
            self.cache = StaticKVCache(num_layers=1, batch=b, num_kv_heads=hc.num_kv_heads, max_len=size,
                                       head_dim=hc.head_dim, dtype=self.head.dtype, device=dev)
        self.cache.reset()
        w = state.hidden[0].shape[1]
        start = torch.zeros(b, dtype=torch.long, device=dev)
        self._primed = self._catch_up(state, start, state.prompt_lengths - 1, self._num_keys(state, w, 0))

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Draft:
        if self._primed is not None:
            feat, logits = self._primed
            self._primed = None
        else:
            w = state.hidden[0].shape[1]
            feat, logits = self._catch_up(state, state.prev_lengths, state.num_accepted,
                                          self._num_keys(state, w, k))
        if self.tree is not None:
            if not state.sampling.greedy:
                raise DrafterError("EAGLE tree drafting is greedy only; drop the tree option to sample")
            return self._propose_tree(state, feat, logits)
        return self._propose_chain(state, feat, logits, k)

    def _propose_chain(self, state: DecodeState, feat: torch.Tensor, logits: torch.Tensor, k: int) -> Draft:
        head = self.head
        num_keys = self._num_keys(state, 1, k)
        drafts, probs = [], []
        for i in range(k):
            if state.sampling.greedy:
                tok, q = head.to_target_ids(logits.argmax(-1)), None
            else:
                q = probs_from_logits(self._full_logits(logits), state.sampling)
                tok = sample(q, state.generator)
            drafts.append(tok)
            probs.append(q)
            if i == k - 1:
                break
            pos = (state.lengths + i).clamp(max=self.cache.max_len - 1)[:, None]  # [B, 1]
            emb = self.target.embed_tokens(tok[:, None]).to(head.dtype)
            out = head.step(emb, feat[:, None], pos, self.cache, pos, causal_mask(pos, num_keys), num_keys)
            feat = out[:, 0]
            logits = head.draft_logits(feat, self.target)
        tokens = torch.stack(drafts, dim=1)  # [B, K]
        return Draft(tokens=tokens, probs=None if state.sampling.greedy else torch.stack(probs, dim=1))

    def _propose_tree(self, state: DecodeState, feat: torch.Tensor, logits: torch.Tensor) -> Draft:
        """EAGLE-2: grow ``depth`` levels of the best ``topk`` nodes, keep the best ``budget``."""
        head, tc = self.head, self.tree
        b, dev = feat.shape[0], feat.device
        kk = tc.topk
        num_keys = self._num_keys(state, 1, 0)
        key_slot = torch.arange(num_keys, device=dev)
        base = state.lengths  # [B] first slot past the committed prefix
        # level 1: the root's top-k
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(kk, dim=-1)
        score = top.values.double().clamp_max(-1e-6)  # [B, k]; strictly decreasing along any path
        tok = top.indices  # draft-vocabulary ids
        cand_tok, cand_score = [tok], [score]
        cand_parent = [torch.full((b, kk), -1, dtype=torch.long, device=dev)]
        cand_depth = [torch.ones(b, kk, dtype=torch.long, device=dev)]
        node_cand = torch.arange(kk, device=dev)[None].expand(b, kk)  # candidate index of each fed node
        node_feat = feat[:, None].expand(b, kk, feat.shape[-1])  # the feature each node is paired with
        rows = (key_slot[None, None] < base[:, None, None]).expand(b, kk, num_keys)  # committed keys
        n_cand = kk
        for level in range(1, tc.depth):
            slots = (base[:, None] + (level - 1) * kk + torch.arange(kk, device=dev)).clamp_(max=num_keys - 1)
            rows = rows | (key_slot[None, None] == slots[..., None])  # ancestors + self
            pos = (base + level - 1)[:, None].expand(b, kk)
            emb = self.target.embed_tokens(head.to_target_ids(tok)).to(head.dtype)
            out = head.step(emb, node_feat, pos, self.cache, slots, rows[:, None], num_keys)  # [B, k, E]
            logp = torch.log_softmax(head.draft_logits(out, self.target), -1)  # [B, k, Vd]
            top = logp.topk(kk, dim=-1)  # [B, k, k]
            child_score = (score[..., None] + top.values.double().clamp_max(-1e-6)).reshape(b, kk * kk)
            child_tok = top.indices.reshape(b, kk * kk)
            child_parent = node_cand[:, :, None].expand(b, kk, kk).reshape(b, kk * kk)
            cand_tok.append(child_tok)
            cand_score.append(child_score)
            cand_parent.append(child_parent)
            cand_depth.append(torch.full((b, kk * kk), level + 1, dtype=torch.long, device=dev))
            # the next level expands the best k children
            best = child_score.topk(kk, dim=-1).indices  # [B, k]
            from_node = best // kk
            score = child_score.gather(1, best)
            tok = child_tok.gather(1, best)
            node_cand = n_cand + best
            node_feat = out.gather(1, from_node[..., None].expand(b, kk, out.shape[-1]))
            rows = rows.gather(1, from_node[..., None].expand(b, kk, num_keys))
            n_cand += kk * kk
        scores = torch.cat(cand_score, 1)  # [B, C]
        keep = scores.topk(tc.budget, dim=-1).indices.sort(dim=-1).values  # [B, N]; parents precede children
        tokens = head.to_target_ids(torch.cat(cand_tok, 1).gather(1, keep))
        parent_cand = torch.cat(cand_parent, 1).gather(1, keep)
        depth = torch.cat(cand_depth, 1).gather(1, keep)
        where = torch.searchsorted(keep, parent_cand.clamp_min(0))  # index of the parent among the kept
        parents = torch.where(parent_cand < 0, torch.zeros_like(where), where + 1)
        return Draft(tokens=tokens, tree=DraftTree(parents=parents, depth=depth, max_depth=tc.depth))

    def commit(self, state: DecodeState) -> None:
        return None  # the next propose catches up from state.hidden

    # -- analytic work ----------------------------------------------------------------------
    def _shape(self, state: DecodeState, rows: int, s: int, context: int, lm_tokens: int) -> ForwardShape:
        hc = self.head.config
        fc_in = 2 if hc.kind == "eagle" else 3
        return ForwardShape(args=self._head_args(state.target_args), rows=rows, tokens_per_row=s,
                            context_tokens=context, dtype_bytes=torch.finfo(self.head.dtype).bits // 8,
                            lm_head_tokens=lm_tokens, lm_head_rows=hc.draft_vocab_size, layers=1,
                            extra_weight_bytes=fc_in * hc.hidden_size ** 2 * torch.finfo(self.head.dtype).bits // 8,
                            extra_flops=2 * fc_in * hc.hidden_size ** 2 * rows * s)

    def draft_work(self, state: DecodeState, k: int) -> tuple[ForwardShape, ...]:
        b, ctx = state.batch, state.max_length_bound * state.batch
        w = state.hidden[0].shape[1]
        work = [self._shape(state, b, w, ctx, b)]
        if self.tree is not None:
            kk = self.tree.topk
            work += [self._shape(state, b, kk, ctx + i * kk * b, b * kk) for i in range(self.tree.depth - 1)]
        else:
            work += [self._shape(state, b, 1, ctx + i * b, b) for i in range(1, k)]
        return tuple(work)

    def prefill_work(self, state: DecodeState) -> tuple[ForwardShape, ...]:
        b, s = state.batch, state.hidden[0].shape[1]
        return (self._shape(state, b, s, b * s * (s + 1) // 2, b),)


# ---- finding heads and the registry hook ---------------------------------------------------------


def shipped_heads_dir() -> Path:
    """``drafters/heads/`` inside the installed package (heads small enough to ship)."""
    return Path(__file__).resolve().parent / "heads"


def head_dir_name(target_name: str, kind: str) -> str:
    """``<model-id>-<kind>``; a path target uses its directory name as the id."""
    model_id = Path(target_name).name if ("/" in target_name or os.sep in target_name) else target_name
    return f"{model_id}-{kind}"


def find_head(target_name: str, kind: str) -> Path:
    """The head directory for a target: ``drafters/heads/<id>-<kind>/``, then ``$REFSPEC_HOME/heads/``.

    Raises:
        DrafterError: none found; the message gives the exact command that trains one.
    """
    name = head_dir_name(target_name, kind)
    from refspec.assets import refspec_home

    places = [shipped_heads_dir() / name, refspec_home() / "heads" / name]
    for p in places:
        if (p / CONFIG).exists():
            return p
    raise DrafterError(
        f"no {kind} head for {target_name!r} (looked in {', '.join(map(str, places))}). Train one with\n"
        f"  python -m refspec.drafters.train --drafter {kind} --model {target_name} --out {places[1]}\n"
        f"or pass the option head=/path/to/an/EAGLE/head")


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off", ""):
            return False
        raise DrafterError(f"expected a boolean option, got {value!r}")
    return bool(value)


def build_drafter(kind: str, ctx) -> EagleDrafter:
    """Registry builder: options ``head`` (path), ``tree`` (bool), ``tree_budget``, ``tree_topk``,
    ``tree_depth``."""
    opts = ctx.options
    path = Path(opts["head"]) if opts.get("head") else find_head(ctx.target_name, kind)
    head, _ = load_head(path, ctx.target.args, device=ctx.device, dtype=ctx.dtype)
    if head.config.kind != kind:
        raise DrafterError(f"{path} holds an {head.config.kind} head, not {kind}; use --drafter {head.config.kind}")
    tree = None
    if _flag(opts.get("tree", False)):
        tree = TreeConfig(topk=int(opts.get("tree_topk", 4)), depth=int(opts.get("tree_depth", 5)),
                          budget=int(opts.get("tree_budget", 16)))
    return EagleDrafter(head, ctx.target, tree=tree)


def register_builtin(register) -> None:
    """Register ``eagle`` and ``eagle3`` with the drafter registry."""
    register("eagle", lambda ctx: build_drafter("eagle", ctx), default_k=4,
             help="EAGLE-1/2 feature head (option tree=true for EAGLE-2 dynamic trees)")
    register("eagle3", lambda ctx: build_drafter("eagle3", ctx), default_k=4,
             help="EAGLE-3 head fusing three target layers (option tree=true for dynamic trees)")


# ---- training -----------------------------------------------------------------------------------


class EagleTrainingModule(nn.Module):
    """A head plus its training recipe; ``forward(batch, target)`` returns ``(loss, metrics)``.

    Per unrolled step j (weighted ``0.8 ** j``), over trained positions: cross-entropy of the
    draft logits against the target's greedy next token (weighted ``ce_weight``); for
    ``eagle`` also a smooth-L1 regression of the predicted feature onto the target's
    final-normed feature (weight 1), as EAGLE-1 trains. Positions whose label lies outside a
    reduced draft vocabulary are not trained on (EAGLE-3 does the same).

    Args:
        head: the head being trained (float32).
        ttt_steps: unrolled steps of training-time test (1 = teacher forcing only).
        noise: half-width of uniform noise added to the input target features.
        ce_weight: weight of the cross-entropy term.
        ce_fraction: share of trained positions (drawn at random each step) that enter the
            cross-entropy; the LM head over the whole vocabulary dominates the cost of an
            EAGLE-1 step on a CPU, and the regression term already sees every position.
    """

    def __init__(self, head: EagleHead, *, ttt_steps: int, noise: float, ce_weight: float,
                 ce_fraction: float = 1.0) -> None:
        super().__init__()
        if ttt_steps < 1:
            raise DrafterError(f"ttt_steps must be >= 1, got {ttt_steps}")
        if not 0 < ce_fraction <= 1:
            raise DrafterError(f"ce_fraction must be in (0, 1], got {ce_fraction}")
        self.head = head
        self.ttt_steps, self.noise, self.ce_weight, self.ce_fraction = ttt_steps, noise, ce_weight, ce_fraction
        t2d = head.t2d if isinstance(head, Eagle3Head) else torch.ones(head.config.vocab_size, dtype=torch.bool)
        self.register_buffer("in_vocab", t2d.clone(), persistent=False)
        self.register_buffer("draft_index", torch.cumsum(t2d.long(), 0) - 1, persistent=False)  # target -> draft id

    def forward(self, batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        head = self.head
        h0 = head.prepare([batch.of(l).float() for l in head.config.feature_layers])
        if self.noise and self.training:
            h0 = h0 + (torch.rand_like(h0) - 0.5) * (2 * self.noise)
        s = batch.tokens.shape[1]
        outs = head.unroll(lambda t: target.embed_tokens(t).float(), batch.tokens, h0, self.ttt_steps)
        trained = batch.loss_mask & self.in_vocab[batch.labels]  # [B, S]
        total = h0.new_zeros(())
        metrics: dict[str, float] = {}
        for j, out in enumerate(outs):
            shift = j + 1  # out^j_i predicts the feature (and the greedy label) of position i + j + 1
            mask = torch.zeros_like(trained)
            mask[:, : s - shift] = trained[:, shift:]
            n = mask.sum().clamp_min(1)
            labels = self.draft_index[batch.labels[:, shift:][mask[:, : s - shift]]]  # [M]
            picked = out[mask]  # [M, E]
            if self.ce_fraction < 1:
                sub = torch.rand(labels.shape[0], device=labels.device) < self.ce_fraction
                picked, labels = picked[sub], labels[sub]
            n_ce = torch.tensor(max(1, labels.shape[0]), device=labels.device)
            logits = head.draft_logits(picked, target)  # [M', Vd]
            ce = F.cross_entropy(logits, labels, reduction="sum") / n_ce
            step_loss = self.ce_weight * ce
            if isinstance(head, Eagle1Head):
                goal = batch.of(head.config.feature_layers[0])[:, shift:][mask[:, : s - shift]].float()
                reg = F.smooth_l1_loss(out[mask], goal, reduction="sum") / (n * out.shape[-1])
                step_loss = step_loss + reg
                metrics[f"reg{j}"] = float(reg.detach())
            total = total + (0.8 ** j) * step_loss
            metrics[f"ce{j}"] = float(ce.detach())
            metrics[f"acc{j}"] = float((logits.detach().argmax(-1) == labels).float().sum() / n_ce)
        return total, metrics


@dataclasses.dataclass(frozen=True)
class EagleTrainer:
    """The :class:`refspec.drafters.training.Trainer` of ``eagle`` and ``eagle3`` heads.

    Options: ``ttt_steps`` (default 1 for eagle, 3 for eagle3), ``noise`` (default 0.1 for
    eagle, 0 for eagle3), ``ce_weight`` (0.1 / 1.0), ``ce_fraction`` (0.25 / 1.0; see
    :class:`EagleTrainingModule`), ``draft_vocab_size`` (eagle3 only; default 8192, 0 keeps
    the whole vocabulary).
    """

    name: str
    description: str
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

    def option(self, options: dict[str, Any], key: str) -> Any:
        eagle1 = self.name == "eagle"
        base = {"ttt_steps": 1 if eagle1 else 3, "noise": 0.1 if eagle1 else 0.0,
                "ce_weight": 0.1 if eagle1 else 1.0, "ce_fraction": 0.25 if eagle1 else 1.0,
                "draft_vocab_size": 0 if eagle1 else 8192}
        unknown = set(options) - set(base)
        if unknown:
            raise DrafterError(f"unknown {self.name} training options {sorted(unknown)}; known: {sorted(base)}")
        return type(base[key])(options.get(key, base[key]))

    def feature_layers(self, target) -> tuple[int, ...]:
        return (target.num_layers,) if self.name == "eagle" else eagle3_layers(target.num_layers)

    def build(self, target, dataset, options: dict[str, Any]) -> nn.Module:
        vd = self.option(options, "draft_vocab_size")
        if self.name == "eagle" and vd:
            raise DrafterError("an eagle head drafts over the whole vocabulary; draft_vocab_size is for eagle3")
        hc = HeadConfig.for_target(self.name, target.args, draft_vocab_size=vd or None)
        head = new_head(hc)
        if isinstance(head, Eagle3Head):
            with torch.no_grad():
                if hc.draft_vocab_size < hc.vocab_size:  # the most frequent greedy labels, ascending ids
                    counts = dataset.token_counts(hc.vocab_size).double()
                    ranked = counts - torch.arange(hc.vocab_size, dtype=torch.double) * 1e-9  # ties: lower id
                    used = ranked.topk(hc.draft_vocab_size).indices.sort().values
                    head.set_vocab(used)
                    log.info("draft vocabulary: %d tokens cover %.1f%% of trained labels", hc.draft_vocab_size,
                             100 * float(counts[used].sum() / counts.sum().clamp_min(1)))
                ids = head.to_target_ids(torch.arange(hc.draft_vocab_size))
                head.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[ids])
                head.norm.weight.copy_(target.norm.weight.detach().float().cpu())
        head = head.float().to(target.device)
        return EagleTrainingModule(head, ttt_steps=self.option(options, "ttt_steps"),
                                   noise=self.option(options, "noise"), ce_weight=self.option(options, "ce_weight"),
                                   ce_fraction=self.option(options, "ce_fraction"))

    def loss(self, module: nn.Module, batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        return module(batch, target)

    def export(self, module: nn.Module, out_dir: Path, provenance: dict[str, Any]) -> Path:
        """Save the head with bfloat16 weights (half the bytes; the loader casts to the run's dtype,
        and losslessness never depends on the head's precision)."""
        return save_head(module.head, out_dir, provenance=provenance, dtype=torch.bfloat16)


def register_trainers(register) -> None:
    """Register the ``eagle`` and ``eagle3`` trainers with :mod:`refspec.drafters.training`."""
    register(EagleTrainer("eagle", "EAGLE-1/2 head: feature regression + greedy-label cross-entropy",
                          defaults={"lr": 1e-3, "batch_size": 4, "seq_len": 256, "warmup_steps": 30}))
    register(EagleTrainer("eagle3", "EAGLE-3 head: three fused layers, training-time test, reduced vocabulary",
                          defaults={"lr": 1e-3, "batch_size": 4, "seq_len": 256, "warmup_steps": 30}))
