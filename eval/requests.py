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
REFERENCE_QUANTILE = 0.99
"""The reference length (quantile of the corpus's eval references) that maps to the budget N."""


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


def quantile_length(lengths: Sequence[int], q: float = REFERENCE_QUANTILE) -> int:
    """The ``q`` quantile of ``lengths`` as an order statistic (the smallest value with at least q below or at it)."""
    ordered = sorted(lengths)
    assert ordered, "no lengths"
    return int(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """The distinct prompts of a stream and their reference answers' lengths.

    Attributes:
        prompts: distinct prompt token ids, in stream order.
        reference_lengths: per prompt, its reference answer's length in target tokens (None: no
            reference, or not measured).
        reference_scale_len: the corpus's :data:`REFERENCE_QUANTILE` reference length over its
            whole eval split (tokens), None when not measured.
    """

    prompts: list[list[int]]
    reference_lengths: list[int | None]
    reference_scale_len: int | None = None

    @property
    def has_references(self) -> bool:
        return self.reference_scale_len is not None and all(n is not None for n in self.reference_lengths)


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


# ---- corpus prompts ----------------------------------------------------------------------------
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


def _distinct(candidates: Sequence[Sequence[int]], limit: int) -> tuple[list[list[int]], list[int]]:
    """The first ``limit`` distinct candidates and their indices."""
    out: list[list[int]] = []
    kept: list[int] = []
    seen: set[tuple[int, ...]] = set()
    for i, p in enumerate(candidates):
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(list(p))
            kept.append(i)
            if len(out) == limit:
                break
    return out, kept


def _reference_lengths(texts: Sequence[str], tokenizer: Any) -> list[int | None]:
    return [len(tokenizer.encode(t)) if t else None for t in texts]


def corpus_reference_scale(corpus: str, tokenizer: Any) -> int | None:
    """:data:`REFERENCE_QUANTILE` of the reference lengths (tokens) over the corpus's whole eval split
    (``conversation``: every source's eval prompts, not only the Vicuna subset); None without references."""
    from refspec.eval.corpora import CORPORA, load_corpus

    spec = CORPORA.get(corpus)
    wide = spec is not None and spec.default_subset is not None
    texts = list(load_corpus(corpus, split="eval", subset="all" if wide else None)["reference"])
    lengths = [n for n in _reference_lengths(texts, tokenizer) if n is not None]
    return quantile_length(lengths) if lengths else None


def corpus_prompt_set(corpus: str, tokenizer: Any, *, chat: bool, wanted: int, cap: int | None = None,
                      references: bool = True) -> PromptSet:
    """Up to ``min(wanted, cap)`` distinct prompts of ``corpus`` (see the module docstring) with
    their reference answers' lengths (``references=False``: not measured).

    Raises:
        CorpusError, ValueError: what loading or building the prompts raises; ValueError when
            the corpus has no eval prompts.
    """
    from refspec.eval.corpora import build_prompts, prose_windows
    from refspec.eval.mixed_corpus import mixed_parts, mixed_prompt_set

    if mixed_parts(corpus):  # mixed:A+B interleaves the parts' requests
        return mixed_prompt_set(corpus, tokenizer, chat=chat, wanted=wanted, cap=cap)
    limit = wanted if cap is None else min(wanted, cap)
    rows = _rows(corpus, limit)
    if not rows:
        raise ValueError(f"corpus {corpus!r} has no eval prompts")
    prompts, kept = _distinct(build_prompts(rows, tokenizer, chat=chat), limit)
    texts = [str(rows[i].get("reference") or "") for i in kept]
    if len(prompts) < limit:
        windows = prose_windows(rows, tokenizer)
        rounds = max((len(w) for w in windows), default=0)
        extra = [w[j] for j in range(1, rounds) for w in windows if j < len(w)]
        prompts, kept = _distinct([*prompts, *extra], limit)
        texts = [texts[i] if i < len(texts) else "" for i in kept]  # a later cut has no reference answer
    if len(prompts) < limit:
        log.warning("corpus %s has %d distinct eval prompts for %d requests; prompts repeat", corpus, len(prompts),
                    limit)
    if not references:
        return PromptSet(prompts, [None] * len(prompts))
    lengths = _reference_lengths(texts, tokenizer)
    scale = corpus_reference_scale(corpus, tokenizer) if all(n is not None for n in lengths) else None
    return PromptSet(prompts, lengths, scale)


def corpus_prompts(corpus: str, tokenizer: Any, *, chat: bool, wanted: int, cap: int | None = None) -> list[list[int]]:
    """The prompts of :func:`corpus_prompt_set` (no reference lengths measured)."""
    return corpus_prompt_set(corpus, tokenizer, chat=chat, wanted=wanted, cap=cap, references=False).prompts


__all__ = ["RequestStream", "REQUESTS_PER_SLOT", "DEFAULT_RANGE_RATIO", "REFERENCE_QUANTILE", "LengthDist",
           "PromptSet", "default_requests", "poisson_arrivals", "make_stream", "build_stream", "resolve_budgets",
           "reference_budgets", "uniform_budgets", "baseline_refill_groups", "quantile_length", "corpus_prompts", "corpus_prompt_set",
           "corpus_reference_scale"]
