"""The acceptance the paper command injects, and the recorded acceptance claim 3 is read from.

The targets have random weights, so a drafter's proposals are never really accepted: every
speculative run draws its accepted counts from an acceptance model (:mod:`refspec.eval.injection`)
and says so (INJECTED, with the model's origin). Each claim is evaluated at two levels, so the
crossover and the block loss show where they occur:

* ``small``: measured on this project's small real model, SmolLM2-135M with its shipped heads
  (``data/acceptance_smollm2.json``: EAGLE at K 7 and the block head at K 16, per corpus);
* ``published``: published-level drafters (``data/acceptance_published.json``, written by
  :func:`refspec.eval.acceptance_models.published_models`: vLLM's EAGLE-3 on Llama-3.1-8B, and a
  DFlash-like block drafter at K 16 from third-party serving figures per corpus);
* ``user``: what ``--accept-model`` names (a built-in, ``geometric:A`` or a
  ``refspec.acceptance/1`` file; ``--accept-file FILE`` is the same for a file).

Claim 3 (acceptance depends on text) cannot be measured on random weights; it is read from the
tau table measured on SmolLM2 per corpus (``data/tau_smollm2.json``) and from the published
per-corpus figures.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("data")
SMALL_FILE = DATA / "acceptance_smollm2.json"
PUBLISHED_FILE = DATA / "acceptance_published.json"
TAU_TABLE_FILE = DATA / "tau_smollm2.json"
DRAFTER_ALIASES = {"eagle": ("eagle", "eagle3", "any"), "block": ("block", "any")}
"""A grid drafter kind -> the drafter names of acceptance models it may use, best first."""
CORPUS_ALIASES = ("any", "unspecified")
"""Corpus names of a model that serves every corpus."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One level of acceptance the grid is evaluated at.

    Attributes:
        name: ``small``, ``published`` or ``user``.
        spec: a built-in name, ``geometric:A`` or a file path (what ``--accept-model`` takes).
        origin: one line on where its numbers come from.
    """

    name: str
    spec: str
    origin: str


SMALL = Source("small", str(SMALL_FILE), "measured on smollm2-135m with this project's shipped heads (CPU)")
PUBLISHED = Source("published", str(PUBLISHED_FILE),
                   "vLLM's EAGLE-3 on Llama-3.1-8B; DFlash (block 16) on Qwen3-8B per corpus (published figures)")


def user_source(spec: str) -> Source:
    """The ``user`` level from an ``--accept-model`` / ``--accept-file`` value."""
    return Source("user", spec, f"--accept-model {spec}")


def resolve(source: Source, drafter: str, corpus: str, k: int) -> Any:
    """The :class:`~refspec.eval.acceptance_models.AcceptanceModel` of ``source`` for a grid
    drafter kind (``eagle`` or ``block``) on ``corpus`` at ``k`` drafts.

    A file's model is picked by drafter (``eagle`` also takes an ``eagle3`` model) and corpus (a
    model of corpus ``any`` or ``unspecified`` serves every corpus), at the smallest recorded K
    >= ``k``; a built-in or ``geometric:A`` serves any drafter and corpus.

    Raises:
        AcceptanceModelError: nothing in the source fits (the message lists what it holds).
    """
    from refspec.eval.acceptance_models import AcceptanceModelError
    from refspec.eval.injection import load_acceptance_models, resolve_acceptance_model

    path = Path(source.spec)
    if not (path.suffix == ".json" or path.exists()):
        return resolve_acceptance_model(source.spec, k=k)
    models = load_acceptance_models(path)
    for name in DRAFTER_ALIASES.get(drafter, (drafter,)):
        for corp in (corpus, *CORPUS_ALIASES):
            fit = [m for m in models if m.drafter == name and m.corpus == corp and m.k >= k]
            if fit:
                return min(fit, key=lambda m: m.k).restrict(k)
    have = sorted({(m.drafter, m.corpus, m.k) for m in models})
    raise AcceptanceModelError(f"{path} ({source.name} acceptance) has no model for drafter {drafter} on {corpus} "
                               f"at k >= {k}; it holds (drafter, corpus, K) = {have}")


def tau_table() -> dict[str, Any]:
    """The tau table measured on SmolLM2 per corpus (``refspec.tau-table/1``)."""
    return json.loads(TAU_TABLE_FILE.read_text())


def published_corpus_taus() -> dict[str, dict[str, float]]:
    """Per published drafter with per-corpus figures, corpus -> tau (claim 3's published side)."""
    from refspec.eval.acceptance_models import DFLASH_B16_TAU

    return {"dflash-b16 (Qwen3-8B)": dict(DFLASH_B16_TAU)}


__all__ = ["Source", "SMALL", "PUBLISHED", "user_source", "resolve", "tau_table", "published_corpus_taus",
           "SMALL_FILE", "PUBLISHED_FILE", "TAU_TABLE_FILE"]
