"""Speculation policies: how many tokens to draft in the coming step.

The engine asks its policy once per decode step, before drafting, with a :class:`StepView` of
the batch, and tells it what the step accepted afterwards. A policy returns K from a small set
(:attr:`SpeculationPolicy.ks`) so step shapes stay static: one verify shape, and on a GPU one
CUDA graph, per K. K = 0 makes a plain decoding step (the drafter is not asked).

:class:`FixedK` drafts the configured K every step.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepView:
    """What a policy may read before a step (host values, no device sync).

    Attributes:
        step: index of the step about to run.
        batch: B static slots.
        active: slots with a generating request.
        max_k: the engine's K, the largest draft the cache has room for.
        length_bound: the longest committed row + 1 (keys the verify will attend, before bucketing).
        slot_requests: request id in each slot, -1 empty.
    """

    step: int
    batch: int
    active: int
    max_k: int
    length_bound: int
    slot_requests: tuple[int, ...]


class SpeculationPolicy(Protocol):
    """Chooses K per step.

    Attributes:
        name: how records and reports name the policy (``fixed``, ``off-above:32``, ...).
        ks: every K it may return (each <= the engine's K).
    """

    name: str
    ks: tuple[int, ...]

    def choose(self, view: StepView) -> int: ...

    def observe(self, k: int, accepted: Sequence[int], slot_requests: Sequence[int]) -> None:
        """After the step: ``accepted`` drafts per slot (-1: no generating request there)."""
        ...


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


__all__ = ["FixedK", "SpeculationPolicy", "StepView"]
