"""The request stream of one evaluation: distinct corpus prompts, and when each request arrives.

Prompts: the distinct prompts of the stream come from :mod:`refspec.eval.prompt_sets`; request
i takes prompt ``i % len`` (prompts repeat only when the corpus has run out of distinct ones).

Arrivals: closed loop by default (``arrival_s`` None: a request arrives when a slot frees for
it, concurrency = batch); open loop with a rate R requests/s: a Poisson process seeded by the
run's seed, the first request at 0 and exponential gaps of mean 1/R after it (on the engine
clock), so the same seed gives the same arrivals for a configuration and its baseline.

Output lengths: every request has its own budget below ``--max-new-tokens`` N, as a server's
stream does (with equal budgets a plain-decoding baseline finishes in lockstep and refills in
waves). ``--output-len-dist`` (:class:`LengthDist`) says how they are drawn:

- ``reference``: the length of the request's reference answer (AlpacaEval's answers, HumanEval's
  canonical solutions, the math questions' worked answers), in target tokens, scaled by
  ``min(1, N / L99)`` where L99 is the 99th percentile of the corpus's eval-split reference
  lengths; the 1 % above L99 are capped at N, every budget is at least 1. A common factor keeps
  the spread (a plain cap at N would not: most conversation references exceed 64 tokens).
- ``uniform:R``: uniform integers over ``[ceil(R * N), N]``, the range-ratio draw of serving
  benchmarks; request i draws from its own generator seeded by (seed, i).
- ``fixed``: N for every request (lockstep waves: for unit comparisons).
- ``auto`` (the default): ``reference`` where every prompt of the stream has a reference answer,
  else ``uniform:0.25``.

EOS still ends a request early. A configuration and its baseline serve the same stream: the
same ids, prompts, budgets and arrivals (:attr:`RequestStream.digest`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from typing import Any, Sequence

import numpy as np

from refspec.eval.prompt_sets import REFERENCE_QUANTILE, PromptSet
from refspec.serving import Request

log = logging.getLogger(__name__)

REQUESTS_PER_SLOT = 4
"""Default stream length per slot: each slot serves this many requests on average."""
_ARRIVAL_SALT = 0x5E12
"""Mixed into the run's seed so arrivals do not share a stream with sampling."""
_LENGTH_SALT = 0x1E27
"""Mixed into the run's seed so output lengths share a stream with neither arrivals nor sampling."""
DEFAULT_RANGE_RATIO = 0.25
"""``auto`` without reference answers: uniform over ``[N / 4, N]``."""


def default_requests(batch: int) -> int:
    """The default stream length: :data:`REQUESTS_PER_SLOT` x ``batch``."""
    return REQUESTS_PER_SLOT * batch


# ---- output lengths ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LengthDist:
    """How the budgets of a stream are drawn (see the module docstring).

    Attributes:
        kind: ``auto``, ``reference``, ``uniform`` or ``fixed``.
        ratio: ``uniform``'s range ratio R in (0, 1]: budgets over ``[ceil(R * N), N]``.
    """

    kind: str
    ratio: float | None = None

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        """``auto``, ``reference``, ``fixed`` or ``uniform[:R]`` (R default 0.25).

        Raises:
            ValueError: anything else, or R outside (0, 1].
        """
        kind, sep, arg = str(text).strip().lower().partition(":")
        if kind in ("auto", "reference", "fixed") and not sep:
            return cls(kind)
        if kind == "uniform":
            try:
                ratio = float(arg) if sep else DEFAULT_RANGE_RATIO
            except ValueError:
                ratio = math.nan
            if not 0 < ratio <= 1:
                raise ValueError(f"uniform:R needs a range ratio 0 < R <= 1 (budgets over [R x N, N]), got {arg!r}")
            return cls("uniform", ratio)
        raise ValueError(f"unknown output-length distribution {text!r}; use auto, reference, fixed or uniform:R "
                         f"(e.g. uniform:0.25)")

    @property
    def text(self) -> str:
        return f"uniform:{self.ratio:g}" if self.kind == "uniform" else self.kind


