"""A configuration's record: its fields, the accounting's figures under them, the comparisons.

:func:`refspec.eval.run.run_configuration` reads back the ledger runs of its batches and pools
them with :func:`refspec.energy.accounting.pool_runs`; :func:`accounting_fields` copies that
:class:`~refspec.energy.accounting.Accounting` into the record under the record's field names and
computes nothing. The record also carries the roofline model's prediction of the same
configuration (:func:`roofline_prediction`, modelled, never measured) and the comparison with
the baseline at the same batch (:func:`compare_with_baseline`, whose saving and speed-up come
from the accounting too). The fields are :data:`RECORD_FIELDS`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from refspec.energy.accounting.headline import Accounting, energy_saving, speedup
from refspec.energy.ledger.format import experts_touched
from refspec.energy.ledger.writer import ensure_line_end
from refspec.eval.audit import FIELD_TEXT as _AUDIT_FIELD_TEXT, audit_fields
from refspec.eval.policy_report import FIELD_TEXT as _POLICY_FIELD_TEXT
from refspec.eval.prefill_work import FIELD_TEXT as _PREFILL_FIELD_TEXT, prefill_comparison
from refspec.eval.report_requests import FIELD_TEXT as _REQUEST_FIELD_TEXT, REQUEST_OUTPUT_TEXT

if TYPE_CHECKING:
    from refspec.eval.run import RunConfig, Session

log = logging.getLogger(__name__)

RECORD_VERSION = 3
READABLE_RECORD_VERSIONS = (2, 3)
"""Record versions the report reads: 2 lacks the serving fields (static lockstep batches only)."""

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
    "compiled_step": "verify ran through the opt-in torch.compile step (--compile)",
    "threads": "torch intra-op threads",
    # what ran
    "schedule": "continuous (B slots kept busy: a finished request's slot is refilled with the next request of "
                "the stream) | static (lockstep batches of B requests that drain)",
    "requests": "requests served N (default 4 x batch), one prompt each",
    "requests_unique": "distinct prompts among the requests: fewer than requests only when the corpus has fewer "
                       "(prose corpora are cut at several offsets first)",
    "request_rate": "open-loop Poisson arrivals per second on the engine clock (seeded by seed); null = closed "
                    "loop at concurrency batch",
    "prompts_unique": "distinct prompts (= requests_unique)", "rows": "requests decoded (= requests)",
    "batches": "ledger runs: 1 for continuous, ceil(N / B) lockstep batches for static",
    "max_new_tokens": "the budget cap N: every request's budget (the first token from prefill included) is at "
                      "most N",
    "output_lengths": "how the budgets were drawn below N (refspec.eval.requests.resolve_budgets): dist "
                      "(reference | uniform:R | fixed), reference_quantile and reference_scale_len (the corpus's "
                      "eval-reference length mapped to N, tokens), scale (the factor applied), and the budgets' "
                      "min, p50, max and mean",
    "stream_digest": "sha256 over every request's id, prompt, budget and arrival: a configuration and its "
                     "baseline served the same stream when theirs are equal",
    "run_ids": "ledger run ids, one per batch", "ledger": "ledger file name (in the output directory)",
    "request_outputs": "per request, in id order: {id, prompt (token ids fed to the engine), budget (its "
                       "max_new_tokens), arrival_s (null: closed loop), tokens (emitted, a final EOS included)}; "
                       "the same id is the same prompt and budget in a configuration and its baseline; "
                       + REQUEST_OUTPUT_TEXT,
    # the accounting of the batches pooled (refspec.energy.accounting.pool_runs), copied
    "emitted": "output tokens", "drafted": "draft tokens proposed", "accepted": "draft tokens accepted",
    "row_steps": "active row-steps with a verify", "steps": "decode steps, summed over batches",
    "verified": "target positions verified", "rejected_positions": "verified positions refuted",
    "total_time_s": "metered time (s)", "prefill_time_s": "prefill time (s)", "phase_time_s": "time by phase (s)",
    "tokens_per_s": "emitted tokens / metered time",
    "tau": "acceptance length: (accepted + row-steps) / row-steps, bonus token included",
    "acceptance_rate": "accepted / drafted", "rows_with_tpot": "requests that emitted at least two tokens",
    "tpot_p50_s": "p50 over requests of TPOT = (last - first token time) / (tokens - 1) on the engine clock (s)",
    "tpot_p99_s": "p99 of the same (s)",
    "ttft_p50_s": "p50 over requests of TTFT = first token time - arrival (queueing included; closed loop: "
                  "arrival = admission) (s)", "ttft_p99_s": "p99 of the same (s)",
    "itl_p50_s": "p50 of inter-token latency: gaps between successive emissions a streaming client sees (per "
                 "step, not per token), over every request (s)", "itl_p99_s": "p99 of the same (s)",
    "e2e_p50_s": "p50 over requests of end-to-end latency = last token time - arrival (s)",
    "e2e_p99_s": "p99 of the same (s)",
    "experts_touched_per_step": "mixture-of-experts target: distinct experts its verify forward routed to per "
                                "decode step, summed over MoE layers, mean over steps (ledger experts_touched); "
                                "null for a dense target",
    "draft_experts_touched_per_step": "the same for the draft phase's MoE forwards (a draft model of an MoE "
                                      "target); null when the drafter ran none",
    "mean_active_rows": "rows generating, time-weighted over every decode step of the run (drain lowers it)",
    "window_first_step": "first decode step of the steady-state window: the first with every slot busy "
                         "(null: empty window, or several static batches pooled, see window_bounds)",
    "window_last_step": "last decode step inside the window: the one before the first step with an empty slot "
                        "once the stream could no longer refill it (else the run's last step)",
    "window_bounds": "[first, last] decode step of each ledger run's window (null where empty)",
    "window_steps": "decode steps in the window", "window_s": "time of every phase in the window, refill "
                                                               "prefills included (s)",
    "window_tokens": "tokens emitted in the window (refill prefills' first tokens included)",
    "window_energy_j": "energy of every phase in the window (J)",
    "window_mean_active_rows": "rows generating, time-weighted over the window's decode steps",
    "window_tokens_per_s": "window_tokens / window_s",
    "window_note": "why the window is empty (null when it is not); its figures are then null",
    "total_energy_j": "energy of every phase (J); null without energy",
    "energy_per_token_j": "J per output token over the steady-state window: window energy / window tokens (null "
                          "when the window is empty); savings vs the baseline compare this",
    "energy_per_token_j_run": "J per output token over the whole run: all phases, prefill included, / emitted "
                              "(only accepted tokens count; ramp-up and drain included)",
    "phase_energy_j": "energy by phase (J)", "phase_share": "energy share by phase",
    "phase_energy_per_token_j": "energy by phase per output token (J)",
    "line_items_j": "prefill, draft kept/rejected, verify useful/rejected, commit, other (J)",
    "line_items_sum_j": "the line items added up (J)", "closure_error_j": "line items sum - total energy (J)",
    "rejected_energy_j": "J spent on refuted drafts", "closes": "line items sum to the total",
    "unattributed_energy_j": "a counter's energy no phase was given (host time outside every phase, the fit's "
                             "remainder): a line item of its own, so the parts close on the measured total (J)",
    "phase_energy_method": "how the phase split was obtained: modelled | measured-direct (a fine-grained meter) | "
                           "attributed-loops (phase-isolated loops) | attributed-fit (non-negative fit over "
                           "sub-windows) | measured-total-only (the counter's total, no split it can bear)",
    "phase_share_true": "simulated counter only: the true share of each phase (what attribution should recover)",
    "phase_share_naive": "simulated counter only: each phase's share as a counter read per phase would give it",
    "attribution": "the attribution's figures: fit and loop shares, their agreement, the additivity residual, "
                   "sub-windows, the fit's condition (refspec.energy.accounting)",
    "window_valid": "the steady-state window is long and full enough to trust (default: >= 20 s and mean active "
                    "rows >= 0.85 x batch; under a counter, at least two reads inside it)",
    "window_invalid_reason": "why the window is not valid (null when it is)",
    "idle_w": "idle power for net-of-idle figures (W)", "net_energy_j": "energy net of idle (J)",
    "net_energy_per_token_j": "J/token net of idle power over the whole run (null without idle power)",
    "energy_source": "ledger source string(s): measured:<counter> | modelled:roofline(<profile>) | none:time-only",
    "energy_measured": "true only when every figure came from an energy counter",
    "energy_source_text": "the source in words", "time_source": "wall-clock (timed) | modelled (roofline)",
    # comparisons and provenance
    "roofline": "analytic (modelled) J/token and TPOT of a steady-state step of the same configuration",
    "baseline": "the baseline's figures (config_id, tau, tokens_per_s, TPOT, J/token, source, phases)",
    "energy_saving_vs_baseline": "1 - J/token / baseline J/token (negative: speculation costs energy)",
    "speedup_vs_baseline": "tokens/s / baseline tokens/s",
    "same_stream_as_baseline": "the baseline served the same requests, budgets and arrivals (stream_digest "
                               "equal); null without a baseline or a digest",
    "greedy_match_baseline": "greedy outputs equal the baseline's token for token (null: not comparable)",
    "greedy_rows_matching": "rows whose output equals the baseline's",
    "acceptance_injected": "acceptance drawn from a recorded distribution: outputs are not the model's",
    "injection": "the injected model and its label (refspec.eval.injection.injection_record)",
    **_AUDIT_FIELD_TEXT,  # the per-request greedy audit (refspec.eval.audit)
    **_PREFILL_FIELD_TEXT,  # refill groups and prefill work per request (refspec.eval.prefill_work)
    **_POLICY_FIELD_TEXT,  # the speculation policy and the K it chose (refspec.eval.policy_report)
    **_REQUEST_FIELD_TEXT,  # energy and acceptance per request (refspec.eval.report_requests)
    "output_digest": "sha256 over every request's tokens", "row_digests": "sha256 prefix of each request's tokens",
    "versions": "refspec, Python and library versions",
    "cpu_gemm_plan": "the CPU GEMM form per dtype and row bucket the run's products took (calibrated on the machine)", "wall_s": "wall time of the configuration (s)",
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
    if source.startswith("modelled:simulated-counter("):
        inner = source[len("modelled:simulated-counter("):].rstrip(")")
        return f"simulated (not measured): a counter ({inner}) sampling the roofline's modelled energy"
    if source.startswith("none"):
        return "not recorded (time-only meter)"
    return f"unknown source {source!r}"


# ---- the accounting's figures under the record's names -------------------------------------
_RENAMED = {"j_per_token": "energy_per_token_j", "net_j_per_token": "net_energy_per_token_j",
            "phase_j_per_token": "phase_energy_per_token_j"}
_COPIED = ("emitted", "drafted", "accepted", "row_steps", "steps", "verified", "rejected_positions", "total_time_s",
           "prefill_time_s", "phase_time_s", "tokens_per_s", "tau", "acceptance_rate", "rows_with_tpot",
           "tpot_p50_s", "tpot_p99_s", "total_energy_j", "j_per_token", "phase_energy_j", "phase_share",
           "phase_j_per_token", "line_items_j", "line_items_sum_j", "closure_error_j", "rejected_energy_j",
           "closes", "idle_w", "net_energy_j", "net_j_per_token", "unattributed_energy_j", "phase_energy_method",
           "phase_share_true", "phase_share_naive", "attribution", "window_valid", "window_invalid_reason")


def _known(x: Any) -> Any:
    """None for NaN (records use JSON null for 'not available'; JSON has no NaN)."""
    return None if isinstance(x, float) and math.isnan(x) else x


def _serving_fields(acc: Accounting) -> dict[str, Any]:
    """The steady-state window, active rows and per-request latencies of ``acc`` (null where unknown)."""
    w = acc.window
    assert w is not None
    ratio = w.tokens / w.time_s if not w.empty and w.time_s > 0 else None
    return {
        "mean_active_rows": _known(acc.mean_active_rows), "window_first_step": w.first_step,
        "window_last_step": w.last_step, "window_bounds": [b and [b[0], b[1] - 1] for b in w.bounds],
        "window_steps": w.steps, "window_s": _known(w.time_s), "window_tokens": _known(w.tokens),
        "window_energy_j": _known(w.energy_j), "window_mean_active_rows": _known(w.mean_active_rows),
        "window_tokens_per_s": ratio, "window_note": w.note,
        **{f"{m}_p{q}_s": getattr(acc, f"{m}_p{q}_s") for m in ("ttft", "itl", "e2e") for q in (50, 99)},
        "energy_per_token_j": _known(acc.window_j_per_token),
        "energy_per_token_j_run": acc.j_per_token,
    }


def accounting_fields(acc: Accounting) -> dict[str, Any]:
    """The record fields of a (pooled) accounting: its figures renamed, its sources in words."""
    out = {_RENAMED.get(name, name): getattr(acc, name) for name in _COPIED}
    out.update(energy_source=", ".join(acc.sources), energy_measured=acc.measured,
               energy_source_text="; ".join(describe_source(s) for s in acc.sources))
    out.update(_serving_fields(acc))
    return out


# ---- the roofline prediction ----------------------------------------------------------------
def acceptance_from_tau(tau: float, k: int) -> float:
    """Per-draft acceptance a whose expected tokens per step (1 - a^(k+1)) / (1 - a) equal tau."""
    from refspec.energy.model.roofline import expected_tokens_per_step

    if k <= 0 or tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def _drafter_cost_model(drafter: Any, target_args: Any) -> tuple[bool, Any]:
    """The drafter's own roofline cost model, through its optional ``roofline_model`` method
    (:class:`refspec.drafting.Drafter`): ``(provided, DrafterModel or None)``, None for a free
    drafter that runs no forwards."""
    provide = getattr(drafter, "roofline_model", None)
    return (False, None) if provide is None else (True, provide(target_args))


def roofline_prediction(session: Session, cfg: RunConfig, drafter: Any, prompts: Sequence[Sequence[int]],
                        tau: float | None, budgets: Sequence[int] | None = None) -> dict[str, Any] | None:
    """The analytic (modelled) J/token and TPOT of a steady-state step of ``cfg``, or None.

    Context is the mean prompt length plus half the mean budget (``budgets``, else the cap); acceptance is the per-draft
    acceptance that reproduces the measured tau. Prefill is not part of the prediction. The
    drafter's cost is its own ``roofline_model`` (a plug-in drafter provides one the same way).
    """
    from refspec.energy.model.roofline import predict_step

    profile = session.roofline_profile
    if profile is None or cfg.tree:
        return None
    args = session.target.model.args
    provided, model = (True, None) if cfg.is_baseline else _drafter_cost_model(drafter, args)
    if not provided:
        return None  # a drafter without a cost model gets no prediction
    mean_budget = sum(budgets) / len(budgets) if budgets else cfg.max_new_tokens
    context = int(sum(map(len, prompts)) / len(prompts) + mean_budget / 2)
    a = acceptance_from_tau(tau or 1.0, cfg.k)
    p = predict_step(args, profile, batch=cfg.batch, k=cfg.k, context=context, acceptance=a,
                     dtype_bytes=session.dtype_bytes, drafter=model)
    label = None if cfg.is_baseline else (model.name if model is not None else "free")
    return {"j_per_token": p.j_per_token, "tpot_s": p.tpot_s, "tokens_per_row": p.tokens_per_row,
            "acceptance": a, "context": context, "verify_compute_bound": p.verify_compute_bound,
            "profile": profile.name, "drafter_model": label,
            "source": f"modelled:roofline({profile.name})", "includes_prefill": False}


# ---- comparison with the baseline -----------------------------------------------------------
def _digest(rows: Sequence[Sequence[int]]) -> tuple[str, list[str]]:
    per_row = [hashlib.sha256(json.dumps(list(r)).encode()).hexdigest()[:16] for r in rows]
    return hashlib.sha256("".join(per_row).encode()).hexdigest(), per_row


def compare_with_baseline(record: dict[str, Any], baseline: Mapping[str, Any] | None, *,
                          margin_fn: Any = None) -> None:
    """Fill ``record``'s baseline figures, saving, speed-up and greedy match (in place).

    ``margin_fn`` (:func:`refspec.eval.audit.margin_fn` of the target) classifies each request
    whose greedy output differs from the baseline's; without it they are counted only.
    """
    if record.get("drafter") == "none":  # the baseline itself: nothing to compare with
        record.update(baseline=None, energy_saving_vs_baseline=None, speedup_vs_baseline=None,
                      greedy_match_baseline=None, greedy_rows_matching=None, same_stream_as_baseline=None,
                      **audit_fields(record, None), **prefill_comparison(record, None))
        return
    if baseline is None:
        record.setdefault("baseline", None)
        record.setdefault("greedy_match_baseline", None)
        return
    fields = ("config_id", "tau", "tokens_per_s", "tpot_p50_s", "tpot_p99_s", "energy_per_token_j",
              "energy_source", "phase_energy_j", "phase_share", "net_energy_per_token_j", "run_ids")
    record["baseline"] = {f: baseline.get(f) for f in fields}
    digests = (record.get("stream_digest"), baseline.get("stream_digest"))
    record["same_stream_as_baseline"] = None if None in digests else digests[0] == digests[1]
    record.update(prefill_comparison(record, baseline))
    record["energy_saving_vs_baseline"] = energy_saving(record.get("energy_per_token_j"),
                                                        baseline.get("energy_per_token_j"))
    record["speedup_vs_baseline"] = speedup(record.get("tokens_per_s"), baseline.get("tokens_per_s"))
    comparable = record.get("greedy") and not record.get("acceptance_injected") and not baseline.get(
        "acceptance_injected")
    if comparable and baseline.get("row_digests") and record.get("row_digests"):
        pairs = list(zip(record["row_digests"], baseline["row_digests"]))
        record["greedy_rows_matching"] = sum(a == b for a, b in pairs)
        record["greedy_match_baseline"] = record["output_digest"] == baseline.get("output_digest")
    else:
        record["greedy_match_baseline"] = None
        record["greedy_rows_matching"] = None
    record.update(audit_fields(record, baseline if comparable else None, margin_fn))  # per request (eval/audit.py)



def experts_fields(records: Sequence[Mapping[str, Any]], run_ids: Sequence[str]) -> dict[str, Any]:
    """``experts_touched_per_step`` (verify) and ``draft_experts_touched_per_step`` from the
    ledger's phase records of ``run_ids`` (mean over the phase's records, null without any)."""
    runs = set(run_ids)
    out: dict[str, Any] = {}
    for key, phase in (("experts_touched_per_step", "verify"), ("draft_experts_touched_per_step", "draft")):
        phases = [r for r in records if r.get("kind") == "phase" and r.get("run_id") in runs
                  and r.get("phase") == phase]
        vals = [n for r in phases if (n := experts_touched(r)) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    return out


__all__ = ["RECORD_FIELDS", "experts_fields", "RECORD_VERSION", "READABLE_RECORD_VERSIONS", "accounting_fields", "acceptance_from_tau", "compare_with_baseline",
           "describe_source", "ensure_line_end", "roofline_prediction"]
