"""Routed-expert work of a mixture-of-experts forward, for the roofline model
(:mod:`refspec.energy.model.roofline`): k_e experts per token in FLOPs, the distinct experts touched
in bytes, as the forward recorded them or, for a prediction, their expectation under uniform
routing.
"""
from __future__ import annotations

from refspec.config import ModelArgs
from refspec.energy.model.work import ForwardShape


def expert_parameters(args: ModelArgs) -> int:
    """Matrix elements of one routed expert (gate, up, down), 0 for a dense model."""
    return 3 * args.hidden_size * args.moe_intermediate_size if args.is_moe else 0


def expected_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts one MoE layer reads for ``tokens`` tokens, each routed to
    ``top_k`` of ``num_experts`` experts uniformly at random: X (1 - (1 - k/X)^N).

    (Each expert is missed by one token with probability 1 - k/X, by all N independently.)
    """
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expert_work(shape: ForwardShape, tokens: int, layers: int) -> tuple[float, float]:
    """(FLOPs, weight bytes) of the routed experts of a forward of ``tokens`` tokens through
    ``layers`` layers: k_e experts per token per MoE layer; bytes of the distinct experts
    touched, as the forward recorded them, else their expectation under uniform routing."""
    a = shape.args
    moe = a.moe_layers(layers) if a.is_moe else 0  # a dense model: no layer to count
    if not moe:
        return 0.0, 0.0
    per_expert = expert_parameters(a)
    touched = shape.experts_touched
    if touched is None:
        touched = moe * expected_experts(a.num_experts, a.num_experts_per_tok, tokens)
    return 2.0 * tokens * a.num_experts_per_tok * moe * per_expert, float(shape.dtype_bytes * touched * per_expert)
