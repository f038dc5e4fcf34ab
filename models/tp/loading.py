"""Load one tensor-parallel rank's share of a checkpoint straight from its safetensors files.

The model is built on the meta device and sharded there (:func:`refspec.models.tp.shard.shard_model`),
so its state dict names the rank's own shapes; each tensor is then read through safetensors'
``get_slice``, which reads only the rows or columns the rank keeps (a 70B checkpoint is never
materialised whole in any process). Names and strictness are :mod:`refspec.models.loading`'s.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

import torch

from refspec.config import ModelArgs
from refspec.models.loading import CheckpointError, assign_weights, read_checkpoint
from refspec.models.tp.group import TensorParallel
from refspec.models.tp.plan import ShardPlan, shard_plan
from refspec.models.tp.shard import shard_model
from refspec.models.transformer import Transformer

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.\d+\.(attn\.(wq|wk|wv|wo)|mlp\.(gate|up|down))\.(weight|bias)")


def shard_reader(name: str, plan: ShardPlan, head_dim: int) -> Callable[[Any], torch.Tensor] | None:
    """How rank ``plan.rank`` reads refspec parameter ``name`` from a safetensors slice: its rows
    (q/k/v, gate/up), its columns (wo, down), or None for a replicated tensor (read whole)."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    part = m.group(2) or m.group(3)
    d = head_dim
    rows = {"wq": (plan.q_heads[0] * d, plan.q_heads[1] * d), "wk": (plan.kv_heads[0] * d, plan.kv_heads[1] * d),
            "wv": (plan.kv_heads[0] * d, plan.kv_heads[1] * d), "gate": plan.mlp, "up": plan.mlp}
    if part in rows:
        lo, hi = rows[part]
        return lambda sl: sl[lo:hi]
    lo, hi = (plan.q_heads[0] * d, plan.q_heads[1] * d) if part == "wo" else plan.mlp
    return lambda sl: sl[:, lo:hi]


def load_sharded(path: str | Path, tp: TensorParallel, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Transformer:
    """Rank ``tp.rank``'s share of the model in ``path`` (frozen, all-reduces in; the reference
    products until ``refspec.models.prepare_target`` readies it for a run).

    Args:
        path: a Hugging Face style directory (``config.json``, safetensors).
        tp: this rank's group.
        dtype: parameter dtype.
        device: this rank's device.

    Raises:
        refspec.models.tp.plan.TPError: an MoE model, or heads ``tp.size`` ranks cannot share.
        CheckpointError: missing files, or keys that do not match the architecture.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a model directory")
    args = ModelArgs.from_file(path)
    plan = shard_plan(args, tp.size, tp.rank)  # a model the ranks cannot share fails before any read
    with torch.device("meta"):
        model = shard_model(Transformer(args), tp)
    expected = set(model.state_dict())  # the rank's shapes under split names (wq/wk/wv, gate/up)
    state = _read_shards(path, args, plan, expected, dtype, device)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - state.keys())
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors of a {args.family} model: "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    assign_weights(model, state, path, device)
    log.info("loaded rank %d of %d of %s (%s): heads %s, K/V heads %s, MLP columns %s", tp.rank, tp.size,
             args.family, dtype, plan.q_heads, plan.kv_heads, plan.mlp)
    return model


def _read_shards(path: Path, args: ModelArgs, plan: ShardPlan, expected: set[str], dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every tensor the rank keeps, read through ``get_slice`` (strict: unknown keys fail)."""
    state: dict[str, torch.Tensor] = {}

    def take(f: Any, key: str, name: str | None) -> bool:
        if name is None or name not in expected:
            return False
        read = shard_reader(name, plan, args.head_dim)
        t = f.get_tensor(key) if read is None else read(f.get_slice(key))
        state[name] = t.to(dtype=dtype, device=device)
        return True

    unexpected = read_checkpoint(path, args.family, take)
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has {len(unexpected)} keys a {args.family} model does not: "
                              f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return state


__all__ = ["load_sharded", "shard_reader"]
