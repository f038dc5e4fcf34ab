"""The request stream of one evaluation: distinct corpus prompts, and when each request arrives.

Prompts: by default a run serves ``4 x batch`` requests (:func:`default_requests`), each a
distinct prompt of the corpus's eval split, in corpus order. When the default eval subset is
smaller than the stream, the rest of the eval split follows (``conversation``: every AlpacaEval
source after the Vicuna questions; ``math``: more generated questions). Prose corpora (UDHR
blocks, speeches) then give more continuation prompts, cut from the same texts at later
offsets (:func:`refspec.eval.corpora.prompts.continuation_windows`), in rounds: every text's
first cut, then every text's second, and so on. Only when all of these are used up do prompts
repeat, cyclically; :attr:`RequestStream.unique` says how many were distinct.

Arrivals: closed loop by default (``arrival_s`` None: a request arrives when a slot frees for
it, concurrency = batch); open loop with a rate R requests/s: a Poisson process seeded by the
run's seed, the first request at 0 and exponential gaps of mean 1/R after it (on the engine
clock), so the same seed gives the same arrivals for a configuration and its baseline.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np

from refspec.serving import Request

log = logging.getLogger(__name__)

REQUESTS_PER_SLOT = 4
"""Default stream length per slot: each slot serves this many requests on average."""
_ARRIVAL_SALT = 0x5E12
"""Mixed into the run's seed so arrivals do not share a stream with sampling."""


def default_requests(batch: int) -> int:
    """The default stream length: :data:`REQUESTS_PER_SLOT` x ``batch``."""
    return REQUESTS_PER_SLOT * batch


@dataclasses.dataclass(frozen=True)
class RequestStream:
    """The requests of one configuration.

    Attributes:
        requests: in id order (ids 0 ... N-1).
        unique: distinct prompts among them.
        rate: open-loop arrival rate (requests/s), None for closed loop.
    """

    requests: tuple[Request, ...]
    unique: int
    rate: float | None = None

    def chunks(self, batch: int) -> list[tuple[Request, ...]]:
        """The static schedule's lockstep batches: consecutive runs of ``batch`` requests."""
        return [self.requests[i:i + batch] for i in range(0, len(self.requests), batch)]


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
                seed: int = 0) -> RequestStream:
    """``n`` requests over ``prompts`` (cyclically when there are fewer), closed or open loop.

    Raises:
        ValueError: no prompts, ``n < 1``, or a bad rate.
    """
    if not prompts:
        raise ValueError("no prompts to build requests from")
    if n < 1:
        raise ValueError(f"requests must be >= 1, got {n}")
    arrivals: list[float | None] = [None] * n if rate is None else list(poisson_arrivals(n, rate, seed))
    reqs = tuple(Request(id=i, prompt=tuple(prompts[i % len(prompts)]), max_new_tokens=max_new_tokens,
                         arrival_s=arrivals[i]) for i in range(n))
    return RequestStream(requests=reqs, unique=len({r.prompt for r in reqs}), rate=rate)


def _rows(corpus: str, wanted: int) -> list[dict[str, Any]]:
    """Eval rows of ``corpus``: the default eval subset, then (when short) the rest of the eval split."""
    from refspec.eval.corpora import CORPORA, load_corpus

    rows = list(load_corpus(corpus, split="eval"))
    spec = CORPORA.get(corpus)
    if len(rows) >= wanted or spec is None:
        return rows
    if spec.name == "math":
        wider = list(load_corpus(corpus, split="eval", subset=wanted))
    elif spec.default_subset is not None:
        wider = list(load_corpus(corpus, split="eval", subset="all"))
    else:
        return rows
    seen = {r["id"] for r in rows}
    return rows + [r for r in wider if r["id"] not in seen]


def _distinct(candidates: Sequence[Sequence[int]], limit: int) -> list[list[int]]:
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for p in candidates:
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(list(p))
            if len(out) == limit:
                break
    return out


def corpus_prompts(corpus: str, tokenizer: Any, *, chat: bool, wanted: int, cap: int | None = None) -> list[list[int]]:
    """Up to ``min(wanted, cap)`` distinct prompt token lists of ``corpus`` (see the module docstring).

    Raises:
        CorpusError, ValueError: what loading or building the prompts raises; ValueError when
            the corpus has no eval prompts.
    """
    from refspec.eval.corpora import build_prompts, prose_windows

    limit = wanted if cap is None else min(wanted, cap)
    rows = _rows(corpus, limit)
    if not rows:
        raise ValueError(f"corpus {corpus!r} has no eval prompts")
    prompts = _distinct(build_prompts(rows, tokenizer, chat=chat), limit)
    if len(prompts) < limit:
        windows = prose_windows(rows, tokenizer)
        rounds = max((len(w) for w in windows), default=0)
        extra = [w[j] for j in range(1, rounds) for w in windows if j < len(w)]
        prompts = _distinct([*prompts, *extra], limit)
    if len(prompts) < limit:
        log.warning("corpus %s has %d distinct eval prompts for %d requests; prompts repeat", corpus, len(prompts),
                    limit)
    return prompts


__all__ = ["RequestStream", "REQUESTS_PER_SLOT", "default_requests", "poisson_arrivals", "make_stream",
           "corpus_prompts"]
