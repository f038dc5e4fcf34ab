"""Acceptance injection: time real-shape forwards while acceptance follows a recorded distribution.

Timing and energy of 8B-class targets use random weights of the real architecture
(:mod:`refspec.models.random_models`), whose drafts a real drafter would never match. The engine
still runs the real draft and verify forwards at real shapes, but an :class:`AcceptanceModel`
decides how many drafts each row accepts: a distribution over accepted counts ``0..K`` per
(drafter, corpus, K), recorded from real runs on the small models (``python -m refspec.eval
... --export-acceptance``, built by :meth:`AcceptanceModel.from_generation`) or derived from a
published source. :func:`make_acceptance_fn` turns it into the engine's ``acceptance_fn``: per
row it samples ``n_acc`` and emits the accepted drafts followed by the target's argmax at
position ``n_acc`` (the "bonus/recovered" token). Every output of such a run must say the
acceptance was injected: use :func:`injection_label`.

The models themselves (and the built-in ones) live in :mod:`refspec.eval.acceptance_models`;
this module holds their files, the choice ``--accept-model`` makes, and the engine's hook.

Only chain drafts are injected (the engine verifies trees itself). A model recorded at K serves
any ``k <= K`` (:meth:`AcceptanceModel.restrict`): a chain drafter's first k drafts do not
depend on how many follow, so ``P(n_acc = k)`` at k is ``P(n_acc >= k)`` at K.

File schema (JSON, ``"schema": "refspec.acceptance/1"``)::

    {
      "schema": "refspec.acceptance/1",
      "models": [
        {
          "name": "ngram-humaneval-smollm2",     # free label
          "drafter": "ngram",                   # registry name of the drafter
          "corpus": "humaneval",                # corpus the prompts came from
          "k": 4,                               # drafts per step
          "probs": [p0, p1, ..., pK],           # P(n_acc = j), sums to 1
          "counts": [c0, ..., cK] | null,       # row-steps behind probs (null when derived)
          "mean_tau": 2.31,                     # sum (j + 1) p_j, for readers (recomputed on load)
          "provenance": {
            "kind": "measured" | "derived" | "restricted" | "extrapolated",
            "source_model": "smollm2-135m",     # the target that produced the counts
            "corpus": "humaneval",
            "prompts": 32,                      # prompts behind the counts (null if unknown)
            "date": "2026-05-01",               # ISO date of the run / derivation
            "source": "python -m refspec.eval ... --export-acceptance",  # command or citation
            "notes": "..."
          }
        }
      ]
    }

tau (acceptance length) counts the bonus token: ``tau = n_acc + 1`` per row-step.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from refspec.config import read_json
from refspec.eval.acceptance_models import (BUILTIN, VLLM_EAGLE3_TAU, AcceptanceModel, AcceptanceModelError,
                                            Provenance, geometric_model, model_from_survival, survival_from_taus)
from refspec.eval.outputs import write_json
from refspec.verify import Acceptance

log = logging.getLogger(__name__)

SCHEMA = "refspec.acceptance/1"


def save_acceptance_models(path: str | Path, models: Sequence[AcceptanceModel]) -> Path:
    """Write models to a JSON file of the module's schema; returns the path."""
    return write_json(Path(path), {"schema": SCHEMA, "models": [m.to_json() for m in models]})


def load_acceptance_models(path: str | Path) -> list[AcceptanceModel]:
    """Read every model of a JSON file (schema checked)."""
    p = Path(path)
    doc = read_json(p, AcceptanceModelError, missing=f"no acceptance model file at {p}")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise AcceptanceModelError(f"{p} is not a {SCHEMA} file (schema field: "
                                   f"{doc.get('schema') if isinstance(doc, dict) else None!r})")
    return [AcceptanceModel.from_json(d) for d in doc.get("models", [])]


