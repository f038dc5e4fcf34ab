"""Decoder modules: the parameter holders (:class:`Linear`, :class:`RMSNorm`,
:class:`Attention`, :class:`MLP`) and :class:`Block`, whose forward runs one decoder block over
a step plan gathered from them (see :meth:`Block.forward`). The tensor functions they call
live in :mod:`refspec.models.ops`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from refspec.cache import StaticKVCache
from refspec.config import ModelArgs
from refspec.models.moe import MoE
from refspec.models.ops import WeightCopy, apply_rope, attend, gated_mlp, linear, rms_norm


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` that multiplies through :func:`linear`."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        self._copy: WeightCopy | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._copy)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with its weight."""

    def __init__(self, dim: int, eps: float, plus_one: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.plus_one)


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
    gate_up: torch.Tensor | None  # None in an MoE block
    gate_up_copy: WeightCopy | None
    down: torch.Tensor | None
    down_copy: WeightCopy | None
    moe: MoE | None  # the routed MLP of an MoE block (called as a module)


class Block(nn.Module):
    """One decoder block: attention and gated MLP (or a routed :class:`~refspec.models.moe.MoE`),
    each behind an RMSNorm with a residual add (gemma3 also norms each branch's output)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        eps, p1 = args.rms_norm_eps, args.norm_plus_one
        self.attn = Attention(args, layer)
        self.mlp = MoE(args) if args.is_moe_layer(layer) else MLP(args)
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
        moe = mlp if isinstance(mlp, MoE) else None
        gate_up, _, gate_up_copy = (None, None, None) if moe is not None else lin(sub(mlp, "gate_up"))
        down, _, down_copy = (None, None, None) if moe is not None else lin(sub(mlp, "down"))
        norms = {name: norm(sub(owner, name)) for owner, name in
                 ((self, "attn_norm"), (self, "mlp_norm"), (attn, "q_norm"), (attn, "k_norm"))}
        post = [norm(sub(self, name)) if self.sandwich else None for name in ("attn_post_norm", "mlp_post_norm")]
        plan = _StepPlan(
            guards=tuple(guards), layer=attn.layer, h=attn.h, hkv=attn.hkv, d=attn.d, scale=attn.scale,
            gelu=getattr(mlp, "gelu", False), **norms, attn_post_norm=post[0], mlp_post_norm=post[1],
            wqkv=wqkv, bqkv=bqkv, qkv_copy=qkv_copy, wo=wo, wo_copy=wo_copy,
            gate_up=gate_up, gate_up_copy=gate_up_copy, down=down, down_copy=down_copy,
            moe=moe)
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
        h = rms_norm(x, *p.mlp_norm)
        m = p.moe(h) if p.moe is not None else gated_mlp(h, p.gate_up, p.gate_up_copy, p.down, p.down_copy, p.gelu)
        x = x + (m if p.mlp_post_norm is None else rms_norm(m, *p.mlp_post_norm))
        return x.view(shape)
