"""A stream mixing corpora: ``--corpus mixed:A+B[+C...]`` interleaves their requests.

Request i takes the ``i // n``-th prompt of part ``i % n`` (n parts): ``mixed:conversation+code``
serves conversation 1, code 1, conversation 2, code 2, and so on, each part's prompts as its
own corpus gives them. A server sees such a stream when users of different tasks share it,
and a per-request speculation policy is tested on it: one fixed K cannot suit both parts.

The parts' reference answers are scaled by different corpus quantiles, so a mixed stream
carries no reference lengths (:func:`refspec.eval.prompt_sets.mixed_prompt_set`):
``--output-len-dist auto`` draws its budgets ``uniform:0.25`` (any explicit distribution but
``reference`` works too).
"""
from __future__ import annotations

from typing import Iterable

PREFIX = "mixed:"


def mixed_parts(corpus: str) -> list[str] | None:
    """The parts of a ``mixed:A+B`` corpus name, or None for any other name."""
    if not corpus.startswith(PREFIX):
        return None
    return [p.strip() for p in corpus[len(PREFIX):].split("+")]


def check_mixed(corpus: str, known: Iterable[str]) -> str:
    """The canonical name of a mixed corpus whose parts are built-in corpora.

    Raises:
        ValueError: fewer than two parts, an unknown part, or a part named twice.
    """
    parts, known = mixed_parts(corpus), list(known)
    if parts is None or len(parts) < 2 or len(set(parts)) != len(parts):
        raise ValueError(f"{corpus!r}: a mixed corpus names two or more different built-in corpora, "
                         f"e.g. mixed:conversation+code")
    bad = [p for p in parts if p not in known]
    if bad:
        raise ValueError(f"{corpus!r}: {', '.join(bad)} is not a built-in corpus ({', '.join(known)})")
    return PREFIX + "+".join(parts)


__all__ = ["PREFIX", "check_mixed", "mixed_parts"]
