"""A configuration's record: its fields, and the figures computed from the ledger runs it wrote.

:func:`refspec.eval.run.run_configuration` reads back the ledger records of its batch runs
(:func:`ledger_records_since`); each batch run is accounted by :func:`refspec.energy.accounting.account`,
and the batches are pooled by :func:`pool_accountings` (sums of time, energy and counts;
J/token = energy / emitted tokens; TPOT percentiles over the rows of every batch; tau =
(accepted + row-steps) / row-steps). The record also carries the roofline model's prediction
of the same configuration (:func:`roofline_prediction`, modelled, never measured) and the
comparison with the baseline at the same batch (:func:`compare_with_baseline`). The fields are
:data:`RECORD_FIELDS`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from refspec.energy.accounting import Accounting

if TYPE_CHECKING:
    from refspec.eval.run import RunConfig, Session

log = logging.getLogger(__name__)

RECORD_VERSION = 1

RECORD_FIELDS: dict[str, str] = {
    # identity
    "record_version": "schema version of this record (int)",
    "status": '"ok" for a finished configuration',
    "config_id": "stable id of the configuration: <drafter>-k<K>-b<B>-<corpus>-<hash of config>",
    "config": "every setting that identifies the configuration (object, RunConfig fields)",
    "baseline_config_id": "config_id of the no-drafter configuration at the same batch and settings",
    "model": "model id or directory", "drafter": "drafter name; 'none' is the baseline", "k": "drafts per step",
    "tree": "EAGLE-2 dynamic tree (K is then the node budget)", "batch": "rows per batch B",
    "corpus": "corpus name or prompt file", "dtype": "fp32 | bf16 | fp16", "device": "torch device",
    "meter": "meter kind asked for", "temperature": "0 = greedy", "greedy": "greedy decoding (bool)",
    "seed": "seed of the sampling / injection generators", "cuda_graphs": "verify ran through CUDA graphs",
    "threads": "torch intra-op threads",
    # what ran
    "prompts_unique": "distinct prompts N", "rows": "rows decoded, ceil(N / B) * B (prompts repeat cyclically)",
    "batches": "batches run, ceil(N / B)", "max_new_tokens": "budget per row",
    "run_ids": "ledger run ids, one per batch", "ledger": "ledger file name (in the output directory)",
    # pooled accounting of the batches (refspec.energy.accounting, then pool_accountings)
    "emitted": "output tokens", "drafted": "draft tokens proposed", "accepted": "draft tokens accepted",
    "row_steps": "active row-steps with a verify", "steps": "decode steps, summed over batches",
    "verified": "target positions verified", "rejected_positions": "verified positions refuted",
    "total_time_s": "metered time (s)", "prefill_time_s": "prefill time (s)", "phase_time_s": "time by phase (s)",
    "tokens_per_s": "emitted tokens / metered time",
    "tau": "acceptance length: (accepted + row-steps) / row-steps, bonus token included",
    "acceptance_rate": "accepted / drafted", "rows_with_tpot": "rows that emitted at least two tokens",
    "tpot_p50_s": "p50 over rows of time per output token per user (s)", "tpot_p99_s": "p99 of the same (s)",
    "total_energy_j": "energy of every phase (J); null without energy",
    "energy_per_token_j": "J per output token: all phases, prefill included, / emitted (only accepted count)",
    "phase_energy_j": "energy by phase (J)", "phase_share": "energy share by phase",
    "line_items_j": "prefill, draft kept/rejected, verify useful/rejected, commit, other (J)",
    "rejected_energy_j": "J spent on refuted drafts", "closes": "line items sum to the total",
    "idle_w": "idle power for net-of-idle figures (W)", "net_energy_j": "energy net of idle (J)",
    "net_energy_per_token_j": "J/token net of idle power (null without idle power)",
    "energy_source": "ledger source string(s): measured:<counter> | modelled:roofline(<profile>) | none:time-only",
    "energy_measured": "true only when every figure came from an energy counter",
    "energy_source_text": "the source in words", "time_source": "measured (wall clock) | modelled (roofline)",
    # comparisons and provenance
    "roofline": "analytic (modelled) J/token and TPOT of a steady-state step of the same configuration",
    "baseline": "the baseline's figures (config_id, tau, tokens_per_s, TPOT, J/token, source, phases)",
    "energy_saving_vs_baseline": "1 - J/token / baseline J/token (negative: speculation costs energy)",
    "speedup_vs_baseline": "tokens/s / baseline tokens/s",
    "greedy_match_baseline": "greedy outputs equal the baseline's token for token (null: not comparable)",
    "greedy_rows_matching": "rows whose output equals the baseline's",
    "acceptance_injected": "acceptance drawn from a recorded distribution: outputs are not the model's",
    "injection": "the injected model and its label (refspec.eval.injection.injection_record)",
    "output_digest": "sha256 over every row's tokens", "row_digests": "sha256 prefix of each row's tokens",
    "versions": "refspec, Python and library versions", "wall_s": "wall time of the configuration (s)",
    "created_unix_s": "when it finished (s since the epoch)",
}
"""Fields of a configuration record, name -> description."""


def describe_source(source: str) -> str:
    """An energy source string in words, never presenting a model as a measurement."""
    if source.startswith("measured:"):
        return f"measured by counter {source.split(':', 1)[1]}"
    if source.startswith("modelled:roofline("):
        inner = source[len("modelled:roofline("):].rstrip(")")
        profile, _, mode = inner.partition(",")
        how = "on measured wall time" if mode == "wall-time" else "on modelled time"
        return f"modelled (not measured) by roofline profile {profile}, {how}"
    if source.startswith("none"):
        return "not recorded (time-only meter)"
    return f"unknown source {source!r}"


# ---- reading the ledger back ----------------------------------------------------------------
def ensure_line_end(path: Path) -> None:
    """Append a newline when ``path`` ends mid-line (a crash), so the next record starts clean."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
    except FileNotFoundError:
        return
    if last != b"\n":
        with open(path, "ab") as fh:
            fh.write(b"\n")


