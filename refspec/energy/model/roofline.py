"""Analytic roofline model of decode, draft and verify forwards: FLOPs, bytes, time, energy.

The model answers "what should one step cost on this hardware?" from the architecture alone,
so measured ledgers can be checked against it and so the paper's batch/speculation trade-off
can be predicted before a GPU is available.

Cost of one forward (:func:`forward_cost`), for N query tokens (rows x tokens_per_row, or a
ragged forward's ``query_tokens``),
L decoder layers, E model dim, I MLP dim, H / Hkv heads of dim D, V LM-head rows, b bytes per
element (shape glossary in :mod:`refspec.config`):

* **weights** are read once per forward, whatever N: every decoder-layer parameter (matrices,
  biases, norms), the final norm, the LM head matrix (V x E, read once if any token reaches
  it; a tied head counts here too), only the N gathered embedding rows (at most V), and any
  ``extra_weight_bytes`` (an EAGLE ``fc``).
* **linear FLOPs**: 2 per matrix parameter per token (one multiply-add): 2 N L (E D (2H + 2Hkv)
  + 3 E I). Norms, biases and activations (O(E) per token) are not counted.
* **mixture of experts** (qwen3_moe, mixtral): an MoE layer's MLP is its router (X x E, read
  and multiplied like a shared matrix) and X experts of 3 E I_e each. FLOPs: k_e experts per
  token. Weight bytes: only the distinct experts the forward routed to, as its
  ``ForwardShape.experts_touched`` records them (summed over MoE layers); a prediction, which
  has no router, takes the expectation X (1 - (1 - k_e/X)^N) per layer
  (:func:`expected_experts`). So verifying K+1 tokens per row reads more expert bytes than
  decoding one, even while memory-bound.
* **attention FLOPs**: 4 H D per (query, key) pair per layer (2 H D for Q K^T, 2 H D for P V);
  pairs = the forward's ``attention_pairs`` when it reports them (a packed prefill: the sum of
  S_i^2 over its prompts), else tokens_per_row x keys per row, i.e. ``tokens_per_row *
  context_tokens`` summed over rows, as a dense masked attention computes them. Sliding-window
  layers take ``sliding_attention_pairs`` and read ``sliding_context_tokens`` when a forward
  reports them; otherwise (predictions) the keys per row are capped at the window (the per-row
  mean of ``context_tokens`` is capped).
* **LM head FLOPs**: 2 V E per token that reaches the head.
* **KV reads**: keys read per layer x 2 Hkv D b (K and V), with the same sliding cap;
  **KV writes**: N x L x 2 Hkv D b.
* **activations**: compulsory traffic only, as a roofline should: each layer reads its input
  hidden state and writes its output (2 E per token per layer), the embedding gather writes E
  per token and the LM head writes the logits (V per token). A fused implementation keeps the
  intermediates (q, k, v, MLP activations) in cache; an unfused one moves more.

Time of one forward = max(FLOPs / peak, bytes / bandwidth) + a fixed per-forward overhead
(kernel launches). Energy = static power x time + pJ/FLOP x FLOPs + pJ/byte x bytes.

Hardware profiles (peak, bandwidth, energy coefficients) live in
:mod:`refspec.energy.model.hardware`, the FLOPs and bytes of a forward in
:mod:`refspec.energy.model.cost`, the expert reads of a mixture of experts in
:mod:`refspec.energy.model.experts`, named target architectures in
:mod:`refspec.energy.model.architectures`. Run ``python -m refspec.eval roofline --help`` for the
batch x k prediction CLI (:mod:`refspec.eval.roofline_cli`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from refspec.config import ModelArgs
from refspec.energy.model.architectures import dense_equivalent
from refspec.energy.model.cost import Cost
from refspec.energy.model.experts import expert_work
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.work import ForwardShape


# ---- cost of one forward ---------------------------------------------------------------------
def layer_parameters(args: ModelArgs, layer: int = 0) -> tuple[int, int]:
    """Parameters of decoder layer ``layer`` that every token reads (experts excluded).

    Returns:
        ``(matrix_params, other_params)``: projection + MLP matrix elements (an MoE layer: its
        router ``X x E`` and any shared expert with its gate instead of the MLP), and biases + norm weights (the same split
        ``ModelArgs.num_parameters`` sums).
    """
    e, d, h, kv = args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads
    shared = 3 * e * args.shared_expert_intermediate_size + (e if args.shared_expert_intermediate_size else 0)
    mlp = args.num_experts * e + shared if args.is_moe_layer(layer) else 3 * e * args.intermediate_size
    matrices = e * d * (2 * h + 2 * kv) + mlp
    other = e * (4 if args.sandwich_norms else 2) + (2 * d if args.qk_norm else 0)
    if args.attention_bias:
        other += d * (h + 2 * kv)
    return matrices, other


_STACKS: dict[tuple[int, int], tuple[ModelArgs, int, int, int]] = {}


def _stack(a: ModelArgs, layers: int) -> tuple[int, int, int]:
    """Matrix and other parameters of the ``layers`` decoder layers that ran (layer i is
    ``i % num_layers``) and how many of them slide; cached per architecture object, which the
    cache keeps alive so its id is not reused."""
    hit = _STACKS.get((id(a), layers))
    if hit is not None and hit[0] is a:
        return hit[1:]
    per = [(*layer_parameters(a, i % a.num_layers), a.is_sliding(i % a.num_layers)) for i in range(layers)]
    out = (sum(m for m, _, _ in per), sum(o for _, o, _ in per), sum(sl for _, _, sl in per))
    if len(_STACKS) > 256:
        _STACKS.clear()
    _STACKS[(id(a), layers)] = (a, *out)
    return out


def _keys(shape: ForwardShape, sliding: bool) -> float:
    """Keys one layer reads, summed over rows (a sliding layer: as reported, else capped at the window)."""
    if sliding and shape.sliding_context_tokens is not None:
        return float(shape.sliding_context_tokens)
    if sliding and shape.args.sliding_window:
        mean = shape.context_tokens / shape.rows
        return shape.rows * min(mean, shape.args.sliding_window)
    return float(shape.context_tokens)


def _pairs(shape: ForwardShape, sliding: bool) -> float:
    """(query, key) pairs one layer computes, summed over rows: as reported, else S x its keys."""
    reported = shape.sliding_attention_pairs if sliding else shape.attention_pairs
    return float(reported) if reported is not None else shape.tokens_per_row * _keys(shape, sliding)


def forward_cost(shape: ForwardShape) -> Cost:
    """FLOPs and bytes of one forward (see the module docstring for every term).

    Args:
        shape: the forward. ``context_tokens`` is the keys each layer reads summed over rows:
            the attended cache prefix, which includes the slots this forward writes;
            ``query_tokens``, ``attention_pairs`` and ``sliding_attention_pairs``, when set,
            replace ``rows * tokens_per_row`` and the pairs derived from the keys.

    Returns:
        The forward's :class:`Cost`.
    """
    a = shape.args
    if shape.rows <= 0 or shape.tokens_per_row <= 0:
        raise ValueError(f"a forward needs rows and tokens_per_row >= 1, got {shape.rows}, {shape.tokens_per_row}")
    if shape.query_tokens is not None and not 1 <= shape.query_tokens <= shape.rows * shape.tokens_per_row:
        raise ValueError(f"query_tokens must lie in [1, rows x tokens_per_row = {shape.rows * shape.tokens_per_row}], "
                         f"got {shape.query_tokens}")
    b = shape.dtype_bytes
    e = a.hidden_size
    n = shape.rows * shape.tokens_per_row if shape.query_tokens is None else shape.query_tokens
    layers = a.num_layers if shape.layers is None else shape.layers
    lm_tokens = n if shape.lm_head_tokens is None else shape.lm_head_tokens
    lm_rows = a.vocab_size if shape.lm_head_rows is None else shape.lm_head_rows
    matrices, other, sliding = _stack(a, layers)  # over the layers that ran
    kv_per_key = 2 * a.num_kv_heads * a.head_dim * b  # K and V of one key in one layer
    keys = (layers - sliding) * _keys(shape, False) + sliding * _keys(shape, True)
    pairs = (layers - sliding) * _pairs(shape, False) + sliding * _pairs(shape, True)
    expert_flops, expert_bytes = expert_work(shape, n, layers)

    lm_head_matrix = lm_rows * e if lm_tokens > 0 else 0
    multi = b if shape.matrix_bytes is None else shape.matrix_bytes  # products of 2+ rows
    weights = ((multi if n > 1 else b) * matrices + (multi if lm_tokens > 1 else b) * lm_head_matrix
               + b * (other + e + min(n, a.vocab_size) * e) + expert_bytes)
    return Cost(
        linear_flops=2.0 * n * matrices + expert_flops,
        attention_flops=4.0 * a.num_heads * a.head_dim * pairs,
        lm_head_flops=2.0 * lm_tokens * lm_rows * e,
        extra_flops=float(shape.extra_flops),
        weight_bytes=float(weights + shape.extra_weight_bytes),
        kv_read_bytes=float(keys * kv_per_key),
        kv_write_bytes=float(n * layers * kv_per_key),
        activation_bytes=float(b * (n * layers * 2 * e + n * e + lm_tokens * lm_rows)),
    )


def total_cost(work: Sequence[ForwardShape]) -> Cost:
    """Sum of :func:`forward_cost` over ``work`` (an empty phase costs nothing)."""
    out = Cost()
    for shape in work:
        out = out + forward_cost(shape)
    return out


def work_time_s(work: Sequence[ForwardShape], profile: HardwareProfile) -> float:
    """Roofline time of sequential forwards: each is bounded on its own, then summed."""
    return sum(profile.time_s(forward_cost(s)) for s in work)


# ---- one speculative step ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterModel:
    """What one draft forward costs, for predictions (a drafter provides its own through the
    optional ``roofline_model`` method of :class:`refspec.drafting.Drafter`).

    Three ways to describe a drafter, in order of precedence:

    * ``fraction``: each draft forward costs this fraction of one target decode forward (T = 1)
      of the same batch and context; 0 is a free drafter that runs no forwards at all;
    * ``args``: a separate draft model; a draft forward runs all ``args.num_layers`` layers;
    * otherwise an EAGLE-style head: ``layers`` decoder layers with the target's architecture
      (a mixture-of-experts target's dense equivalent: a head layer has a dense MLP),
      an ``fc`` of ``fc_inputs x E -> E`` (2 for EAGLE-1/2, 3 for EAGLE-3, 0 for none), and an
      LM head of ``lm_head_rows`` rows (default: the target's vocabulary).

    Attributes:
        name: label for tables.
        layers: decoder layers of an EAGLE-style head.
        fc_inputs: EAGLE ``fc`` input width in multiples of E.
        lm_head_rows: LM-head rows of an EAGLE-style head (a reduced draft vocabulary).
        args: architecture of a separate draft model.
        fraction: cost of one draft forward as a fraction of a target decode forward.
        parallel: True for block drafters that propose all K tokens in one forward of K
            tokens per row; False for chain drafters that run K forwards of one token.
    """

    name: str
    layers: int = 1
    fc_inputs: int = 2
    lm_head_rows: int | None = None
    args: ModelArgs | None = None
    fraction: float | None = None
    parallel: bool = False

    @property
    def free(self) -> bool:
        """Whether the drafter runs no forwards (n-gram lookup)."""
        return self.fraction == 0

    def forward_cost(self, target: ModelArgs, *, rows: int, tokens_per_row: int, context_tokens: int,
                     dtype_bytes: int) -> Cost:
        """Cost of one draft forward (``context_tokens`` summed over rows, as in ForwardShape)."""
        if self.fraction is not None:
            base = ForwardShape(args=target, rows=rows, tokens_per_row=1, context_tokens=context_tokens,
                                dtype_bytes=dtype_bytes)
            return forward_cost(base).scale(self.fraction)
        if self.args is not None:
            return forward_cost(ForwardShape(args=self.args, rows=rows, tokens_per_row=tokens_per_row,
                                             context_tokens=context_tokens, dtype_bytes=dtype_bytes))
        e = target.hidden_size
        fc = self.fc_inputs * e * e
        return forward_cost(ForwardShape(args=dense_equivalent(target), rows=rows, tokens_per_row=tokens_per_row,
                                         context_tokens=context_tokens, dtype_bytes=dtype_bytes,
                                         layers=self.layers, lm_head_rows=self.lm_head_rows,
                                         extra_weight_bytes=fc * dtype_bytes,
                                         extra_flops=2 * fc * rows * tokens_per_row))


EAGLE_HEAD = DrafterModel(name="eagle-1layer", layers=1, fc_inputs=2)
"""Default drafter of predictions: an EAGLE-1/2-like head, one target decoder layer + fc + LM head."""


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens emitted per row per step, (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023).

    Args:
        acceptance: per-token acceptance probability a in [0, 1].
        k: draft length.
    """
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Modelled cost of one decode step at steady state (all rows active).

    Attributes:
        batch: rows B.
        k: draft length (0 = plain decoding).
        acceptance: per-token acceptance a.
        context: cache length per row before the step, in tokens.
        tokens_per_row: expected tokens emitted per row per step.
        draft_time_s / verify_time_s / step_time_s: modelled times in s.
        draft_energy_j / verify_energy_j / step_energy_j: modelled energies in J.
        tpot_s: time per output token per user, step time / tokens_per_row, in s.
        j_per_token: step energy / (B x tokens_per_row), in J.
        verify_cost: FLOPs and bytes of the verify forward.
        verify_compute_bound: whether verify's intensity exceeds the ridge.
        profile: name of the hardware profile.
    """

    batch: int
    k: int
    acceptance: float
    context: int
    tokens_per_row: float
    draft_time_s: float
    verify_time_s: float
    step_time_s: float
    draft_energy_j: float
    verify_energy_j: float
    step_energy_j: float
    tpot_s: float
    j_per_token: float
    verify_cost: Cost
    verify_compute_bound: bool
    profile: str


def predict_step(target: ModelArgs, profile: HardwareProfile, *, batch: int, k: int, context: int,
                 acceptance: float, drafter: DrafterModel | None = EAGLE_HEAD,
                 dtype_bytes: int = 2) -> StepPrediction:
    """Model one speculative step: K draft forwards (or one block forward), one verify forward.

    The verify forward runs K + 1 tokens per row over ``context + K + 1`` keys per row; a chain
    drafter runs K forwards of one token per row over the same context (its own cache), a block
    drafter one forward of K tokens, a free drafter none (no launch overhead either).
    Acceptance, commit and sampling cost nothing here.

    Args:
        target: target architecture.
        profile: hardware profile.
        batch: rows B (all active).
        k: draft length; 0 means plain autoregressive decoding (no draft phase).
        context: tokens in each row's cache before the step.
        acceptance: per-token acceptance a (ignored when k = 0).
        drafter: draft cost model (default: EAGLE-style one-layer head); None or a free model
            (``fraction=0``) for a drafter that runs no forwards.
        dtype_bytes: bytes per weight / KV element.

    Returns:
        The :class:`StepPrediction`.
    """
    t = k + 1
    verify = forward_cost(ForwardShape(args=target, rows=batch, tokens_per_row=t,
                                       context_tokens=batch * (context + t), dtype_bytes=dtype_bytes))
    verify_time = profile.time_s(verify)
    verify_energy = profile.energy_j(verify, verify_time)
    draft_time = draft_energy = 0.0
    if k > 0 and drafter is not None and not drafter.free:
        if drafter.parallel:
            one = drafter.forward_cost(target, rows=batch, tokens_per_row=k,
                                       context_tokens=batch * (context + k), dtype_bytes=dtype_bytes)
            forwards = [one]
        else:
            forwards = [drafter.forward_cost(target, rows=batch, tokens_per_row=1,
                                             context_tokens=batch * (context + i + 1), dtype_bytes=dtype_bytes)
                        for i in range(k)]
        for c in forwards:
            ft = profile.time_s(c)
            draft_time += ft
            draft_energy += profile.energy_j(c, ft)
    tokens = expected_tokens_per_step(acceptance, k) if k else 1.0
    step_time = draft_time + verify_time
    step_energy = draft_energy + verify_energy
    return StepPrediction(batch=batch, k=k, acceptance=acceptance, context=context, tokens_per_row=tokens,
                          draft_time_s=draft_time, verify_time_s=verify_time, step_time_s=step_time,
                          draft_energy_j=draft_energy, verify_energy_j=verify_energy, step_energy_j=step_energy,
                          tpot_s=step_time / tokens, j_per_token=step_energy / (batch * tokens),
                          verify_cost=verify, verify_compute_bound=verify.intensity > profile.ridge,
                          profile=profile.name)


def compute_bound_batch(target: ModelArgs, profile: HardwareProfile, *, k: int, context: int,
                        dtype_bytes: int = 2, max_batch: int = 1 << 16) -> int | None:
    """Smallest batch whose verify forward (K + 1 tokens per row) is compute-bound.

    Returns:
        The batch, or None when even ``max_batch`` stays memory-bound (long contexts: KV reads
        grow with the batch as fast as FLOPs do).
    """
    def bound(b: int) -> bool:
        c = forward_cost(ForwardShape(args=target, rows=b, tokens_per_row=k + 1,
                                      context_tokens=b * (context + k + 1), dtype_bytes=dtype_bytes))
        return c.flops / profile.peak_flops >= c.bytes / profile.bandwidth_Bps

    if not bound(max_batch):
        return None
    lo, hi = 0, max_batch  # bound(hi) holds, bound(lo) does not (batch 0 never is)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bound(mid) else (mid, hi)
    return hi


