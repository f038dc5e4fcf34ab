"""CPU speed-ups applied to a built model from outside, as torchtitan's ``parallelize.py``
applies parallelism: the model files stay the textbook and know nothing of this module.

:func:`apply_cpu_speed` is the one entry point (``load_model`` calls it for CPU models):

1. **GEMM plan**: the product form per dtype and row count timed on this machine
   (:mod:`refspec.models.calibration`) becomes the active plan, which every
   :class:`PlannedLinear` follows (:func:`linear`).
2. **Linears**: the model's ``nn.Linear`` modules become :class:`PlannedLinear` (their class is
   swapped in place, as ``torch.nn.utils.parametrize`` does: same parameters, names and state
   dict). The block matrices and the LM head also keep a :class:`WeightCopy` in the layout or
   dtype the plan's forms read, when the copies fit the memory limit.
3. **Blocks**: each decoder block becomes a :class:`PlannedBlock`, whose forward computes
   exactly the reference block (:meth:`refspec.models.layers.Block.forward`) on its
   sub-modules' tensors without calling them: on a CPU each module call costs microseconds,
   hundreds of times per decode step. Hooks on a block's sub-modules would not fire, so a block
   whose sub-modules carry hooks (a tensor-parallel all-reduce) keeps the reference forward.

:func:`remove_cpu_speed` swaps every class back.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from refspec.models.calibration import REFERENCE, GemmPlan, resolve_plan
from refspec.models.gemm_forms import COPY_FORMS, make_copy, packed_product, without_onednn
from refspec.models.layers import Block
from refspec.models.moe import MoE
from refspec.models.ops import apply_rope, gated_act, rms_norm

log = logging.getLogger(__name__)


class WeightCopy:
    """A copy of a weight in the layout or dtype a CPU GEMM form needs.

    Three kinds: ``column``, a column-major ``[in, out]`` copy in the weight's dtype; ``fp32``,
    an fp32 ``[out, in]`` copy of a bf16/fp16 weight whose product is rounded back to the
    model's dtype (as a half-precision kernel rounds its fp32 accumulator: only the summation
    order differs); ``packed``, the weight reordered once into oneDNN's blocked layout.

    The copy is used only while the weight is the very tensor it was made from, unmodified
    (same storage, same version counter), and no gradient to it is being recorded; otherwise
    :func:`linear` falls back to the weight.
    """

    __slots__ = ("ptr", "version", "t", "kind")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:  # noqa: D107
        if weight.is_inference():
            raise ValueError("an inference-mode tensor has no version counter to guard a copy with")
        if kind not in COPY_FORMS:
            raise ValueError(f"kind must be one of {COPY_FORMS}, got {kind!r}")
        self.ptr, self.version, self.kind = weight.data_ptr(), weight._version, kind
        self.t = make_copy(kind, weight)

    def of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy if ``weight`` is unchanged since it was made, else None (also while
        gradients to ``weight`` are being recorded: the copy is detached). While compiling, the
        copy: a :class:`~refspec.models.compiled.CompiledStep` checks every copy before each call,
        and pointers and version counters cannot be traced."""
        if torch.compiler.is_compiling():
            return self.t
        if weight.data_ptr() != self.ptr or weight.is_inference():
            return None
        if weight.requires_grad and torch.is_grad_enabled():
            return None
        return self.t if weight._version == self.version else None


_plan: GemmPlan = REFERENCE


def use_gemm_plan(plan: GemmPlan) -> None:
    """Make ``plan`` the forms every CPU :func:`linear` takes (one machine, one plan)."""
    global _plan
    _plan = plan


