"""Greedy audit per request: each request's output against the baseline's, and why the two differ.

Greedy speculative decoding is lossless: every request must emit, token for token, what plain
decoding (the baseline configuration, k = 0, same request stream) emits for the same prompt.
Under continuous batching a request shares its steps with whatever else is in the batch, so
the audit compares request by request (a record's ``request_outputs``: per request id its
prompt and emitted tokens), never whole batches; :mod:`refspec.eval.baseline` writes its
verdicts into the record.

Where a request differs, its first divergent position p decides the kind. One target forward
over ``prompt + common prefix`` (the tokens both runs agreed on) gives the logits at p; the
baseline emitted token a there, the configuration token b. The divergence is a **near-tie**
when both lie within rounding noise of the top logit::

    M     = max |logits|
    gap   = max(logits) - min(logits[a], logits[b])          (>= the top-2 margin)
    bound = max(NEAR_TIE_ULPS * ulp_dtype(M), FP32_FLOOR_ULPS * ulp_fp32(M))
    near-tie  <=>  gap <= bound

and a **defect** otherwise (a wrong token no rounding explains). ulp_d(M) is the spacing of
dtype d's numbers at M. Two sources of noise, two terms: every logit leaves the LM head rounded
to the run's dtype (the bf16/fp16 grid), and every GEMM accumulates in fp32 in an order that
depends on its shape (rows in the batch, k + 1 verify positions against 1), in any dtype.
The constants sit at two to three times the worst margin shift that
:mod:`refspec.eval.audit_noise` measured between those shapes (figures: docs/serving.md,
"Report: targets and audit"); on a new device or model, remeasure before trusting a defect
count near the bound. The forward runs in the model's
own dtype, as the runs did.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Protocol, Sequence

NEAR_TIE_ULPS = 4
"""ulps of the run's dtype at the top logit's magnitude: its rounding term (module docstring)."""
FP32_FLOOR_ULPS = 128
"""fp32 ulps at the same magnitude: the accumulation-order term, present in every dtype."""
MAX_LISTED = 20
"""Divergences listed per record (each kind); the counts cover all of them."""
_MANTISSA_BITS = {"fp32": 23, "bf16": 7, "fp16": 10}
_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def dtype_name(dtype: Any) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` from a torch dtype or a name."""
    text = str(dtype).removeprefix("torch.")
    if text not in _NAMES:
        raise ValueError(f"no rounding bound for dtype {dtype!r}; the audit knows fp32, bf16 and fp16")
    return _NAMES[text]


def ulp(x: float, dtype: Any) -> float:
    """Spacing of ``dtype``'s numbers at magnitude ``|x|`` (at 0: that of 1.0, a floor for all-zero logits)."""
    bits = _MANTISSA_BITS[dtype_name(dtype)]
    m = abs(float(x))
    return 2.0 ** ((math.floor(math.log2(m)) if m > 0 else 0) - bits)


def near_tie_bound(scale: float, dtype: Any) -> float:
    """The larger of :data:`NEAR_TIE_ULPS` ulps of ``dtype`` and :data:`FP32_FLOOR_ULPS` fp32 ulps at ``scale``."""
    return max(NEAR_TIE_ULPS * ulp(scale, dtype), FP32_FLOOR_ULPS * ulp(scale, "fp32"))


def bound_text(dtype: Any) -> str:
    name = dtype_name(dtype)
    return (f"both tokens within max({NEAR_TIE_ULPS} ulp in {name}, {FP32_FLOOR_ULPS} ulp in fp32) of the top logit, "
            f"ulps taken at the top logit's magnitude")


# ---- comparing outputs (no model) ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Divergence:
    """A request whose output differs from the baseline's, at its first differing position."""

    id: int
    position: int                 # index into the emitted tokens
    prompt: tuple[int, ...] | None
    prefix: tuple[int, ...]       # emitted tokens both runs agree on (length == position)
    baseline_token: int | None    # None: the baseline's output ended there
    token: int | None             # None: the configuration's output ended there


@dataclasses.dataclass(frozen=True)
class Comparison:
    compared: int
    matching: int
    divergent: tuple[Divergence, ...]
    not_comparable: tuple[int, ...]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a length difference counts at the shorter's end), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Output(Protocol):
    """One request's output as compared: its id, its prompt (None: not recorded) and its tokens."""

    id: int
    prompt: Sequence[int] | None
    tokens: Sequence[int]


