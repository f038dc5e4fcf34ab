"""The figures a run record carries, taken from the accounting and the ledger; nothing computed twice.

:func:`accounting_sections` copies a pooled :class:`~refspec.energy.accounting.headline.Accounting`
into the record's sections under the record's names; :func:`work_section` reads the refill
groups, prefill work, experts touched and the K a policy chose from the ledger records of the
configuration; :func:`request_figures` splits the energy among the requests
(:func:`refspec.energy.accounting.per_request.split_energy`), checks each request's acceptance against the
ledger and takes its latencies from the accounting (``Accounting.requests``, computed once by
:mod:`refspec.energy.accounting.serving_window`). :func:`roofline_figures` gives the analytic
(modelled, never measured) J/token and TPOT of a steady-state step of the same configuration.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

from refspec.energy.accounting.headline import Accounting
from refspec.energy.ledger.format import experts_touched
from refspec.energy.accounting.per_request import (PARTS, pooled_acceptance, request_acceptance, split_energy, split_profile)
from refspec.energy.accounting.serving_window import percentile
from refspec.eval.acceptance_models import acceptance_from_tau
from refspec.eval.prefill_work import prefill_fields
from refspec.eval.record import (Counts, Energy, Latency, PerRequest, RequestOutput, RunFigures, WindowFigures,
                                 Work)

log = logging.getLogger(__name__)
Record = Mapping[str, Any]


def _known(x: Any) -> Any:
    """None for NaN (records use JSON null for 'not available'; JSON has no NaN)."""
    return None if isinstance(x, float) and math.isnan(x) else x


def accounting_sections(acc: Accounting) -> dict[str, Any]:
    """The record sections of a (pooled) accounting: ``counts``, ``run``, ``window``, ``latency``, ``energy``."""
    w = acc.window
    assert w is not None
    counts = Counts(drafted=acc.drafted, accepted=acc.accepted, row_steps=acc.row_steps, steps=acc.steps,
                    verified=acc.verified, rejected_positions=acc.rejected_positions,
                    prefill_time_s=acc.prefill_time_s, phase_time_s=acc.phase_time_s, tau=acc.tau,
                    acceptance_rate=acc.acceptance_rate)
    run = RunFigures(tokens=acc.emitted, time_s=acc.total_time_s, energy_j=acc.total_energy_j,
                     tokens_per_s=acc.tokens_per_s, mean_active_rows=_known(acc.mean_active_rows),
                     j_per_token=acc.j_per_token, net_energy_j=acc.net_energy_j, net_j_per_token=acc.net_j_per_token)
    window = WindowFigures(first_step=w.first_step, last_step=w.last_step,
                           bounds=tuple(b and [b[0], b[1] - 1] for b in w.bounds), steps=w.steps,
                           time_s=_known(w.time_s), tokens=_known(w.tokens), energy_j=_known(w.energy_j),
                           mean_active_rows=_known(w.mean_active_rows),
                           tokens_per_s=w.tokens / w.time_s if not w.empty and w.time_s > 0 else None,
                           j_per_token=_known(acc.window_j_per_token), note=w.note, valid=acc.window_valid,
                           invalid_reason=acc.window_invalid_reason)
    latency = Latency(rows_with_tpot=acc.rows_with_tpot, tpot_p50_s=acc.tpot_p50_s, tpot_p99_s=acc.tpot_p99_s,
                      **{f"{m}_p{q}_s": getattr(acc, f"{m}_p{q}_s") for m in ("ttft", "itl", "e2e") for q in (50, 99)})
    energy = Energy(energy_source=", ".join(acc.sources), energy_measured=acc.measured,
                    energy_source_text="; ".join(describe_source(s) for s in acc.sources), idle_w=acc.idle_w,
                    phase_energy_j=acc.phase_energy_j, phase_share=acc.phase_share,
                    phase_j_per_token=acc.phase_j_per_token, line_items_j=acc.line_items_j,
                    line_items_sum_j=acc.line_items_sum_j, closure_error_j=acc.closure_error_j,
                    rejected_energy_j=acc.rejected_energy_j, closes=acc.closes,
                    unattributed_energy_j=acc.unattributed_energy_j, phase_energy_method=acc.phase_energy_method,
                    phase_share_true=acc.phase_share_true, phase_share_naive=acc.phase_share_naive,
                    attribution=acc.attribution)
    return {"counts": counts, "run": run, "window": window, "latency": latency, "energy": energy}


def describe_source(source: str) -> str:
    """An energy source string in words, never presenting a model as a measurement."""
    if source.startswith("measured:"):
        return f"measured by counter {source.split(':', 1)[1]}"
    if source.startswith("modelled:roofline("):
        inner = source[len("modelled:roofline("):].rstrip(")")
        profile, _, mode = inner.partition(",")
        how = "on measured wall time" if mode == "wall-time" else "on modelled time"
        return f"modelled (not measured) by roofline profile {profile}, {how}"
    if source.startswith("modelled:simulated-counter("):
        inner = source[len("modelled:simulated-counter("):].rstrip(")")
        return f"simulated (not measured): a counter ({inner}) sampling a simulated device's power law"
    if source.startswith("none"):
        return "not recorded (time-only meter)"
    return f"unknown source {source!r}"


# ---- the ledger's work -----------------------------------------------------------------------
def _phases(records: Iterable[Record], run_ids: Sequence[str], phase: str) -> list[Record]:
    runs = set(run_ids)
    return [r for r in records if r.get("kind") == "phase" and r.get("run_id") in runs and r.get("phase") == phase]


def k_steps(records: Iterable[Record], run_ids: Sequence[str]) -> tuple[dict[str, int], float | None]:
    """Decode steps per K a policy chose (the ``k`` of each verify record), and their mean K."""
    counts: dict[int, int] = defaultdict(int)
    for rec in _phases(records, run_ids, "verify"):
        counts[int(rec.get("k") or 0)] += 1
    steps = sum(counts.values())
    return {str(k): counts[k] for k in sorted(counts)}, (sum(k * n for k, n in counts.items()) / steps if steps
                                                         else None)


def _experts(records: Sequence[Record], run_ids: Sequence[str], phase: str) -> float | None:
    """Mean distinct experts a phase's MoE forwards routed to per record (None without any)."""
    vals = [n for r in _phases(records, run_ids, phase) if (n := experts_touched(r)) is not None]
    return sum(vals) / len(vals) if vals else None


