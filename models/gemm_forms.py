"""The CPU GEMM forms a product ``x [rows, in] @ W.T`` (``W [out, in]``) may take, and the weight
copies some of them read; :mod:`refspec.models.calibration` times them on the machine and
:mod:`refspec.models.cpu_speed` multiplies through the chosen ones.

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

from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMS = {"fp32": ("linear", "wxt", "column", "packed"), "bf16": ("linear", "nodnn", "wxt", "column", "fp32", "packed"),
         "fp16": ("linear", "nodnn", "wxt", "column", "fp32", "packed")}
COPY_FORMS = ("column", "fp32", "packed")
PACK_ROWS = 8  # the row count oneDNN lays a packed weight out for (a hint: any row count runs)


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
