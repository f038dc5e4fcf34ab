"""Load Hugging Face style checkpoints (config.json + safetensors) into refspec models.

The mapping from Hugging Face weight names to refspec's is one declarative table per family;
loading is strict: any missing or unexpected key is listed in the error.
"""
from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from refspec.config import ModelArgs
from refspec.models.transformer import Transformer

log = logging.getLogger(__name__)

# (Hugging Face name, refspec name); ``{i}`` is a layer index, ``{wb}`` weight or bias.
_COMMON = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.layers.{i}.self_attn.q_proj.{wb}", "layers.{i}.attn.wq.{wb}"),
    ("model.layers.{i}.self_attn.k_proj.{wb}", "layers.{i}.attn.wk.{wb}"),
    ("model.layers.{i}.self_attn.v_proj.{wb}", "layers.{i}.attn.wv.{wb}"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.wo.weight"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attn.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attn.k_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight"),
]
_PLAIN_MLP_NORM = [("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight")]
# Routed experts as checkpoints on disk store them: one matrix per expert ({j}), under the
# family's module name. ``_FUSED`` lists transformers 5's in-memory 3-D form, also accepted.
_QWEN3_MOE = [
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", "layers.{i}.mlp.experts.{j}.gate.weight"),
    ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", "layers.{i}.mlp.experts.{j}.up.weight"),
    ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", "layers.{i}.mlp.experts.{j}.down.weight"),
]
_MIXTRAL = [
    ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.router.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", "layers.{i}.mlp.experts.{j}.gate.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", "layers.{i}.mlp.experts.{j}.up.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", "layers.{i}.mlp.experts.{j}.down.weight"),
]
_FUSED = [  # (HF name, refspec split names of one expert, split along dim 0 of the expert's matrix)
    ("model.layers.{i}.mlp.experts.gate_up_proj", ("layers.{i}.mlp.experts.{j}.gate.weight",
                                                   "layers.{i}.mlp.experts.{j}.up.weight")),
    ("model.layers.{i}.mlp.experts.down_proj", ("layers.{i}.mlp.experts.{j}.down.weight",)),
]
_SHARED_EXPERT = [
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "layers.{i}.mlp.shared_expert.gate.weight"),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "layers.{i}.mlp.shared_expert.up.weight"),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "layers.{i}.mlp.shared_expert.down.weight"),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.weight"),
]
_FUSED_ENDS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
KEY_MAP: dict[str, list[tuple[str, str]]] = {
    "qwen3_moe": _COMMON + _PLAIN_MLP_NORM + _QWEN3_MOE,
    "qwen2_moe": _COMMON + _PLAIN_MLP_NORM + _QWEN3_MOE + _SHARED_EXPERT,
    "mixtral": _COMMON + _PLAIN_MLP_NORM + _MIXTRAL + [
        ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight")],  # transformers 5's name
    "llama": _COMMON + _PLAIN_MLP_NORM,
    "qwen2": _COMMON + _PLAIN_MLP_NORM,
    "qwen3": _COMMON + _PLAIN_MLP_NORM,
    "gemma3": _COMMON + [
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.attn_post_norm.weight"),
        ("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.{i}.mlp_norm.weight"),
        ("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.mlp_post_norm.weight"),
    ],
}
# Keys some exporters include that carry no weights refspec needs.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# Multimodal wrappers prefix the text model; refspec loads the language model only.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the architecture it claims."""


@functools.lru_cache(maxsize=None)
def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)").replace(r"\{wb\}", r"(?P<wb>weight|bias)")
    return re.compile(pattern)


def _split_fused(family: str, hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A transformers 5 fused expert tensor ``[X, rows, cols]`` as refspec's per-expert names
    (gate_up rows split in half, gate first), or None when ``hf_name`` is not one."""
    if family not in ("qwen3_moe", "mixtral", "qwen2_moe"):
        return None
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = "model." + hf_name[len(prefix):]
            break
    for template, parts in _FUSED:
        m = _template_regex(template).fullmatch(hf_name)
        if m:
            out = {}
            for j, expert in enumerate(tensor.unbind(0)):
                for part, piece in zip(parts, expert.chunk(len(parts))):
                    out[part.format(i=m["i"], j=j)] = piece
            return out
    return None


def _translate(name: str, family: str, src: int) -> str | None:
    for pair in KEY_MAP[family]:
        m = _template_regex(pair[src]).fullmatch(name)
        if m:
            return pair[1 - src].format(**m.groupdict())
    return None


def hf_to_refspec_name(family: str, hf_name: str) -> str | None:
    """refspec's parameter name for a Hugging Face weight name, or None if unmapped."""
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            rest = hf_name[len(prefix):]
            hf_name = rest if rest.startswith("lm_head.") else "model." + rest
            break
    return _translate(hf_name, family, 0)


def refspec_to_hf_name(family: str, name: str) -> str:
    """Inverse of :func:`hf_to_refspec_name` (used by the converter and tests)."""
    hf = _translate(name, family, 1)
    if hf is None:
        raise KeyError(f"no Hugging Face name for {name!r}")
    return hf


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map' object "
                                  f"({type(exc).__name__}: {exc}); download the checkpoint again") from None
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{path} holds no safetensors weights (model.safetensors or an index)")
    return found


