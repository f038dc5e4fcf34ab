"""EAGLE heads and their checkpoints: the one-layer modules behind the ``eagle``/``eagle3`` drafters.

Two heads, one drafter (:mod:`refspec.drafters.eagle`); this module holds the EAGLE-1 head and
the checkpoints of both, :mod:`refspec.drafters.eagle3_head` the EAGLE-3 head and
:mod:`refspec.drafters.eagle_body` their configuration and shared body:

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

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from refspec.drafters.eagle3_head import Eagle3Head
from refspec.drafters.eagle_body import KINDS, EagleHead, HeadConfig, eagle3_layers  # noqa: F401  (re-exported)
from refspec.drafting import DrafterError
from refspec.models.layers import Linear

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class Eagle1Head(EagleHead):
    """EAGLE-1/2 head: ``fc(cat(embed, feature))`` then one decoder layer without input norm."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, cfg.hidden_size)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)

    def prepare(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return feats[0]

    def _step_matrices(self) -> list[nn.Linear]:
        return [self.fc] + super()._step_matrices()

    def lm_head_bytes(self, target) -> int | None:
        return target.multirow_matrix_bytes()  # the target's LM head, through its CPU copy if it keeps one

    def _attn_input(self, emb, h):
        x = self.fc(torch.cat([emb, h], dim=-1))
        return x, x

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        logits = target.lm_head(out.to(target.lm_head.weight.dtype)).float()  # refspec's CPU GEMM layouts
        cap = target.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


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
    if int(cfg.get("target_hidden_size") or e) != e:  # EAGLE-3 heads for a target of another width
        raise DrafterError(f"the head's target_hidden_size {cfg['target_hidden_size']} differs from its hidden size "
                           f"{e}; refspec loads heads as wide as their target")
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
        hidden_act="gelu_tanh" if "gelu" in act else "silu", fc_bias="fc.bias" in weights,
        norm_before_residual=kind == "eagle3" and bool(cfg.get("norm_before_residual", False)))


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
        cfg["norm_before_residual"] = hc.norm_before_residual
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [l + 1 for l in hc.feature_layers]}
    tmp = path / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / WEIGHTS)
    (path / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path
