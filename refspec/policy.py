"""Speculation policies: how many tokens to draft in the coming step.

The engine asks its policy once per decode step, before drafting, with a
:class:`~refspec.policy_protocol.StepView` of the batch, and tells it what the step accepted
afterwards (the protocol: :class:`~refspec.policy_protocol.SpeculationPolicy`). A policy returns
K from a small set (its ``ks``) so step shapes stay static: one verify shape, and on a GPU one
CUDA graph, per K. K = 0 makes a plain decoding step (the drafter is not asked; it still sees
the step's ``commit``). Whatever K a step takes, greedy output equals plain decoding and
sampling stays lossless: verification decides every drafted token.

Policies, by their spec (:func:`parse_policy`; the CLI's ``--spec-policy``):

* ``fixed``: :class:`FixedK`, the engine's K every step;
* ``off-above:B``: :class:`OffAbove`, the engine's K while at most B rows are active, else 0
  (vLLM's ``disable_by_batch_size``);
* ``k-by-batch:1=7,8=4,32=2,64=0``: :class:`KByBatch`, K by active rows, each entry from its
  row count up to the next (vLLM's ``num_speculative_tokens_per_batch_size``);
* ``energy[:tpot_ms=T]``: :class:`refspec.policy_energy.EnergyPolicy`, the K of least predicted
  joules per emitted token whose predicted time per output token meets T.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from refspec.policy_energy import EnergyPolicy
from refspec.policy_protocol import SpeculationPolicy, StepView


class FixedK:
    """K drafts every step (K = 0: plain decoding).

    Args:
        k: drafts per step.
    """

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k
        self.name = "fixed"
        self.ks = (k,)

    def choose(self, view: StepView) -> int:
        return self.k

    def observe(self, k: int, accepted: Sequence[int], slot_requests: Sequence[int]) -> None:
        pass


class OffAbove:
    """The engine's K while at most ``rows`` rows are active, else plain decoding.

    Args:
        k: drafts per step at or below the threshold.
        rows: most active rows that still draft.
    """

    def __init__(self, k: int, rows: int) -> None:
        if k < 1 or rows < 0:
            raise ValueError(f"off-above needs k >= 1 and rows >= 0, got k={k}, rows={rows}")
        self.k, self.rows = k, rows
        self.name = f"off-above:{rows}"
        self.ks = (0, k)

    def choose(self, view: StepView) -> int:
        return self.k if view.active <= self.rows else 0

    def observe(self, k: int, accepted: Sequence[int], slot_requests: Sequence[int]) -> None:
        pass


class KByBatch:
    """K by active rows: entry ``(rows, k)`` applies from ``rows`` active rows up to the next
    entry's; fewer rows than the first entry take the first entry's K.

    Args:
        table: ``(rows, k)`` pairs, rows >= 1 and distinct, k >= 0.
    """

    def __init__(self, table: Sequence[tuple[int, int]]) -> None:
        table = sorted((int(r), int(k)) for r, k in table)
        if not table or any(r < 1 or k < 0 for r, k in table) or len({r for r, _ in table}) != len(table):
            raise ValueError(f"k-by-batch needs distinct row counts >= 1 and K >= 0, got {table}")
        self.table = tuple(table)
        self.name = "k-by-batch:" + ",".join(f"{r}={k}" for r, k in self.table)
        self.ks = tuple(sorted({k for _, k in self.table}))

    def choose(self, view: StepView) -> int:
        k = self.table[0][1]
        for rows, entry_k in self.table:
            if view.active >= rows:
                k = entry_k
        return k

    def observe(self, k: int, accepted: Sequence[int], slot_requests: Sequence[int]) -> None:
        pass


# ---- specs --------------------------------------------------------------------------------------
class PolicySpecError(ValueError):
    """A ``--spec-policy`` text that names no policy (the message says what is accepted)."""


SPEC_HELP = ("fixed (K drafts every step), off-above:B (no drafting while more than B rows are active), "
             "k-by-batch:1=7,8=4,32=2,64=0 (K by active rows), energy[:tpot_ms=T] (per step the K of least "
             "predicted J/token whose predicted TPOT meets T ms)")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A parsed policy spec (torch-free: the CLI checks it before loading anything).

    Attributes:
        kind: ``fixed``, ``off-above``, ``k-by-batch`` or ``energy``.
        rows: off-above's threshold.
        table: k-by-batch's ``(rows, k)`` entries.
        tpot_ms: energy's TPOT target in ms (None: none).
    """

    kind: str
    rows: int | None = None
    table: tuple[tuple[int, int], ...] = ()
    tpot_ms: float | None = None

    @property
    def name(self) -> str:
        """The canonical spec, as records and config ids carry it."""
        if self.kind == "off-above":
            return f"off-above:{self.rows}"
        if self.kind == "k-by-batch":
            return "k-by-batch:" + ",".join(f"{r}={k}" for r, k in self.table)
        if self.kind == "energy" and self.tpot_ms is not None:
            return f"energy:tpot_ms={self.tpot_ms:g}"
        return self.kind

    def max_k(self, k: int) -> int:
        """The largest K the policy asks for with engine K ``k``."""
        return max(kk for _, kk in self.table) if self.kind == "k-by-batch" else k

    def build(self, k: int, **energy: Any) -> SpeculationPolicy:
        """The policy for engine K ``k``; ``energy`` are :class:`refspec.policy_energy.EnergyPolicy`'s
        keyword arguments (cost model, prior)."""
        if self.kind == "fixed":
            return FixedK(k)
        if self.kind == "off-above":
            return OffAbove(k, self.rows)
        if self.kind == "k-by-batch":
            return KByBatch(self.table)
        return EnergyPolicy(k=k, tpot_ms=self.tpot_ms, **energy)


