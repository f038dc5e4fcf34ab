"""Published block drafters in the DFlash layout (z-lab/dflash), loaded as a :class:`BlockHead`.

A DFlash draft directory holds ``config.json`` and ``model.safetensors`` (no embedding and no
LM head: the target's are used):

* config: Qwen3 fields (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``,
  ``rope_theta`` or ``rope_parameters.rope_theta``, ``attention_bias``), ``block_size`` (the
  anchor included), ``num_target_layers`` and ``dflash_config`` with ``target_layer_ids`` and
  ``mask_token_id`` (either may also sit at top level);
* weights: ``fc.weight [E, F*E]``, ``hidden_norm.weight``, ``norm.weight`` and per layer i
  ``layers.i.input_layernorm.weight``, ``layers.i.post_attention_layernorm.weight``,
  ``layers.i.self_attn.{q,k,v,o}_proj.weight``, ``layers.i.self_attn.{q,k}_norm.weight``,
  ``layers.i.mlp.{gate,up,down}_proj.weight``.

The DFlash model is refspec's block head with three settings: every mask slot's input is the
target's embedding of ``mask_token_id`` (one shared embedding, no learned per-slot ones), no
input fusion, and Qwen3 decoder layers (q/k norms) whatever the target's family. A DFlash
``block_size`` of 16 is an anchor plus 15 masks, so K <= 15. Its ``target_layer_ids`` index
Hugging Face ``hidden_states[id + 1]``, the output of decoder layer ``id``: refspec's
numbering as is. Sliding-window draft layers and the DFlash-2 extensions (convolutions,
candidate selector) are refused with the keys that do not fit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from refspec.drafters.block_head import BlockHead, BlockHeadConfig
from refspec.drafting import DrafterError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"

# (published name, refspec name) inside one decoder layer
_LAYER = [
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "mlp_norm.weight"),
    ("self_attn.q_proj.weight", "attn.wq.weight"), ("self_attn.k_proj.weight", "attn.wk.weight"),
    ("self_attn.v_proj.weight", "attn.wv.weight"), ("self_attn.o_proj.weight", "attn.wo.weight"),
    ("self_attn.q_norm.weight", "attn.q_norm.weight"), ("self_attn.k_norm.weight", "attn.k_norm.weight"),
    ("mlp.gate_proj.weight", "mlp.gate.weight"), ("mlp.up_proj.weight", "mlp.up.weight"),
    ("mlp.down_proj.weight", "mlp.down.weight"),
]
_TOP = [("fc.weight", "fc.weight"), ("hidden_norm.weight", "ctx_norm.weight"), ("norm.weight", "norm.weight")]


def key_map(num_layers: int) -> dict[str, str]:
    """Published DFlash key -> :class:`BlockHead` state-dict key, for ``num_layers`` layers."""
    table = dict(_TOP)
    for i in range(num_layers):
        table.update({f"layers.{i}.{a}": f"layers.{i}.{b}" for a, b in _LAYER})
    return table


def is_dflash(folder: str | Path) -> bool:
    """Whether ``folder`` holds a DFlash draft (its config names DFlash), not a refspec head."""
    cfg_file = Path(folder) / CONFIG
    if not cfg_file.is_file():
        return False
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError:
        return False
    return "dflash_config" in cfg or any("DFlash" in a for a in cfg.get("architectures") or ())


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's target layers when a config names none: the middle layer for a one-layer
    draft, else ``num_draft_layers`` ids spread evenly over ``1 .. L - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _field(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def head_config(cfg: dict[str, Any], target_args) -> tuple[BlockHeadConfig, int]:
    """``(BlockHeadConfig, mask_token_id)`` of a DFlash ``config.json`` for a target of ``target_args``."""
    if int(cfg["hidden_size"]) != target_args.hidden_size:
        raise DrafterError(f"the DFlash draft has hidden size {cfg['hidden_size']} but the target has "
                           f"{target_args.hidden_size}: it was trained for another model")
    if cfg.get("attention_bias") or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        raise DrafterError("DFlash drafts with attention biases or sliding-window layers are not supported")
    if float(_field(cfg, "input_embedding_scale", 1.0)) != 1.0:
        raise DrafterError("DFlash drafts with an input_embedding_scale other than 1 are not supported")
    n = int(cfg["num_hidden_layers"])
    ids = _field(cfg, "target_layer_ids") or default_layer_ids(int(cfg.get("num_target_layers",
                                                                           target_args.num_layers)), n)
    mask = _field(cfg, "mask_token_id")
    if mask is None or not 0 <= int(mask) < target_args.vocab_size:
        raise DrafterError(f"the DFlash config's mask_token_id {mask!r} is not a token of the target "
                           f"(vocabulary {target_args.vocab_size})")
    if int(_field(cfg, "block_size", 0)) < 2:
        raise DrafterError("the DFlash config needs a block_size of at least 2 (anchor + one mask)")
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    scaling = scaling if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default" else None
    layer_args = {"family": "qwen3", "num_heads": heads, "num_kv_heads": int(cfg.get("num_key_value_heads", heads)),
                  "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                  "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "rope_theta": float(rope),
                  "rope_scaling": scaling, "qk_norm": True, "sandwich_norms": False, "norm_plus_one": False,
                  "attention_bias": False, "hidden_act": "silu", "query_pre_attn_scalar": None,
                  "attn_logit_softcapping": None}
    config = BlockHeadConfig(feature_layers=tuple(int(i) for i in ids), block_size=int(_field(cfg, "block_size")) - 1,
                             num_layers=n, intermediate_size=int(cfg["intermediate_size"]), input_fusion=False,
                             layer_args=layer_args)
    return config, int(mask)


def load_dflash(folder: str | Path, target, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> BlockHead:
    """A :class:`BlockHead` holding the DFlash draft in ``folder``, for ``target`` (whose
    embedding of the mask token becomes every mask slot's input).

    Raises:
        DrafterError: missing files, a config this head cannot express, missing or unexpected
            keys, or shapes that do not match.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise DrafterError(f"{folder} is not a DFlash draft directory (needs {CONFIG} and {WEIGHTS})")
    config, mask_id = head_config(json.loads((folder / CONFIG).read_text()), target.args)
    head = BlockHead(target.args, config)
    table = key_map(config.num_layers)
    weights = load_file(str(folder / WEIGHTS))
    unexpected = sorted(k for k in weights if k not in table)
    missing = sorted(k for k in table if k not in weights)
    if missing or unexpected:
        raise DrafterError(f"{folder} does not match the DFlash layout: missing {missing[:6]}, "
                           f"unexpected {unexpected[:6]}")
    want = head.state_dict()
    state = {table[k]: v for k, v in weights.items()}
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            raise DrafterError(f"{folder}: {name} has shape {tuple(tensor.shape)}, expected {tuple(want[name].shape)}")
    with torch.no_grad():
        mask_row = target.embed.weight[mask_id].detach().float().cpu()
        state["mask_embed"] = mask_row.expand(config.block_size, -1).clone()
    head.load_state_dict(state, strict=True)
    head.provenance = {"source": f"DFlash checkpoint {folder}", "mask_token_id": mask_id}
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
