"""FLOPs and main-memory bytes of forwards: the quantity the roofline model computes
(:func:`refspec.energy.model.roofline.forward_cost`) and a hardware profile prices
(:class:`refspec.energy.model.hardware.HardwareProfile`). Its own module, so neither of those two
imports the other.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and main-memory bytes of one or more forwards (add with ``+``).

    Attributes:
        linear_flops: FLOPs of the decoder-layer projections and MLP.
        attention_flops: FLOPs of Q K^T and P V.
        lm_head_flops: FLOPs of the LM head.
        extra_flops: FLOPs the caller declared (e.g. an EAGLE ``fc``).
        weight_bytes: weight bytes read.
        kv_read_bytes: KV-cache bytes read.
        kv_write_bytes: KV-cache bytes written.
        activation_bytes: compulsory activation traffic (layer inputs/outputs, logits).
    """

    linear_flops: float = 0.0
    attention_flops: float = 0.0
    lm_head_flops: float = 0.0
    extra_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    activation_bytes: float = 0.0

    @property
    def flops(self) -> float:
        """All FLOPs."""
        return self.linear_flops + self.attention_flops + self.lm_head_flops + self.extra_flops

    @property
    def bytes(self) -> float:
        """All main-memory bytes (weights + KV reads/writes + activations)."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP/byte (0 for an empty cost)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(getattr(self, f) + getattr(other, f) for f in _FIELDS))

    def scale(self, factor: float) -> "Cost":
        """Every field times ``factor``."""
        return Cost(*(factor * getattr(self, f) for f in _FIELDS))

    def as_dict(self) -> dict[str, float]:
        """Fields plus the ``flops`` and ``bytes`` totals."""
        return {**dataclasses.asdict(self), "flops": self.flops, "bytes": self.bytes}


_FIELDS = tuple(f.name for f in dataclasses.fields(Cost))  # plain attribute reads: astuple deep-copies

__all__ = ["Cost"]