def resolve_acceptance_model(spec: str, *, k: int, drafter: str | None = None,
                             corpus: str | None = None) -> AcceptanceModel:
    """The model ``--accept-model`` names, at ``k`` drafts.

    Args:
        spec: a built-in name (:data:`BUILTIN`), ``geometric:A``, or a JSON file of the schema.
        k: drafts per step of the run.
        drafter: pick the file's models of this drafter (if the file has several).
        corpus: pick the file's models of this corpus (if the file has several).

    Returns:
        The model at exactly ``k`` (restricted from the smallest recorded K >= k if needed).

    Raises:
        AcceptanceModelError: unknown name, no model for that k, or an ambiguous file.
    """
    if spec in BUILTIN:
        return BUILTIN[spec](k)
    if spec.startswith("geometric:"):
        try:
            a = float(spec.split(":", 1)[1])
        except ValueError:
            raise AcceptanceModelError(f"{spec!r}: write geometric:A with A a number in [0, 1]") from None
        return geometric_model(a, k)
    p = Path(spec)
    if not p.exists():
        raise AcceptanceModelError(f"unknown acceptance model {spec!r}: not a built-in "
                                   f"({', '.join(BUILTIN)}, geometric:A) and no such file")
    models = load_acceptance_models(p)
    if drafter is not None:
        models = [m for m in models if m.drafter == drafter]
    if corpus is not None:
        models = [m for m in models if m.corpus == corpus]
    usable = [m for m in models if m.k >= k]
    if not usable:
        have = sorted({(m.drafter, m.corpus, m.k) for m in load_acceptance_models(p)})
        raise AcceptanceModelError(f"{p} has no model for k={k} (drafter={drafter}, corpus={corpus}); it holds "
                                   f"(drafter, corpus, k) = {have}")
    kmin = min(m.k for m in usable)
    best = [m for m in usable if m.k == kmin]
    if len({(m.drafter, m.corpus) for m in best}) > 1:
        raise AcceptanceModelError(f"{p} holds several models for k={kmin}: "
                                   f"{sorted({(m.drafter, m.corpus) for m in best})}; choose with drafter= / corpus=")
    return best[0].restrict(k)


def injection_label(model: AcceptanceModel) -> str:
    """The line every output of an injected run carries."""
    prov = model.provenance
    return (f"ACCEPTANCE INJECTED from {model.name} ({prov.kind}; drafter={model.drafter}, corpus={model.corpus}, "
            f"source model={prov.source_model}, k={model.k}, mean tau={model.mean_tau:.3f}): "
            f"tokens are not the model's output and acceptance is not measured")


def injection_record(model: AcceptanceModel) -> dict[str, Any]:
    """A JSON-ready record of the injection for reports (``injected: True`` plus the model)."""
    return {"injected": True, "label": injection_label(model), "model": model.to_json()}


def make_acceptance_fn(model: AcceptanceModel, generator: torch.Generator, *, k: int | None = None
                       ) -> Callable[[Any, torch.Tensor, Any, torch.Generator | None], Acceptance]:
    """The engine's ``acceptance_fn`` (:data:`refspec.step.AcceptFn`) drawing accepted counts
    from ``model`` instead of comparing drafts with the target.

    Per row: ``n_acc`` is drawn from ``model`` restricted to the step's draft length, and the
    emitted token after the accepted drafts is the target's argmax at position ``n_acc``. The
    draws use ``generator`` (the engine's own generator is ignored, so injection never perturbs
    sampling elsewhere). Device ops only: no host sync.

    Args:
        model: the distribution (recorded at K >= the engine's k).
        generator: explicit random generator on the target's device.
        k: the engine's K under a fixed policy: a draft of another length (a drafter that cut
            its draft short) is refused, since injecting acceptance into drafts that were never
            made would credit them; None under a policy that varies K (each step's draft is
            then restricted to the K the step asked for).

    Returns:
        ``fn(draft, logits [B, K+1, V], sampling, engine_generator) -> Acceptance``.
    """
    from refspec.engine import GenerationError

    cdfs: dict[tuple[int, str], torch.Tensor] = {}

    def accept(draft: Any, logits: torch.Tensor, _sampling: Any = None,
               _engine_generator: torch.Generator | None = None) -> Acceptance:
        tokens = draft.tokens  # [B, K]
        b, kk = tokens.shape
        if k is not None and kk != k:
            raise GenerationError(f"injected acceptance needs full drafts of K={k}; the drafter cut its draft to "
                                  f"{kk}; a drafter must draft the K it is asked for")
        assert logits.shape[:2] == (b, kk + 1), f"logits {tuple(logits.shape)} for drafts {tuple(tokens.shape)}"
        key = (kk, str(logits.device))
        cdf = cdfs.get(key)
        if cdf is None:
            cdf = cdfs[key] = model.restrict(kk).cdf_tensor(logits.device)  # [K+1]
        u = torch.rand(b, device=logits.device, generator=generator)  # [B]
        n_acc = (u[:, None] >= cdf[None, :kk]).sum(1)  # [B]
        best = logits.argmax(-1)  # [B, K+1]
        return Acceptance(num_accepted=n_acc, next_token=best.gather(1, n_acc[:, None]).squeeze(1))

    return accept


__all__ = ["AcceptanceModel", "AcceptanceModelError", "Provenance", "SCHEMA", "BUILTIN", "VLLM_EAGLE3_TAU",
           "make_acceptance_fn", "resolve_acceptance_model", "save_acceptance_models", "load_acceptance_models",
           "geometric_model", "survival_from_taus", "model_from_survival", "injection_label", "injection_record"]