def compare(outputs: Sequence[Output], baseline: Sequence[Output]) -> Comparison:
    """Request-by-request comparison of two runs' request outputs (a record's ``request_outputs``)."""
    mine, base = {int(o.id): o for o in outputs}, {int(o.id): o for o in baseline}
    both = sorted(set(mine) & set(base))
    other_prompt = [i for i in both if mine[i].prompt is not None and base[i].prompt is not None
                    and list(mine[i].prompt) != list(base[i].prompt)]
    matching, divergent = 0, []
    for rid in (i for i in both if i not in other_prompt):
        m, b = mine[rid], base[rid]
        p = first_divergence(m.tokens, b.tokens)
        if p is None:
            matching += 1
            continue
        prompt = m.prompt if m.prompt is not None else b.prompt
        divergent.append(Divergence(id=rid, position=p, prompt=None if prompt is None else tuple(prompt),
                                    prefix=tuple(m.tokens[:p]), token=_at(m.tokens, p),
                                    baseline_token=_at(b.tokens, p)))
    return Comparison(compared=len(both) - len(other_prompt), matching=matching, divergent=tuple(divergent),
                      not_comparable=tuple(sorted(set(mine) ^ set(base) | set(other_prompt))))


def _at(tokens: Sequence[int], i: int) -> int | None:
    return int(tokens[i]) if i < len(tokens) else None


# ---- classifying a divergence (one target forward) ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class Margin:
    """The target's logits at a divergent position, as the near-tie test reads them."""

    top2_margin: float   # top logit - second logit
    gap: float           # top logit - the lower of the two emitted tokens' logits
    scale: float         # max |logit|
    bound: float         # near_tie_bound(scale, dtype)
    dtype: str

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound


def margin_of(logits: Any, a: int, b: int, dtype: Any) -> Margin:
    """:class:`Margin` of tokens ``a`` and ``b`` in ``logits`` ``[V]`` (computed in ``dtype``)."""
    import torch

    values = logits.detach().float().flatten()
    top = torch.topk(values, 2).values
    scale = float(values.abs().max())
    gap = float(top[0] - torch.minimum(values[a], values[b]))
    return Margin(top2_margin=float(top[0] - top[1]), gap=gap, scale=scale, bound=near_tie_bound(scale, dtype),
                  dtype=dtype_name(dtype))


def last_logits(model: Any, tokens: Sequence[int]) -> Any:
    """Logits ``[V]`` (fp32, from the model's dtype) at the last of ``tokens``: one batch-1 forward, fresh cache."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)   # [1, S]
        positions = torch.arange(len(tokens), device=model.device).unsqueeze(0)    # [1, S]
        cache = model.new_cache(1, len(tokens))
        logits, _ = model.forward(ids, positions, cache, logits_at=positions[:, -1:])  # [1, 1, V]
    return logits[0, -1]


MarginFn = Callable[[Divergence], "Margin | None"]


def margin_fn(model: Any) -> MarginFn:
    """The near-tie test of ``model`` (a :class:`refspec.models.transformer.Transformer`): None when it cannot apply."""
    def margin(d: Divergence) -> Margin | None:
        if d.prompt is None or d.token is None or d.baseline_token is None:
            return None
        return margin_of(last_logits(model, (*d.prompt, *d.prefix)), d.baseline_token, d.token, model.dtype)

    margin.dtype = dtype_name(model.dtype)  # type: ignore[attr-defined]  # the bound's dtype, for the record
    return margin


# ---- classification ------------------------------------------------------------------------------
def entry(d: Divergence, m: Margin | None, reason: str | None = None) -> dict[str, Any]:
    """A divergence as the record lists it (id, position, tokens; margin, gap and bound when classified)."""
    out: dict[str, Any] = {"id": d.id, "position": d.position, "baseline_token": d.baseline_token, "token": d.token}
    if m is not None:
        out.update(top2_margin=m.top2_margin, gap=m.gap, bound=m.bound, dtype=m.dtype)
    if reason:
        out["reason"] = reason
    return out


def classify(divergent: Sequence[Divergence], fn: MarginFn) -> tuple[list[dict], list[dict], int]:
    """``(near-ties, defects, unclassified)`` of ``divergent``: without a prompt no margin can be computed."""
    near, defects, unclassified = [], [], 0
    for d in divergent:
        if d.token is None or d.baseline_token is None:
            defects.append(entry(d, None, "outputs of different lengths with a common prefix"))
            continue
        m = fn(d)
        if m is None:
            unclassified += 1
        elif m.near_tie:
            near.append(entry(d, m))
        else:
            defects.append(entry(d, m, f"gap {m.gap:.4g} > bound {m.bound:.4g}"))
    return near, defects, unclassified


__all__ = ["classify", "entry", "compare", "first_divergence", "margin_fn", "margin_of", "last_logits",
           "near_tie_bound", "ulp", "dtype_name", "Divergence", "Comparison", "Margin", "NEAR_TIE_ULPS",
           "FP32_FLOOR_ULPS"]