def gemm_plan() -> GemmPlan:
    """The plan :func:`linear` follows now."""
    return _plan


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           copy: WeightCopy | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in the GEMM form the active plan chose for this dtype and row
    count on CPUs (``F.linear`` elsewhere, and where a form's copy is missing or stale).

    The result may be a column-major view; later ops accept it as is.
    """
    if x.dim() != 2:
        lead = x.shape[:-1]
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, copy).view(*lead, weight.shape[0])
    form = _plan.form(x.dtype, x.shape[0]) if x.is_cpu else "linear"
    if form == "wxt":
        # (W @ x^T)^T with a row-major x: a column-major x sends some BLAS down a slow path
        xt = x.contiguous().t()
        return (torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)).t()
    if form == "nodnn":
        # ATen's own half-precision kernels: on some CPUs oneDNN's one-row products run at half their speed
        return F.linear(x, weight, bias) if torch.compiler.is_compiling() else without_onednn(F.linear, x, weight, bias)
    if form == "packed" and (torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled())):
        # oneDNN's packed product has no backward, and a graph cannot take its opaque layout
        return F.linear(x, weight, bias)
    c = copy.of(weight) if form != "linear" and copy is not None and copy.kind == form else None
    if c is None:
        return F.linear(x, weight, bias)
    if form == "packed":
        return packed_product(x, c, bias)
    if form == "column":
        return torch.mm(x, c) if bias is None else torch.addmm(bias, x, c)
    xt = x.to(torch.float32, memory_format=torch.contiguous_format).t()  # fp32 copy: one fp32 GEMM, rounded back
    out = torch.mm(c, xt) if bias is None else torch.addmm(bias.float()[:, None], c, xt)
    return out.t().to(x.dtype)


class PlannedLinear(nn.Linear):
    """``nn.Linear`` whose product takes the active plan's form, through its :class:`WeightCopy`
    when it keeps one (made by swapping the class of a built ``nn.Linear``)."""

    copy: WeightCopy | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.copy)

    def multirow_element_bytes(self, rows: int | None = None) -> int | None:
        """4 where products of 2 or more rows (of ``rows`` rows, when given) multiply this
        half-precision weight through its fp32 copy, else None (what
        :meth:`refspec.models.Transformer.multirow_matrix_bytes` reports)."""
        c = self.copy
        if c is None or c.kind != "fp32" or c.of(self.weight) is None:
            return None
        return 4 if rows is None or _plan.form(self.weight.dtype, rows) == "fp32" else None


def _lin(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    p = mod._parameters
    return linear(x, p["weight"], p["bias"], mod.__dict__.get("copy"))


def _norm(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, mod._parameters["weight"], mod.eps, mod.plus_one)


class PlannedBlock(Block):
    """:class:`~refspec.models.layers.Block` computed on its sub-modules' tensors (no module calls,
    2-D ``[B*S, E]`` rows for every product, q and k rotated in one op where no q/k norm
    separates them); equal to the reference forward."""

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        m = self._modules
        attn, mlp = m["attn"], m["mlp"]
        am = attn._modules
        shape, (b, s) = x.shape, x.shape[:2]
        h, hkv = attn.h, attn.hkv
        x = x.reshape(b * s, shape[-1])  # [B*S, E]
        qkv = _lin(am["wqkv"], _norm(m["attn_norm"], x)).view(b, s, h + 2 * hkv, attn.d)
        cos, sin = ctx.rope[attn.sliding]
        if am.get("q_norm") is None:
            qk, v = qkv.split_with_sizes((h + hkv, hkv), dim=2)
            q, k = apply_rope(qk, cos, sin).split_with_sizes((h, hkv), dim=2)
        else:
            q, k, v = qkv.split_with_sizes((h, hkv, hkv), dim=2)
            q, k = apply_rope(_norm(am["q_norm"], q), cos, sin), apply_rope(_norm(am["k_norm"], k), cos, sin)
        a = _lin(am["wo"], ctx(attn.layer, attn.sliding, q, k, v, attn.scale).view(b * s, -1))
        x = x + (_norm(m["attn_post_norm"], a) if self.sandwich else a)
        y = _norm(m["mlp_norm"], x)
        if isinstance(mlp, MoE):
            y = mlp(y)
        else:
            gate, up = _lin(mlp._modules["gate_up"], y).chunk(2, dim=-1)
            y = _lin(mlp._modules["down"], gated_act(gate, up, mlp.gelu))
        x = x + (_norm(m["mlp_post_norm"], y) if self.sandwich else y)
        return x.view(shape)


def copied_linears(model: nn.Module) -> list[nn.Linear]:
    """The matrices a model's weight copies are made of: every block's q/k/v, output, gate/up
    and down projections and the LM head (MoE experts stay uncopied)."""
    out = [model.lm_head]
    for blk in model.layers:
        out += [blk.attn.wqkv, blk.attn.wo]
        if not isinstance(blk.mlp, MoE):
            out += [blk.mlp.gate_up, blk.mlp.down]
    return out


def weight_copy_bytes(model: nn.Module, kind: str = "fp32") -> int:
    """Memory the copies of ``kind`` of :func:`copied_linears` take."""
    elem = 4 if kind == "fp32" else model.lm_head.weight.element_size()
    return elem * sum(lin.weight.numel() for lin in copied_linears(model))


def weight_copy_kind(model: nn.Module) -> str | None:
    """The kind of copy the model's matrices are multiplied through (``column``, ``fp32``,
    ``packed``), or None; read from the LM head's copy while it is in use."""
    copy = model.lm_head.__dict__.get("copy")
    return copy.kind if copy is not None and copy.of(model.lm_head.weight) is not None else None


