"""Tensor parallelism applied to a built :class:`~refspec.models.transformer.Transformer`
(Megatron's layout, as gpt-fast's ``tp.py`` applies it): the model files stay the textbook.

Each of N ranks keeps a share of every block (which share: :mod:`refspec.models.tp.plan`):

- **attention**: whole key/value groups, or a share of one replicated K/V head's queries. The
  fused ``wqkv`` keeps its q, k and v rows of those heads (column-parallel, sliced part by
  part); ``wo`` keeps the matching input columns (row-parallel) and one all-reduce sums the
  ranks' partial outputs.
- **MLP**: ``gate_up`` keeps a slice of the gate rows and the same slice of the up rows
  (column-parallel), ``down`` the matching input columns (row-parallel, one all-reduce).
- **embedding, norms, LM head**: replicated, as gpt-fast keeps them: every rank then computes
  the same logits, so sampling and drafting need no collective (the LM head costs every GPU
  one V x E read per forward; the roofline counts it).

After the all-reduce every rank holds the same residual stream, so all ranks compute the same
tokens. Each rank's cache holds its own K/V heads (``Transformer.heads``), and its forwards
report :func:`~refspec.models.tp.plan.rank_args`, the architecture of its share, as their work.
Mixture-of-experts models are refused (:class:`~refspec.models.tp.plan.TPError`).
"""
from __future__ import annotations

import torch
from torch import nn

from refspec.models.layers import Linear
from refspec.models.transformer import Transformer
from refspec.models.tp.group import TensorParallel, all_reduce_
from refspec.models.tp.plan import ShardPlan, TPError, check_shardable, rank_args


def _all_reduce_hook(tp: TensorParallel):
    """A forward hook summing a row-parallel layer's partial output over the ranks."""

    def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        return all_reduce_(out.contiguous(), tp)  # collectives take contiguous tensors

    return hook


def row_parallel(lin: Linear, weight: torch.Tensor, tp: TensorParallel) -> Linear:
    """``lin`` holding ``weight [out, in / N]``, its input features' share, with a forward hook
    that all-reduces its output (Megatron's row-parallel layer; ``wo`` and ``down`` have no
    bias). A hook on the layer the block calls: the model's forward stays the one forward."""
    assert lin.bias is None, "a row-parallel bias would be added N times"
    out = _linear(weight, None, lin)
    out.register_forward_hook(_all_reduce_hook(tp))
    return out


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: Linear) -> Linear:
    """A new :class:`~refspec.models.layers.Linear` holding ``weight [out, in]`` and ``bias`` as
    they are (no copy, no GEMM choice: the CPU plan is given after sharding)."""
    out_f, in_f = weight.shape
    lin = Linear(in_f, out_f, bias=bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = nn.Parameter(weight, requires_grad=like.weight.requires_grad)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=like.weight.requires_grad)
    return lin


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t[lo:hi]


def _shard_attention(attn: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    d, h, hkv = attn.d, attn.h, attn.hkv
    (qlo, qhi), (klo, khi) = plan.q_heads, plan.kv_heads

    def qkv(t: torch.Tensor) -> torch.Tensor:  # [(H + 2 Hkv) D, ...] -> this rank's q, k, v rows
        q, k, v = t.split((h * d, hkv * d, hkv * d))
        return torch.cat([_rows(q, qlo * d, qhi * d), _rows(k, klo * d, khi * d), _rows(v, klo * d, khi * d)])

    old = attn.wqkv
    attn.wqkv = _linear(qkv(old.weight.detach()), None if old.bias is None else qkv(old.bias.detach()), old)
    wo = attn.wo.weight.detach()[:, qlo * d:qhi * d].clone(memory_format=torch.contiguous_format)  # [E, H/N D]
    attn.wo = row_parallel(attn.wo, wo, tp)
    attn.h, attn.hkv = plan.num_heads, plan.num_kv_heads


def _shard_mlp(mlp: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    lo, hi = plan.mlp
    gate, up = mlp.gate_up.weight.detach().chunk(2)  # [I, E] each
    mlp.gate_up = _linear(torch.cat([gate[lo:hi], up[lo:hi]]), None, mlp.gate_up)
    down = mlp.down.weight.detach()[:, lo:hi].clone(memory_format=torch.contiguous_format)  # [E, I/N]
    mlp.down = row_parallel(mlp.down, down, tp)
    mlp.intermediate = plan.intermediate


def shard_model(model: Transformer, tp: TensorParallel) -> Transformer:
    """Keep rank ``tp.rank``'s share of every block of ``model`` (in place; real or meta
    weights) and insert the all-reduces; returns the model. A model that already holds this
    rank's share (:func:`refspec.models.tp.loading.load_sharded`) is returned as it is.

    Raises:
        TPError: an MoE model, heads ``tp.size`` ranks cannot share, or a truncated model.
    """
    args = model.args
    plan = check_shardable(args, tp.size)[tp.rank]
    share = rank_args(args, plan)
    if model.work_args == share:
        return model
    if len(model.layers) != args.num_layers:
        raise TPError("shard the whole model, then truncate it (a self-draft shares the shard)")
    for blk in model.layers:
        _shard_attention(blk.attn, plan, tp)
        _shard_mlp(blk.mlp, plan, tp)
    model.work_args = share
    return model


__all__ = ["row_parallel", "shard_model"]