def work_section(records: Sequence[Record], run_ids: Sequence[str], prompt_lengths: Sequence[int]) -> Work:
    """Refill groups and prefill work (:mod:`refspec.eval.prefill_work`), experts touched per step
    (verify, and draft for a draft model of an MoE target) and the K chosen per step."""
    ks, k_mean = k_steps(records, run_ids)
    return Work(**prefill_fields(records, run_ids, prompt_lengths), experts_touched_per_step=_experts(
        records, run_ids, "verify"), draft_experts_touched_per_step=_experts(records, run_ids, "draft"),
        k_steps=ks, k_mean=k_mean)


# ---- per request -------------------------------------------------------------------------------
def _split(ledger: Sequence[Record], run_ids: Sequence[str], phases: Sequence[Record], profile: Any) -> Any:
    """The energy split per request, or None under a time-only meter or when the phase split failed
    its gate (acceptance and latencies only: no request is charged from a split that was withheld)."""
    runs = set(run_ids)
    has_energy = any(r.get("energy_j") is not None for r in phases) or any(
        r.get("kind") == "counter" and r.get("run_id") in runs for r in ledger)
    split = split_energy(ledger, run_ids, split_profile(profile, {str(r["source"]) for r in phases})) \
        if has_energy else None
    return None if split is not None and split.method == "measured-total-only" else split


