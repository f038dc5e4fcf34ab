"""The distinct prompts a request stream serves, and their reference answers' lengths.

By default a run serves ``4 x batch`` requests, each a distinct prompt of the corpus's eval
split, in corpus order. When the default eval subset is smaller than the stream, the rest of the
eval split follows (``conversation``: every AlpacaEval source after the Vicuna questions;
``math``: more generated questions). Prose corpora (UDHR blocks, speeches) then give more
continuation prompts, cut from the same texts at later offsets
(:func:`refspec.eval.corpora.prompts.continuation_windows`), in rounds: every text's first cut,
then every text's second, and so on. Only when all of these are used up do prompts repeat,
cyclically (:attr:`refspec.eval.requests.RequestStream.unique` says how many were distinct).

A mixed corpus (``mixed:A+B``, :mod:`refspec.eval.mixed_corpus`) alternates its parts' prompts:
request i takes the ``i // n``-th prompt of part ``i % n``. Its parts' reference answers are
scaled by different corpus quantiles, so a mixed set carries no reference lengths.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

from refspec.eval.mixed_corpus import mixed_parts

log = logging.getLogger(__name__)

REFERENCE_QUANTILE = 0.99
"""The reference length (quantile of the corpus's eval references) that maps to the budget N."""


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


def _rows(corpus: str, wanted: int) -> list[dict[str, Any]]:
    """Eval rows of ``corpus``: the default eval subset, then (when short) the rest of the eval split."""
    from refspec.eval.corpora.catalog import CORPORA, load_corpus

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
    from refspec.eval.corpora.catalog import CORPORA, load_corpus

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
    from refspec.eval.corpora.prompts import build_prompts, prose_windows

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


def mixed_prompt_set(corpus: str, tokenizer: Any, *, chat: bool, wanted: int, cap: int | None = None) -> PromptSet:
    """Up to ``min(wanted, cap)`` prompts alternating over the parts (no reference lengths).

    """
    parts = mixed_parts(corpus)
    assert parts, f"{corpus!r} is not a mixed corpus"
    limit = wanted if cap is None else min(wanted, cap)
    each = math.ceil(limit / len(parts))
    sets = [corpus_prompt_set(p, tokenizer, chat=chat, wanted=each, references=False).prompts for p in parts]
    prompts = [s[i] for i in range(each) for s in sets if i < len(s)][:limit]
    return PromptSet(prompts, [None] * len(prompts))


__all__ = ["PromptSet", "REFERENCE_QUANTILE", "quantile_length", "corpus_prompt_set", "corpus_prompts",
           "corpus_reference_scale", "mixed_prompt_set"]
