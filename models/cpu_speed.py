"""The CPU GEMM plan applied to a built model from outside, as torchtitan's ``parallelize.py``
applies parallelism: the model's forward stays the one in :mod:`refspec.models.layers`.

:func:`plan_gemms` gives every :class:`~refspec.models.layers.Linear` of a model its
:class:`~refspec.models.gemm_forms.GemmChoice`: the forms the plan (timed on this machine,
:mod:`refspec.models.calibration`) chose for the model's dtype per row count, and for the block
matrices and the LM head a :class:`~refspec.models.gemm_forms.WeightCopy` in the layout or dtype
those forms read, when the copies fit the memory limit. The choice is module state, read by the
layer's own forward; each model carries its own (two models of a process may follow two plans).
``refspec.models.prepare_target`` calls it for a CPU run.
"""
from __future__ import annotations

import logging
import os

from torch import nn

from refspec.models.calibration import GemmPlan
from refspec.models.gemm_forms import GemmChoice, WeightCopy
from refspec.models.layers import Linear
from refspec.models.moe import MoE

log = logging.getLogger(__name__)


def copied_linears(model: nn.Module) -> list[Linear]:
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
    gemm = model.lm_head.gemm
    copy = None if gemm is None else gemm.copy
    return copy.kind if copy is not None and copy.of(model.lm_head.weight) is not None else None


def gemm_form(model: nn.Module, rows: int) -> str:
    """The form the model's products of ``rows`` rows take (``linear`` when it follows no plan)."""
    gemm = model.lm_head.gemm
    return "linear" if gemm is None else gemm.form(rows)


def plan_gemms(model: nn.Module, plan: GemmPlan) -> GemmPlan:
    """Give every :class:`~refspec.models.layers.Linear` of ``model`` its GEMM choice under ``plan``
    (in place; see the module docstring).

    Args:
        model: a ``refspec.models.Transformer`` on the CPU. The copies take at most
            ``REFSPEC_CPU_WEIGHT_COPIES_GIB`` (default 2) GiB; beyond that the model takes the
            plan's fastest copy-free forms.
        plan: the GEMM plan (:func:`~refspec.models.calibration.resolve_plan`).

    Returns:
        The plan the model follows: ``plan``, or ``plan`` without copies for the model's dtype
        when they would not fit.
    """
    dtype = model.dtype
    kind = plan.copy_kind(dtype)
    if kind is not None and not _copies_fit(model, kind):
        plan, kind = plan.without_copies(dtype), None
    forms = plan.forms_of(dtype)
    copied = {id(lin) for lin in copied_linears(model)} if kind else set()
    for mod in model.modules():
        if isinstance(mod, Linear):
            copy = WeightCopy(mod.weight, kind) if id(mod) in copied else None
            mod.gemm = None if forms is None else GemmChoice(dtype=dtype, forms=forms, copy=copy)
    log.info("CPU GEMM plan: %s; weight copies: %s", plan.describe() or "reference (F.linear)", kind or "none")
    return plan


def _copies_fit(model: nn.Module, kind: str) -> bool:
    """Whether copies of ``kind`` can be kept: within ``REFSPEC_CPU_WEIGHT_COPIES_GIB``, of weights
    not made under inference mode (they have no version counter to guard a copy with)."""
    limit = int(float(os.environ.get("REFSPEC_CPU_WEIGHT_COPIES_GIB", "2")) * 2**30)
    if any(lin.weight.is_inference() for lin in copied_linears(model)):
        return False
    need = weight_copy_bytes(model, kind)
    if need > limit:
        if limit > 0:
            log.info("no %s weight copies: they would take %.1f GiB, above REFSPEC_CPU_WEIGHT_COPIES_GIB=%g; "
                     "the products take the fastest copy-free forms measured", kind, need / 2**30, limit / 2**30)
        return False
    return True


__all__ = ["plan_gemms", "copied_linears", "weight_copy_bytes", "weight_copy_kind", "gemm_form"]
