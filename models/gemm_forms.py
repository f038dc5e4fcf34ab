"""The CPU GEMM forms a product ``x [rows, in] @ W.T`` (``W [out, in]``) may take, the weight
copies some of them read, and :func:`linear`, the product every
:class:`~refspec.models.layers.Linear` runs in the form its :class:`GemmChoice` names.
:mod:`refspec.models.calibration` times the forms on the machine; :mod:`refspec.models.cpu_speed`
gives each layer of a built model its choice.

- ``linear``: ``F.linear`` on the weight (the reference);
- ``nodnn``: ``F.linear`` with oneDNN switched off around the call, so a half-precision product
  takes ATen's own kernels (for one row on some CPUs about twice as fast as oneDNN's, with the
  same fp32 accumulation; half-precision models only);
- ``wxt``: ``(W @ x^T)^T`` on the weight, with a row-major ``x``;
- ``column``: ``x @ Wc`` through a column-major copy ``Wc [in, out]`` of the weight;
- ``fp32``: ``(W32 @ x^T)^T`` through an fp32 copy, rounded back to the model's dtype
  (half-precision models only);
- ``packed``: oneDNN's product on a copy of the weight reordered once into oneDNN's blocked
  layout (where torch has oneDNN and it supports the dtype on this CPU), so no call pays the
  reorder a plain oneDNN product makes of its weight.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMS = {"fp32": ("linear", "wxt", "column", "packed"), "bf16": ("linear", "nodnn", "wxt", "column", "fp32", "packed"),
         "fp16": ("linear", "nodnn", "wxt", "column", "fp32", "packed")}
COPY_FORMS = ("column", "fp32", "packed")
PACK_ROWS = 8  # the row count oneDNN lays a packed weight out for (a hint: any row count runs)


def row_bucket(rows: int) -> int:
    """Which form of a plan a product of ``rows`` rows takes: 0 for one row, 1 for 2-31 rows
    (verification, small batches), 2 for 32 or more (prefill, large batches)."""
    return 0 if rows == 1 else 1 if rows < 32 else 2


def make_copy(form: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of ``weight [out, in]`` that ``form`` reads (None for the copy-free forms)."""
    w = weight.detach()
    if form == "column":
        return w.t().contiguous()
    if form == "fp32":
        return w.float().contiguous()
    if form == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
    return None


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` through a weight :func:`make_copy` packed for oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_supported(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run :func:`packed_product` in ``dtype`` (oneDNN refuses, e.g.,
    fp16 on CPUs without fp16 conversion instructions)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=dtype)
        packed_product(torch.ones(2, 16, dtype=dtype), make_copy("packed", w), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def without_onednn(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)`` with oneDNN off (process-wide while it runs: decoding runs one product at a
    time; ``torch.backends.mkldnn.flags`` does the same with more per-call overhead)."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return fn(*args)
    finally:
        torch._C._set_mkldnn_enabled(before)


def apply_form(form: str, x: torch.Tensor, w: torch.Tensor, copy: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T`` in ``form`` (``copy``: what :func:`make_copy` made for it), as calibration times it."""
    if form == "linear":
        return F.linear(x, w)
    if form == "nodnn":
        return without_onednn(F.linear, x, w)
    if form == "wxt":
        return torch.mm(w, x.t()).t()
    if form == "column":
        return torch.mm(x, copy)
    if form == "packed":
        return packed_product(x, copy, None)
    return torch.mm(copy, x.float().t()).t().to(x.dtype)  # fp32


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


@dataclasses.dataclass(frozen=True, eq=False)
class GemmChoice:
    """The forms a CPU GEMM plan chose for one linear layer's products, and the weight copy they
    read (a :class:`~refspec.models.layers.Linear`'s ``gemm``, set by
    :func:`refspec.models.cpu_speed.plan_gemms`).

    Attributes:
        dtype: the dtype the forms were timed in; products in another dtype take ``F.linear``.
        forms: the form of one row, of 2-31 rows and of 32 or more rows (:func:`row_bucket`).
        copy: what the copy forms read (None: they take ``F.linear``).
    """

    dtype: torch.dtype
    forms: tuple[str, str, str]
    copy: WeightCopy | None = None

    def form(self, rows: int) -> str:
        """The form of a product of ``rows`` rows."""
        return self.forms[row_bucket(rows)]

    def multirow_element_bytes(self, weight: torch.Tensor, rows: int | None = None) -> int | None:
        """4 where products of 2 or more rows (of ``rows`` rows, when given) multiply the
        half-precision ``weight`` through its fp32 copy, else None (what
        :meth:`refspec.models.Transformer.multirow_matrix_bytes` reports)."""
        c = self.copy
        if c is None or c.kind != "fp32" or c.of(weight) is None:
            return None
        return 4 if rows is None or self.form(rows) == "fp32" else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           choice: GemmChoice | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in the form ``choice`` names for this row count on CPUs
    (``F.linear`` without a choice, off the CPU, in another dtype, and where a form's copy is
    missing or stale).

    The result may be a column-major view; later ops accept it as is.
    """
    if x.dim() != 2:  # rows [N, in]: a non-contiguous [B, S, in] would otherwise run as a batched product
        lead = x.shape[:-1]
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, choice).view(*lead, weight.shape[0])
    if choice is None or not x.is_cpu or x.dtype != choice.dtype:
        return F.linear(x, weight, bias)
    form = choice.form(x.shape[0])
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
    copy = choice.copy
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


__all__ = ["DTYPES", "FORMS", "COPY_FORMS", "PACK_ROWS", "row_bucket", "make_copy", "packed_product",
           "packed_supported", "without_onednn", "apply_form", "WeightCopy", "GemmChoice", "linear"]
