"""EAGLE heads and their checkpoints: the one-layer modules behind the ``eagle``/``eagle3`` drafters.

Two heads, one drafter (:mod:`refspec.drafters.eagle`):

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

Shapes: B batch, S query length, T cache length, E model dim, V target vocab, Vd draft vocab.
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
from torch import nn

from refspec.cache import StaticKVCache
from refspec.drafting import DrafterError
from refspec.models.layers import MLP, Linear, RMSNorm
from refspec.models.ops import apply_rope, attend, attention_bias, rope_inv_freq, rope_tables

log = logging.getLogger(__name__)

KINDS = ("eagle", "eagle3")
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


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

    # -- shared body ------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.mlp.gate_up.weight.dtype

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


class Eagle1Head(EagleHead):
    """EAGLE-1/2 head: ``fc(cat(embed, feature))`` then one decoder layer without input norm."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, cfg.hidden_size)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)

    def prepare(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return feats[0]

    def _attn_input(self, emb, h):
        x = self.fc(torch.cat([emb, h], dim=-1))
        return x, x

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        logits = target.lm_head(out.to(target.lm_head.weight.dtype)).float()  # refspec's CPU GEMM layouts
        cap = target.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


class Eagle3Head(EagleHead):
    """EAGLE-3 head: ``fc`` fuses three target layers; attention reads ``[norm(embed), norm(h)]``;
    own final norm and LM head over the draft vocabulary."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, 2 * cfg.hidden_size)
        e = cfg.hidden_size
        self.fc = Linear(3 * e, e, bias=cfg.fc_bias)
        self.input_norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.hidden_norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.lm_head = Linear(e, cfg.draft_vocab_size, bias=False)
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