def _integer(text: str, what: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise PolicySpecError(f"--spec-policy {spec!r}: {what} must be an integer, got {text!r}") from None


def parse_policy(spec: str) -> PolicySpec:
    """Parse ``fixed``, ``off-above:B``, ``k-by-batch:R=K,...`` or ``energy[:tpot_ms=T]``.

    Raises:
        PolicySpecError: anything else, with what is accepted.
    """
    kind, _, arg = spec.strip().partition(":")
    kind = kind.lower()
    if kind == "fixed" and not arg:
        return PolicySpec("fixed")
    if kind == "off-above" and arg:
        rows = _integer(arg, "B", spec)
        if rows < 0:
            raise PolicySpecError(f"--spec-policy {spec!r}: B must be >= 0 (active rows above which no draft runs)")
        return PolicySpec("off-above", rows=rows)
    if kind == "k-by-batch" and arg:
        table = []
        for entry in arg.split(","):
            rows, eq, k = entry.partition("=")
            if not eq:
                raise PolicySpecError(f"--spec-policy {spec!r}: each entry is ROWS=K, e.g. k-by-batch:1=7,8=4,32=0")
            table.append((_integer(rows, "ROWS", spec), _integer(k, "K", spec)))
        try:
            KByBatch(table)
        except ValueError as exc:
            raise PolicySpecError(f"--spec-policy {spec!r}: {exc}") from None
        return PolicySpec("k-by-batch", table=tuple(sorted(table)))
    if kind == "energy":
        if not arg:
            return PolicySpec("energy")
        key, eq, value = arg.partition("=")
        try:
            tpot = float(value) if key == "tpot_ms" and eq else None
        except ValueError:
            tpot = None
        if tpot is None or not 0 < tpot < float("inf"):
            raise PolicySpecError(f"--spec-policy {spec!r}: energy takes tpot_ms=T, a TPOT target in ms > 0 "
                                  f"(e.g. energy:tpot_ms=50)")
        return PolicySpec("energy", tpot_ms=tpot)
    raise PolicySpecError(f"--spec-policy {spec!r} is unknown; use {SPEC_HELP}")


__all__ = ["FixedK", "KByBatch", "OffAbove", "PolicySpec", "PolicySpecError", "SPEC_HELP", "parse_policy"]
