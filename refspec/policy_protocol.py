"""What a speculation policy sees before a step and how it answers: the policy protocol.

Its own module so that the policies (:mod:`refspec.policy`, :mod:`refspec.policy_energy`) and the
engine that asks them import it, and none of them imports another to reach it.
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


__all__ = ["StepView", "SpeculationPolicy"]