def _hooked(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def apply_cpu_speed(model: nn.Module, plan: GemmPlan | None = None) -> str | None:
    """Install the CPU speed-ups on a built model (see the module docstring).

    Args:
        model: a ``refspec.models.Transformer`` on the CPU, or any module (a drafter head):
            its Linears and blocks are swapped, and only a model with ``layers`` and an
            ``lm_head`` keeps weight copies.
        plan: the GEMM plan (default: :func:`~refspec.models.calibration.resolve_plan` for the
            model's dtype). The copies take at most ``REFSPEC_CPU_WEIGHT_COPIES_GIB`` (default
            2) GiB; beyond that the plan falls back to its fastest copy-free forms.

    Returns:
        The kind of weight copy kept, or None.
    """
    dtype = next(model.parameters()).dtype
    plan = plan if plan is not None else resolve_plan(dtype)
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = PlannedLinear
        elif type(mod) is Block and not _hooked(mod):
            mod.__class__ = PlannedBlock
    kind = None
    if hasattr(model, "layers") and hasattr(model, "lm_head"):
        kind = _add_weight_copies(model, plan.copy_kind(dtype))
        if plan.copy_kind(dtype) and not kind:
            plan = plan.without_copies(dtype)
    use_gemm_plan(plan)
    log.info("CPU GEMM plan: %s; weight copies: %s", plan.describe() or "reference (F.linear)", kind or "none")
    return kind


def _add_weight_copies(model: nn.Module, kind: str | None) -> str | None:
    """Keep a :class:`WeightCopy` of ``kind`` of every :func:`copied_linears` matrix, when they
    fit ``REFSPEC_CPU_WEIGHT_COPIES_GIB``; returns the kind made, or None."""
    lins = copied_linears(model)
    limit = int(float(os.environ.get("REFSPEC_CPU_WEIGHT_COPIES_GIB", "2")) * 2**30)
    if kind is None or any(lin.weight.is_inference() for lin in lins):
        return None  # nothing to copy, or weights made under inference_mode (no version counter)
    if weight_copy_bytes(model, kind) > limit:
        if limit > 0:
            log.info("no %s weight copies: they would take %.1f GiB, above REFSPEC_CPU_WEIGHT_COPIES_GIB=%g; "
                     "the products take the fastest copy-free forms measured", kind,
                     weight_copy_bytes(model, kind) / 2**30, limit / 2**30)
        return None
    for lin in lins:
        assert isinstance(lin, PlannedLinear), "Linears are planned before copies are kept"
        lin.copy = WeightCopy(lin.weight, kind)
    return kind


def remove_cpu_speed(model: nn.Module) -> None:
    """Undo :func:`apply_cpu_speed`: reference classes, no copies (the active plan stays)."""
    for mod in model.modules():
        if type(mod) is PlannedLinear:
            mod.__dict__.pop("copy", None)
            mod.__class__ = nn.Linear
        elif type(mod) is PlannedBlock:
            mod.__class__ = Block


__all__ = ["apply_cpu_speed", "remove_cpu_speed", "PlannedLinear", "PlannedBlock", "WeightCopy", "linear",
           "use_gemm_plan", "gemm_plan", "copied_linears", "weight_copy_bytes", "weight_copy_kind"]