def reference_budgets(lengths: Sequence[int], max_new_tokens: int, scale_len: int) -> list[int]:
    """Reference lengths scaled by ``min(1, N / scale_len)`` into ``[1, N]`` (rounded half up)."""
    assert scale_len >= 1, scale_len
    f = min(1.0, max_new_tokens / scale_len)
    return [min(max_new_tokens, max(1, int(n * f + 0.5))) for n in lengths]


def uniform_budgets(n: int, max_new_tokens: int, ratio: float, seed: int) -> list[int]:
    """``n`` budgets, uniform integers over ``[ceil(ratio * N), N]``; request i's from its own generator."""
    low = min(max_new_tokens, max(1, math.ceil(ratio * max_new_tokens)))
    return [int(np.random.default_rng([seed, _LENGTH_SALT, i]).integers(low, max_new_tokens + 1)) for i in range(n)]


def resolve_budgets(prompt_set: PromptSet, n: int, *, max_new_tokens: int, dist: LengthDist,
                    seed: int) -> tuple[list[int], dict[str, Any]]:
    """The budgets of ``n`` requests over ``prompt_set`` (request i takes prompt ``i % len``) and
    the record of how they were drawn.

    Raises:
        ValueError: ``reference`` asked for a stream whose prompts lack reference answers.
    """
    kind = dist.kind
    if kind == "auto":
        kind = "reference" if prompt_set.has_references else "uniform"
        dist = LengthDist(kind, None if kind == "reference" else DEFAULT_RANGE_RATIO)
    info: dict[str, Any] = {"dist": dist.text, "reference_quantile": None, "reference_scale_len": None, "scale": None}
    if kind == "reference":
        if not prompt_set.has_references:
            missing = sum(x is None for x in prompt_set.reference_lengths)
            raise ValueError(f"--output-len-dist reference: {missing} of {len(prompt_set.prompts)} prompts have no "
                             f"reference answer; use --output-len-dist uniform:{DEFAULT_RANGE_RATIO:g} (or auto)")
        lengths = [prompt_set.reference_lengths[i % len(prompt_set.prompts)] for i in range(n)]
        scale_len = int(prompt_set.reference_scale_len or 1)
        budgets = reference_budgets(lengths, max_new_tokens, scale_len)  # type: ignore[arg-type]
        info.update(reference_quantile=REFERENCE_QUANTILE, reference_scale_len=scale_len,
                    scale=min(1.0, max_new_tokens / scale_len))
    elif kind == "uniform":
        budgets = uniform_budgets(n, max_new_tokens, float(dist.ratio), seed)
    else:
        budgets = [max_new_tokens] * n
    ordered = sorted(budgets)
    info.update(min=ordered[0], p50=ordered[(len(ordered) - 1) // 2], max=ordered[-1], mean=sum(budgets) / len(budgets))
    return budgets, info


def baseline_refill_groups(budgets: Sequence[int], batch: int) -> list[int]:
    """The refill group sizes of a plain-decoding continuous run of ``budgets``, by scheduling alone.

    A pure simulation of the engine's schedule without EOS: the first fill takes ``batch``
    requests (one token each from prefill); every step each generating row emits one token; a
    request that reached its budget frees its slot after the step, and the freed slots take the
    next requests of the stream together, one refill group (a budget-1 request, finished by its
    prefill, frees its slot after the next step, or at once when no row is generating). The
    first fill, and refills before the first decode step, are the ramp-up: not returned.

    Returns:
        The size of each refill group, in order.
    """
    assert batch >= 1 and all(b >= 1 for b in budgets)
    queue = list(budgets)[::-1]
    left = [queue.pop() - 1 for _ in range(min(batch, len(queue)))]  # tokens still to emit per busy slot
    groups: list[int] = []
    stepped = False
    while left:
        if any(left):  # one decode step: every generating row emits one token
            left, stepped = [n - 1 if n > 0 else n for n in left], True
        freed = sum(n == 0 for n in left)
        left = [n for n in left if n > 0]
        group = min(freed, len(queue))
        if group:
            groups += [group] if stepped else []
            left += [queue.pop() - 1 for _ in range(group)]
    return groups


# ---- the stream --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestStream:
    """The requests of one configuration.

    Attributes:
        requests: in id order (ids 0 ... N-1).
        unique: distinct prompts among them.
        rate: open-loop arrival rate (requests/s), None for closed loop.
        lengths: how the budgets were drawn (:func:`resolve_budgets`'s record); None when given.
    """

    requests: tuple[Request, ...]
    unique: int
    rate: float | None = None
    lengths: dict[str, Any] | None = None

    def chunks(self, batch: int) -> list[tuple[Request, ...]]:
        """The static schedule's lockstep batches: consecutive runs of ``batch`` requests."""
        return [self.requests[i:i + batch] for i in range(0, len(self.requests), batch)]

    @property
    def digest(self) -> str:
        """sha256 over every request's id, prompt, budget and arrival: equal streams, equal digests."""
        rows = [[r.id, list(r.prompt), r.max_new_tokens, r.arrival_s] for r in self.requests]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` per second: 0, then exponential gaps.

    Raises:
        ValueError: ``rate`` not positive and finite, or ``n`` negative.
    """
    if not (rate > 0 and np.isfinite(rate)):
        raise ValueError(f"request rate must be positive and finite, got {rate!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    gaps = np.random.default_rng([seed, _ARRIVAL_SALT]).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def make_stream(prompts: Sequence[Sequence[int]], n: int, *, max_new_tokens: int, rate: float | None = None,
                seed: int = 0, budgets: Sequence[int] | None = None,
                lengths: dict[str, Any] | None = None) -> RequestStream:
    """``n`` requests over ``prompts`` (cyclically when there are fewer), closed or open loop.

    Args:
        budgets: per request, its budget (each in ``[1, max_new_tokens]``); None: ``max_new_tokens`` each.
        lengths: how ``budgets`` were drawn, kept on the stream for the record.

    Raises:
        ValueError: no prompts, ``n < 1``, a bad rate, or budgets of the wrong count or range.
    """
    if not prompts:
        raise ValueError("no prompts to build requests from")
    if n < 1:
        raise ValueError(f"requests must be >= 1, got {n}")
    budgets = [max_new_tokens] * n if budgets is None else list(budgets)
    if len(budgets) != n or not all(1 <= b <= max_new_tokens for b in budgets):
        raise ValueError(f"expected {n} budgets in [1, {max_new_tokens}], got {len(budgets)} in "
                         f"[{min(budgets, default=0)}, {max(budgets, default=0)}]")
    arrivals: list[float | None] = [None] * n if rate is None else list(poisson_arrivals(n, rate, seed))
    reqs = tuple(Request(id=i, prompt=tuple(prompts[i % len(prompts)]), max_new_tokens=budgets[i],
                         arrival_s=arrivals[i]) for i in range(n))
    return RequestStream(requests=reqs, unique=len({r.prompt for r in reqs}), rate=rate, lengths=lengths)


def build_stream(prompt_set: PromptSet, n: int, *, max_new_tokens: int, dist: LengthDist, rate: float | None = None,
                 seed: int = 0) -> RequestStream:
    """``n`` requests over ``prompt_set`` with budgets drawn by ``dist`` (:func:`resolve_budgets`)."""
    budgets, info = resolve_budgets(prompt_set, n, max_new_tokens=max_new_tokens, dist=dist, seed=seed)
    return make_stream(prompt_set.prompts, n, max_new_tokens=max_new_tokens, rate=rate, seed=seed, budgets=budgets,
                       lengths=info)


__all__ = ["RequestStream", "REQUESTS_PER_SLOT", "DEFAULT_RANGE_RATIO", "LengthDist", "default_requests",
           "poisson_arrivals", "make_stream", "build_stream", "resolve_budgets", "reference_budgets", "uniform_budgets",
           "baseline_refill_groups"]