def request_figures(ledger: Sequence[Record], acc: Accounting, results: Sequence[Any],
                    asked: Sequence[RequestOutput], *,
                    profile: Any = None) -> tuple[PerRequest, tuple[RequestOutput, ...]]:
    """Each request's energy, acceptance and latencies, and the configuration's summary of them.

    Args:
        ledger: the configuration's ledger records, read back from disk.
        acc: their pooled accounting (its runs are the configuration's).
        results: the engine's ``ServeResult`` of each run (per-request accepted drafts per step).
        asked: each request as served (id, prompt, budget, arrival, tokens).
        profile: the hardware profile of the split's proportions (default: the meter's, see
            :func:`refspec.energy.accounting.per_request.split_profile`).

    Raises:
        refspec.energy.accounting.per_request.PerRequestError: the engine's counts disagree with the ledger.
    """
    run_ids = [r for r in acc.run_ids if r is not None]
    phases = [r for r in ledger if r.get("kind") == "phase" and r.get("run_id") in set(run_ids)]
    acceptance = request_acceptance(ledger, run_ids, {q.id: list(q.accepted_per_step) for res in results
                                                      for q in res.requests})
    k_max = max((int(r.get("k", 0) or 0) for r in phases), default=0)
    times = {q.id: q for q in acc.requests}
    split = _split(ledger, run_ids, phases, profile)
    outputs = []
    for o in asked:
        a, t = acceptance[o.id], times[o.id]
        e = split.requests.get(o.id) if split is not None else None
        energy = None if split is None else (e.energy_j if e else 0.0)
        acc_pos, offered = a.position_counts(k_max)
        outputs.append(RequestOutput(
            id=o.id, prompt=o.prompt, budget=o.budget, arrival_s=o.arrival_s, tokens=o.tokens, output_tokens=t.tokens,
            energy_j=energy, j_per_token=None if energy is None else energy / t.tokens,
            energy_by_phase_j=None if split is None else dict(e.by_phase_j if e else {}),
            energy_by_part_j=None if split is None else dict(e.by_part_j if e else dict.fromkeys(PARTS, 0.0)),
            verify_steps=a.verify_steps, accepted_per_step=tuple(a.accepted_per_step),
            accepted_hist=tuple(a.histogram(k_max)),
            acceptance_per_position=tuple(x / n if n else None for x, n in zip(acc_pos, offered)),
            acceptance_length=a.acceptance_length, ttft_s=t.ttft_s, tpot_s=t.tpot_s, e2e_s=t.e2e_s))
    pooled = pooled_acceptance(acceptance.values(), k_max)
    summary = dict(acceptance_hist=tuple(pooled["histogram"]), acceptance_per_position=tuple(pooled["per_position"]),
                   acceptance_tau_from_positions=pooled["tau"])
    if split is None:
        return PerRequest(**summary), tuple(outputs)
    energies = [o.energy_j for o in outputs]
    per_token = [o.j_per_token for o in outputs]
    lost = sum(split.unattributed_j.values())
    if not split.closes:
        log.warning("runs %s: per-request energy does not close: requests %.6g J + unattributed %.6g J vs total "
                    "%.6g J", run_ids, sum(energies), lost, split.total_j)
    return PerRequest(
        **summary, request_energy_p50_j=percentile(energies, 50), request_energy_p99_j=percentile(energies, 99),
        request_j_per_token_p50=percentile(per_token, 50), request_j_per_token_p99=percentile(per_token, 99),
        request_energy_sum_j=sum(energies), request_unattributed_j=dict(split.unattributed_j),
        request_unattributed_share=lost / split.total_j if split.total_j else None,
        request_closure_error_j=split.closure_error_j, request_energy_closes=split.closes,
        request_split_profile=split.profile), tuple(outputs)


# ---- the roofline prediction ----------------------------------------------------------------
def roofline_figures(args: Any, profile: Any, *, batch: int, k: int, drafter_model: Any,
                     prompts: Sequence[Sequence[int]], tau: float | None, budgets: Sequence[int],
                     dtype_bytes: int) -> dict[str, Any]:
    """The analytic (modelled) J/token and TPOT of a steady-state step of a configuration.

    Context is the mean prompt length plus half the mean budget; acceptance is the per-draft
    acceptance that reproduces the measured tau (:func:`refspec.eval.acceptance_models.acceptance_from_tau`).
    Prefill is not part of the prediction. ``drafter_model`` is the drafter's own cost model
    (its ``roofline_model``; None for a free drafter or the baseline).
    """
    from refspec.energy.model.roofline import predict_step

    context = int(sum(map(len, prompts)) / len(prompts) + sum(budgets) / len(budgets) / 2)
    a = acceptance_from_tau(tau or 1.0, k)
    p = predict_step(args, profile, batch=batch, k=k, context=context, acceptance=a, dtype_bytes=dtype_bytes,
                     drafter=drafter_model)
    label = None if k == 0 else (drafter_model.name if drafter_model is not None else "free")
    return {"j_per_token": p.j_per_token, "tpot_s": p.tpot_s, "step_time_s": p.step_time_s, "tokens_per_row": p.tokens_per_row,
            "acceptance": a, "context": context, "verify_compute_bound": p.verify_compute_bound,
            "profile": profile.name, "drafter_model": label,
            "source": f"modelled:roofline({profile.name})", "includes_prefill": False}


__all__ = ["describe_source", "accounting_sections", "work_section", "k_steps", "request_figures", "roofline_figures"]