def ledger_records_since(path: Path, offset: int, run_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Ledger records of ``run_ids`` written at or after byte ``offset`` of ``path``."""
    wanted = set(run_ids)
    out = []
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read().decode("utf-8", errors="replace")
    for line in data.split("\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            log.warning("skipping a corrupt ledger line in %s", path)
            continue
        if isinstance(rec, dict) and rec.get("run_id") in wanted:
            out.append(rec)
    return out


# ---- pooling batch accountings --------------------------------------------------------------
def _sum_dicts(dicts: Sequence[Mapping[str, float] | None]) -> dict[str, float] | None:
    if any(d is None for d in dicts):
        return None
    out: dict[str, float] = {}
    for d in dicts:
        for key, value in (d or {}).items():
            out[key] = out.get(key, 0.0) + float(value)
    return out


def pool_accountings(accs: Sequence[Accounting]) -> dict[str, Any]:
    """Pool the accountings of a configuration's batches into its headline figures.

    Times, energies and counts add; J/token = energy / emitted; tokens/s = emitted / time;
    tau = (accepted + row-steps) / row-steps; TPOT percentiles are taken over the rows of all
    batches (linear interpolation, as in :mod:`refspec.energy.accounting`).
    """
    if not accs:
        raise ValueError("no batch accountings to pool")
    emitted = sum(a.emitted for a in accs)
    drafted = sum(a.drafted for a in accs)
    accepted = sum(a.accepted for a in accs)
    row_steps = sum(a.row_steps for a in accs)
    total_time = sum(a.total_time_s for a in accs)
    tpots = [t for a in accs for t in a.tpot_per_row_s if t is not None]
    energies = [a.total_energy_j for a in accs]
    has_energy = all(e is not None for e in energies)
    total_energy = float(sum(e for e in energies if e is not None)) if has_energy else None
    phase_energy = _sum_dicts([a.phase_energy_j for a in accs]) if has_energy else None
    net = [a.net_energy_j for a in accs]
    net_total = float(sum(n for n in net if n is not None)) if has_energy and all(n is not None for n in net) else None
    sources = sorted({s for a in accs for s in a.sources})
    return {
        "emitted": emitted, "drafted": drafted, "accepted": accepted, "row_steps": row_steps,
        "steps": sum(a.steps for a in accs),
        "verified": sum(a.verified for a in accs), "rejected_positions": sum(a.rejected_positions for a in accs),
        "total_time_s": total_time, "prefill_time_s": sum(a.prefill_time_s for a in accs),
        "phase_time_s": _sum_dicts([a.phase_time_s for a in accs]),
        "tokens_per_s": emitted / total_time if total_time else None,
        "tau": (accepted + row_steps) / row_steps if row_steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "rows_with_tpot": len(tpots),
        "tpot_p50_s": float(np.percentile(tpots, 50)) if tpots else None,
        "tpot_p99_s": float(np.percentile(tpots, 99)) if tpots else None,
        "total_energy_j": total_energy,
        "energy_per_token_j": total_energy / emitted if total_energy is not None and emitted else None,
        "phase_energy_j": phase_energy,
        "phase_share": ({p: e / total_energy for p, e in phase_energy.items()}
                        if phase_energy is not None and total_energy else None),
        "line_items_j": _sum_dicts([a.line_items_j for a in accs]) if has_energy else None,
        "rejected_energy_j": (sum(float(a.rejected_energy_j or 0.0) for a in accs) if has_energy else None),
        "closes": all(bool(a.closes) for a in accs) if has_energy else None,
        "idle_w": accs[0].idle_w,
        "net_energy_j": net_total,
        "net_energy_per_token_j": net_total / emitted if net_total is not None and emitted else None,
        "energy_source": ", ".join(sources),
        "energy_measured": all(a.measured for a in accs),
        "energy_source_text": "; ".join(describe_source(s) for s in sources),
    }


# ---- the roofline prediction ----------------------------------------------------------------
def acceptance_from_tau(tau: float, k: int) -> float:
    """Per-draft acceptance a whose expected tokens per step (1 - a^(k+1)) / (1 - a) equal tau."""
    from refspec.energy.roofline import expected_tokens_per_step

    if k <= 0 or tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def _drafter_cost_model(cfg: RunConfig, drafter: Any) -> Any:
    """The roofline's cost model of a drafter, or None when none fits."""
    from refspec.energy.roofline import EAGLE_HEAD, DrafterModel

    if cfg.drafter == "ngram":
        return DrafterModel(name="ngram", fraction=0.0)
    if cfg.drafter == "eagle":
        return EAGLE_HEAD
    if cfg.drafter == "eagle3":
        return DrafterModel(name="eagle3-1layer", layers=1, fc_inputs=3)
    if cfg.drafter == "block":
        layers = int(getattr(getattr(drafter, "head", None), "num_layers", 1) or 1)
        return DrafterModel(name="block", layers=layers, fc_inputs=0, parallel=True)
    args = getattr(getattr(drafter, "model", None), "args", None)
    if cfg.drafter == "draft-model" and args is not None:
        return DrafterModel(name="draft-model", args=args)
    return None


def roofline_prediction(session: Session, cfg: RunConfig, drafter: Any, prompts: Sequence[Sequence[int]],
                        tau: float | None) -> dict[str, Any] | None:
    """The analytic (modelled) J/token and TPOT of a steady-state step of ``cfg``, or None.

    Context is the mean prompt length plus half the budget; acceptance is the per-draft
    acceptance that reproduces the measured tau. Prefill is not part of the prediction.
    """
    from refspec.energy.roofline import predict_step

    profile = session.roofline_profile
    if profile is None or cfg.tree:
        return None
    model = _drafter_cost_model(cfg, drafter) if not cfg.is_baseline else None
    if not cfg.is_baseline and model is None:
        return None
    context = int(sum(map(len, prompts)) / len(prompts) + cfg.max_new_tokens / 2)
    a = acceptance_from_tau(tau or 1.0, cfg.k)
    kwargs = {"drafter": model} if model is not None else {}
    p = predict_step(session.target.model.args, profile, batch=cfg.batch, k=cfg.k, context=context, acceptance=a,
                     dtype_bytes=session.dtype_bytes, **kwargs)
    return {"j_per_token": p.j_per_token, "tpot_s": p.tpot_s, "tokens_per_row": p.tokens_per_row,
            "acceptance": a, "context": context, "verify_compute_bound": p.verify_compute_bound,
            "profile": profile.name, "drafter_model": getattr(model, "name", None),
            "source": f"modelled:roofline({profile.name})", "includes_prefill": False}


# ---- comparison with the baseline -----------------------------------------------------------
def _digest(rows: Sequence[Sequence[int]]) -> tuple[str, list[str]]:
    per_row = [hashlib.sha256(json.dumps(list(r)).encode()).hexdigest()[:16] for r in rows]
    return hashlib.sha256("".join(per_row).encode()).hexdigest(), per_row


def compare_with_baseline(record: dict[str, Any], baseline: Mapping[str, Any] | None) -> None:
    """Fill ``record``'s baseline figures, saving, speed-up and greedy match (in place)."""
    if record.get("drafter") == "none":  # the baseline itself: nothing to compare with
        record.update(baseline=None, energy_saving_vs_baseline=None, speedup_vs_baseline=None,
                      greedy_match_baseline=None, greedy_rows_matching=None)
        return
    if baseline is None:
        record.setdefault("baseline", None)
        record.setdefault("greedy_match_baseline", None)
        return
    fields = ("config_id", "tau", "tokens_per_s", "tpot_p50_s", "tpot_p99_s", "energy_per_token_j",
              "energy_source", "phase_energy_j", "phase_share", "net_energy_per_token_j", "run_ids")
    record["baseline"] = {f: baseline.get(f) for f in fields}
    e, be = record.get("energy_per_token_j"), baseline.get("energy_per_token_j")
    record["energy_saving_vs_baseline"] = 1.0 - e / be if e is not None and be else None
    s, bs = record.get("tokens_per_s"), baseline.get("tokens_per_s")
    record["speedup_vs_baseline"] = s / bs if s and bs else None
    comparable = record.get("greedy") and not record.get("acceptance_injected") and not baseline.get(
        "acceptance_injected")
    if comparable and baseline.get("row_digests") and record.get("row_digests"):
        pairs = list(zip(record["row_digests"], baseline["row_digests"]))
        record["greedy_rows_matching"] = sum(a == b for a, b in pairs)
        record["greedy_match_baseline"] = record["output_digest"] == baseline.get("output_digest")
    else:
        record["greedy_match_baseline"] = None
        record["greedy_rows_matching"] = None
