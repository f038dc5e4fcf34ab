"""The speculation policy of one evaluation configuration (``--spec-policy``).

:func:`build_policy` turns a configuration's spec into the engine's policy
(:mod:`refspec.policy`). The energy policy prices steps by the hardware the run measures or
models: the meter's roofline profile (``--meter roofline:h200`` models an H200 whatever runs
the code), else the GPU's data sheet, else this CPU's profile; the drafter's cost per draft
forward is its ``roofline_model``; the target's verify is the shape its own forward records.
Where the meter's clock is measured (wall time, CUDA events), the policy also watches the
phase events and scales each K's time by what it measured.
Its acceptance prior is the corpus's measured acceptance length of the drafter on this model
where ``drafters/heads/tau_table.json`` has one (per-token acceptance solved from tau at its K),
else the drafter's ``acceptance_prior``, else 0.5.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from refspec.eval.flags import UsageError
from refspec.policy import PolicySpec, PolicySpecError, parse_policy

log = logging.getLogger(__name__)

DEFAULT_PRIOR = 0.5
TAU_TABLE = Path(__file__).resolve().parent.parent / "drafters" / "heads" / "tau_table.json"


def checked_spec(text: str) -> PolicySpec:
    """The parsed ``--spec-policy`` (torch-free).

    Raises:
        UsageError: the one-line reason.
    """
    try:
        return parse_policy(text)
    except PolicySpecError as exc:
        raise UsageError(str(exc)) from None


def check_policy_for(spec: PolicySpec, *, k: int, tree: bool, drafter: str) -> None:
    """Refuse a policy this configuration cannot run (before any model loads)."""
    if spec.kind == "fixed":
        return
    if drafter == "none":
        raise UsageError(f"--spec-policy {spec.name} chooses K for a drafter; the baseline (no drafter) has none")
    if tree and spec.kind not in ("fixed", "off-above"):
        raise UsageError(f"--spec-policy {spec.name} with --tree: a tree is drafted whole or not at all; use fixed or "
                         f"off-above:B")
    if spec.max_k(k) > k:
        raise UsageError(f"--spec-policy {spec.name} asks for K={spec.max_k(k)} but --k is {k}; the engine's K is "
                         f"the largest a step may draft: raise --k to {spec.max_k(k)}")


@functools.lru_cache(maxsize=1)
def _tau_rows() -> tuple[str | None, tuple[dict[str, Any], ...]]:
    try:
        table = json.loads(TAU_TABLE.read_text())
    except (OSError, ValueError):
        return None, ()
    return table.get("model"), tuple(r for r in table.get("rows", []) if r.get("head") == "mix")


def corpus_prior(model: str, drafter: str, corpus: str, temperature: float) -> float | None:
    """The drafter's per-token acceptance on ``corpus`` (parts of a ``mixed:A+B`` averaged) from
    the measured tau table, or None where it has no row."""
    from refspec.eval.acceptance_models import acceptance_from_tau
    from refspec.eval.mixed_corpus import mixed_parts

    table_model, rows = _tau_rows()
    if table_model != model:
        return None
    values = []
    for part in mixed_parts(corpus) or [corpus]:
        hits = [r for r in rows if r["config"] == f"{drafter}-chain" and r["corpus"] == part
                and (r["temperature"] == 0) == (temperature == 0)]
        if not hits:
            return None
        values.append(acceptance_from_tau(float(hits[0]["tau"]), int(hits[0]["k"])))
    return sum(values) / len(values)


def build_policy(session: Any, cfg: Any, drafter: Any) -> Any:
    """The engine's policy for ``cfg`` (None: the engine's default, fixed K)."""
    spec = checked_spec(cfg.spec_policy)
    check_policy_for(spec, k=cfg.k, tree=cfg.tree, drafter=cfg.drafter)
    if spec.kind == "fixed":
        return None
    if spec.kind != "energy":
        return spec.build(cfg.k)
    from refspec.energy.model.hardware import cpu_profile
    from refspec.engine import EngineConfig
    from refspec.policy_energy import RooflineStepCost

    if not hasattr(drafter, "roofline_model"):
        raise UsageError(f"--spec-policy energy: drafter {cfg.drafter} has no roofline_model, so its draft cost "
                         f"cannot be predicted")
    target = session.target.model
    profile = session.roofline_profile or cpu_profile(session.dtype_bytes)
    cost = RooflineStepCost(target.args, profile, drafter=drafter.roofline_model(target.args),
                            dtype_bytes=session.dtype_bytes, verify_shape=target.forward_shape,
                            kv_bucket=EngineConfig().kv_bucket)
    prior = corpus_prior(cfg.model, cfg.drafter, cfg.corpus, cfg.temperature)
    source = "tau table" if prior is not None else "drafter"
    if prior is None:
        prior = float(getattr(drafter, "acceptance_prior", DEFAULT_PRIOR))
    measured = getattr(session.meter, "time_source", "wall_time") != "model"  # else the profile's own clock
    log.info("%s: energy policy on %s (%s time), acceptance prior %.2f (%s)", cfg.label, profile.name,
             "measured" if measured else "modelled", prior, source)
    return spec.build(cfg.k, cost=cost, prior=prior, measured=measured)


__all__ = ["build_policy", "check_policy_for", "checked_spec", "corpus_prior"]