def read_checkpoint(path: Path, family: str, take: Callable[[Any, str, str | None], bool],
                    after_file: Callable[[], None] | None = None) -> list[str]:
    """Call ``take(f, key, refspec_name)`` for every tensor of a checkpoint directory; ``take``
    returns False for a key the model does not have. Returns those keys (benign ones left out)."""
    unexpected: list[str] = []
    for file in _safetensor_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if not take(f, key, hf_to_refspec_name(family, key)) and not _IGNORED.match(key):
                        unexpected.append(key)
        except (SafetensorError, OSError) as exc:  # truncated, garbage or unreadable: the user's file, not a bug
            raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); it may be truncated or "
                                  f"corrupt: download or convert it again") from None
        if after_file is not None:
            after_file()
    return unexpected


def load_state_dict(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint directory under refspec names, strictly."""
    expected = set(Transformer_param_names(args))
    state: dict[str, torch.Tensor] = {}
    fused_unexpected: list[str] = []

    def take(f: Any, key: str, name: str | None) -> bool:
        fused = _split_fused(args.family, key, f.get_tensor(key)) if key.endswith(_FUSED_ENDS) else None
        if fused is not None:  # transformers 5's 3-D expert tensor: one entry per expert
            state.update({n: t.to(dtype=dtype, device=device) for n, t in fused.items() if n in expected})
            fused_unexpected.extend(n for n in fused if n not in expected)
            return True
        if name is None or name not in expected:
            return False
        state[name] = f.get_tensor(key).to(dtype=dtype, device=device)
        return True

    # fused after each shard: per-expert copies never pile up
    unexpected = read_checkpoint(path, args.family, take, lambda: _fuse_experts(state, expected, args))
    unexpected += fused_unexpected
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - state.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match a {args.family} model with {args.num_layers} layers: "
            f"missing {len(missing)} keys {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"unexpected {len(unexpected)} keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return state


def _fuse_experts(state: dict[str, torch.Tensor], expected: set[str], args: ModelArgs) -> None:
    """Stack every MoE layer whose per-expert matrices are all read into refspec's fused
    ``experts_gate_up [X, 2I, E]`` / ``experts_down [X, E, I]``, in place, and put the fused
    names in ``expected`` instead (a layer still incomplete keeps its per-expert names)."""
    for i in range(args.num_layers):
        if not args.is_moe_layer(i):
            continue
        for fused, parts in (("experts_gate_up", ("gate", "up")), ("experts_down", ("down",))):
            rows = [[f"layers.{i}.mlp.experts.{j}.{p}.weight" for p in parts] for j in range(args.num_experts)]
            names = [n for row in rows for n in row]
            if all(n in state for n in names):
                state[f"layers.{i}.mlp.{fused}"] = torch.stack([torch.cat([state.pop(n) for n in row]) for row in rows])
                expected.difference_update(names)
                expected.add(f"layers.{i}.mlp.{fused}")


def Transformer_param_names(args: ModelArgs) -> list[str]:  # noqa: N802 - mirrors the class it describes
    """Parameter names a full :class:`Transformer` of ``args`` has (lm_head listed even if tied)."""
    with torch.device("meta"):
        model = Transformer(args)
    return list(model.state_dict())  # split names (wq/wk/wv, gate/up); the tied lm_head listed too


def assign_weights(model: Transformer, state: dict[str, torch.Tensor], path: Path, device: torch.device | str) -> None:
    """Put ``state`` into the meta-device ``model`` (tying the LM head where the config ties it),
    make its rotary tables on ``device`` and freeze it.

    Raises:
        CheckpointError: a tensor whose shape does not match the model's.
    """
    tied = model.args.tie_word_embeddings
    try:
        model.load_state_dict(state, strict=not tied, assign=True)
    except RuntimeError as exc:  # torch lists every mismatched tensor on its own line
        detail = [ln.strip() for ln in str(exc).split("\n") if "size mismatch" in ln]
        raise CheckpointError(f"checkpoint {path} does not match its config.json: {len(detail)} tensor(s) of the "
                              f"wrong shape, first: {detail[0] if detail else str(exc).strip()[:200]}") from None
    if tied:
        model.lm_head.weight = model.embed.weight
    model.init_buffers(device)
    model.eval().requires_grad_(False)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Transformer:
    """Build a :class:`Transformer` from a Hugging Face style directory.

    The model comes back frozen (its q/k/v and gate/up projections are fused matrices, see
    :class:`~refspec.models.layers.Attention`) and as the reference: ``F.linear`` products, no
    weight copies. ``refspec.models.prepare_target`` readies it for a run (on a CPU, the GEMM
    forms timed on this machine).

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
        dtype: parameter dtype (float32, bfloat16, float16).
        device: where the weights go.

    Raises:
        CheckpointError: missing files, or keys that do not match the architecture.
        refspec.config.ConfigError: an unsupported or malformed config.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a model directory")
    args = ModelArgs.from_file(path)
    state = load_state_dict(path, args, dtype, device)
    with torch.device("meta"):
        model = Transformer(args)
    assign_weights(model, state, path, device)
    log.info("loaded %s (%s, %d layers) from %s", args.family, dtype, args.num_layers, path)
    return model


def save_model(model: Transformer, path: str | Path, extra_config: dict | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` with Hugging Face names."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.args.to_hf_config() | (extra_config or {})
    tensors = {}
    for name, p in model.state_dict().items():
        if model.args.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensors[refspec_to_hf_name(model.args.family, name)] = p.detach().contiguous().cpu()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
