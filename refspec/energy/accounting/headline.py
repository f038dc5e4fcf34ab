"""Headline measures of a run, or of several runs of one configuration, from ledger records alone.

This module is the one home of the arithmetic: reports, sweeps, the CLI table and the engine's
:attr:`Generation.tau` read what it returns and compute none of these figures themselves.
:func:`account` accounts one run of a ledger (:func:`refspec.energy.ledger.read.read_ledger`);
:func:`pool_runs` accounts several runs of one configuration (its batches) as one, with the
same definitions. Definitions:

Per step
    Counts (drafted, accepted, emitted, verified, rows_active, emitted_per_row) are taken as the
    maximum over the step's records, so a count may be written on one phase record or repeated
    on several. ``rows_active`` comes from the verify record when there is one. A step's time is
    the sum of its records' times (phases do not overlap). A (step, phase) pair appears at most
    once per run.

Only accepted tokens count
    J per output token = total energy (all phases, prefill included) / tokens emitted (all
    records, prefill's first token included). Rejected drafts earn nothing.

J per verified token
    verify-phase energy / verified positions: what one target position costs.

Energy on rejected drafts
    A chain verify of K drafts computes K + 1 positions per active row; the accepted drafts and
    the position that yields the bonus (or recovered) token are useful, the rest were refuted:
    ``rejected positions = verified - accepted - rows_active`` per step (for a tree the same
    formula counts every off-path node). Verify energy is split in proportion to positions:
    ``verify rejected J = verify J x rejected / verified``, per step, then summed. Likewise
    ``draft rejected J = draft J x (drafted - accepted) / drafted``: the share of draft energy
    spent proposing tokens that were not accepted. Tokens cut by EOS or a budget after
    acceptance are not counted as rejected (they appear as accepted + rows_active - emitted).

Line items and closure
    prefill, draft (kept), draft (rejected), verify (useful), verify (rejected), commit and
    other must sum to the total energy; ``closes`` says whether they do within 1e-9 relative.

Gross and net of idle
    net = gross - idle W x time, for the run and per phase. Idle power is passed in or read from
    the run header (measured on a GPU, the profile's value when modelled).

Throughput, TPOT and tau
    tokens/s = emitted / total time. TPOT, TTFT, ITL and end-to-end latency are per request,
    from its emissions on the engine clock (:mod:`refspec.energy.accounting.serving_window`): the first
    token comes from prefill and its latency is TTFT, not TPOT; requests with fewer than two
    tokens have no TPOT. p50 / p99 are linear-interpolated percentiles across requests.
    tau (acceptance length) =
    (accepted + bonus) / row-steps = (sum accepted + sum rows_active) / sum rows_active over
    steps with a verify, i.e. the mean of accepted + 1 per active row per step.

Steady state and active rows
    :mod:`refspec.energy.accounting.serving_window` defines the steady-state window (its bounds, time,
    energy, tokens, J/token, mean active rows) and the run's mean active rows (time-weighted
    over decode steps). ``j_per_token`` is the whole run's; ``window_j_per_token`` the window's.
    Refill prefills (step >= 0) are prefill groups of their own, never merged with the counts
    of the decode step that carries the same index.

Pooling
    Runs of one configuration pool by adding their steps (and their windows): counts, times and energies add, TPOT
    percentiles are taken over the rows of every run, and every ratio above is formed from the
    pooled sums. The runs must agree on idle power.

Comparisons
    energy saving vs a baseline = 1 - J/token / baseline J/token (negative: a loss); speed-up =
    tokens/s / baseline tokens/s.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from refspec.energy.accounting.serving_window import (RequestTimes, Window, WindowRule, latency_percentiles,
                                                      mean_active_rows, percentile, pool_windows, request_times,
                                                      run_window, window_validity)
from refspec.energy.ledger.read import unfinished_runs
from refspec.energy.ledger.step_groups import COUNTS, AccountingError, Record, Step, group_steps
from refspec.energy.accounting.phase_energy import PhaseEnergy, phase_energy, shares
from refspec.energy.accounting.split_gate import total_reason

LINE_ITEMS = ("prefill", "draft_kept", "draft_rejected", "verify_useful", "verify_rejected", "commit", "other",
              "unattributed")
CLOSURE_RTOL = 1e-9
ENERGY_FIELDS = ("total_energy_j", "j_per_token", "j_per_verified_token", "phase_energy_j", "phase_share",
                 "phase_j_per_token", "line_items_j", "line_items_sum_j", "rejected_energy_j", "rejected_share",
                 "verify_rejected_j", "draft_rejected_j", "draft_rejected_share", "closure_error_j", "closes",
                 "net_energy_j", "net_j_per_token", "net_phase_energy_j", "unattributed_energy_j")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accounting:
    """Headline measures of one run or of pooled runs (the module docstring defines each).

    Energies are in J, powers in W, times in s. Energy fields are None when the ledger holds
    no energy (time-only meter); net fields are None without an idle power.
    """

    run_ids: tuple[str | None, ...]
    labels: dict[str, Any]
    sources: tuple[str, ...]
    measured: bool
    batch: int
    steps: int
    rows_with_tpot: int
    emitted: int
    drafted: int
    accepted: int
    verified: int
    rejected_positions: int
    row_steps: int
    total_time_s: float
    prefill_time_s: float
    decode_time_s: float
    phase_time_s: dict[str, float]
    tokens_per_s: float | None
    tau: float | None
    acceptance_rate: float | None
    tpot_per_row_s: tuple[float | None, ...]
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    total_energy_j: float | None
    j_per_token: float | None
    j_per_verified_token: float | None
    phase_energy_j: dict[str, float] | None
    phase_share: dict[str, float] | None
    phase_j_per_token: dict[str, float] | None
    line_items_j: dict[str, float] | None
    line_items_sum_j: float | None
    rejected_energy_j: float | None
    rejected_share: float | None
    verify_rejected_j: float | None
    draft_rejected_j: float | None
    draft_rejected_share: float | None
    closure_error_j: float | None
    closes: bool | None
    idle_w: float | None
    net_energy_j: float | None
    net_j_per_token: float | None
    net_phase_energy_j: dict[str, float] | None
    unattributed_energy_j: float | None = None
    phase_energy_method: str | None = None
    phase_share_true: dict[str, float] | None = None
    phase_share_naive: dict[str, float] | None = None
    attribution: dict[str, Any] | None = None
    window_valid: bool = False
    window_invalid_reason: str | None = None
    mean_active_rows: float = math.nan
    window: Window | None = None
    requests: tuple[RequestTimes, ...] = ()
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None

    @property
    def run_id(self) -> str | None:
        """The run's id; None when several runs are pooled."""
        return self.run_ids[0] if len(self.run_ids) == 1 else None

    @property
    def window_j_per_token(self) -> float | None:
        """J/token over the steady-state window (NaN when it is empty, None without energy)."""
        return None if self.window is None else self.window.j_per_token


# ---- the definitions every caller shares ---------------------------------------------------
def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def acceptance_length(accepted: int, row_steps: int) -> float | None:
    """tau = (accepted + row_steps) / row_steps: accepted + bonus per active row-step; None without one."""
    return (accepted + row_steps) / row_steps if row_steps else None


def tau_of_steps(accepted_per_step: Iterable[Iterable[int]]) -> float:
    """tau of per-step, per-row accepted counts ([steps][B], -1 where a row was done); NaN without an active row."""
    active = [a for step in accepted_per_step for a in step if a >= 0]
    tau = acceptance_length(sum(active), len(active))
    return math.nan if tau is None else tau


def energy_saving(j_per_token: float | None, baseline_j_per_token: float | None) -> float | None:
    """1 - J/token / baseline J/token (negative: speculation costs energy); None when either is missing."""
    ratio = _ratio(j_per_token, baseline_j_per_token)
    return None if ratio is None else 1.0 - ratio


def speedup(tokens_per_s: float | None, baseline_tokens_per_s: float | None) -> float | None:
    """tokens/s / baseline tokens/s; None when either is missing or zero."""
    return _ratio(tokens_per_s, baseline_tokens_per_s) if tokens_per_s else None


# ---- one step of one run -------------------------------------------------------------------
def _line_items(st: Step) -> dict[str, float]:
    """The step's energy split into :data:`LINE_ITEMS` (J)."""
    items = dict.fromkeys(LINE_ITEMS, 0.0)
    drafted, accepted, verified = st.counts["drafted"], st.counts["accepted"], st.counts["verified"]
    for r in st.records:
        e = float(r["energy_j"])
        if r["phase"] == "verify":
            bad = e * st.rejected / verified if verified else 0.0
            items["verify_rejected"] += bad
            items["verify_useful"] += e - bad
        elif r["phase"] == "draft":
            bad = e * max(drafted - accepted, 0) / drafted if drafted else 0.0
            items["draft_rejected"] += bad
            items["draft_kept"] += e - bad
        elif r["phase"] in ("prefill", "commit"):
            items[r["phase"]] += e
        else:
            items["other"] += e
    return items


# ---- accounting ----------------------------------------------------------------------------
def _sum_by(records: Iterable[Record], field: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for r in records:
        out[str(r["phase"])] += float(r[field])
    return dict(out)


def _energy(pe: PhaseEnergy, steps: Sequence[Step], emitted: int, verified: int,
            phase_time: Mapping[str, float], idle_w: float | None, total_time: float) -> dict[str, Any]:
    """Every energy field of :class:`Accounting` (each phase record holding its energy, read or attributed)."""
    phases = [r for run in pe.records for r in run]
    total = float(pe.total_j)  # type: ignore[arg-type]
    phase_energy = _sum_by(phases, "energy_j")
    items = dict.fromkeys(LINE_ITEMS, 0.0)
    for st in steps:
        for name, e in _line_items(st).items():
            items[name] += e
    items["unattributed"] = pe.unattributed_j  # what no phase record was given: the parts close on the total
    items_sum = sum(items.values())
    rejected = items["verify_rejected"] + items["draft_rejected"]
    withheld_split = pe.method == "measured-total-only"  # a split that failed its gate: no shares to show
    out = dict.fromkeys(ENERGY_FIELDS)
    out.update(
        total_energy_j=total, j_per_token=_ratio(total, emitted),
        j_per_verified_token=_ratio(phase_energy.get("verify", 0.0), verified),
        phase_energy_j=phase_energy, phase_share=None if withheld_split else shares(phase_energy),
        phase_j_per_token=({p: e / emitted for p, e in phase_energy.items()} if emitted and not withheld_split
                           else None),
        line_items_j=items, line_items_sum_j=items_sum, unattributed_energy_j=pe.unattributed_j,
        rejected_energy_j=rejected, rejected_share=_ratio(rejected, total),
        verify_rejected_j=items["verify_rejected"], draft_rejected_j=items["draft_rejected"],
        draft_rejected_share=_ratio(items["draft_rejected"], phase_energy.get("draft", 0.0)),
        closure_error_j=items_sum - total, closes=abs(items_sum - total) <= CLOSURE_RTOL * max(1.0, abs(total)))
    if idle_w is not None:
        net = total - idle_w * (total_time if pe.span_s is None else pe.span_s)  # a counter's span holds host time
        out.update(net_energy_j=net, net_j_per_token=_ratio(net, emitted),
                   net_phase_energy_j={p: e - idle_w * phase_time[p] for p, e in phase_energy.items()})
    return out


def _attribution(pe: PhaseEnergy) -> dict[str, Any] | None:
    """The attribution's figures, JSON-ready (None for a direct read)."""
    if not pe.sub_windows:
        return None
    fit = pe.fit
    return {"method": pe.method, "sub_windows": len(pe.sub_windows), "measured_j": pe.total_j, "span_s": pe.span_s,
            "unattributed_j": pe.unattributed_j, "fit_power_w": fit.power_w if fit else None,
            "fit_share": pe.share_fit, "fit_relative_residual": fit.relative_residual if fit else None,
            "fit_condition": pe.fit_condition, "fit_share_se": pe.fit_share_se, "fit_determined": pe.fit_determined,
            "loops_j_per_call": {p: lp.j_per_step for p, lp in pe.loops.items()} or None,
            "loops_share": pe.share_loops, "agreement": pe.agreement, "additivity_residual": pe.additivity_residual,
            "interaction_residual": pe.interaction_residual, "interaction_points": pe.interaction_points,
            "host_s": pe.host_s, "host_j": pe.host_j, "total_unresolved": total_reason(pe.span_s, pe.period_s),
            "split_gate": pe.split_gate.as_dict() if pe.split_gate is not None else None,
            "true_total_j": pe.true_total_j,
            "total_error_vs_true": None if not pe.true_total_j else float(pe.total_j) / pe.true_total_j - 1.0}


def _accounting(runs: Sequence[_Run], idle_w: float | None, rule: WindowRule) -> Accounting:
    """The :class:`Accounting` of ``runs`` taken together."""
    try:
        pe = phase_energy([(r.phases, r.counters, r.loops) for r in runs], host_w=idle_w)
    except ValueError as exc:
        raise AccountingError(f"runs {[r.run_id for r in runs]}: {exc}") from None
    phases = [r for run in pe.records for r in run]
    per_run = [group_steps(r.run_id, ps) for r, ps in zip(runs, pe.records)]
    steps = [st for run in per_run for st in run]
    total = {f: sum(st.counts[f] for st in steps) for f in COUNTS}
    row_steps = sum(st.rows_active for st in steps if st.has_verify)
    total_time = sum(st.time_s for st in steps)
    prefill_time = sum(st.time_s for st in steps if st.prefill)
    phase_time = _sum_by(phases, "time_s")
    reqs = [q for r, run in zip(runs, per_run) for q in request_times(run, r.run_id)]
    tpots = [q.tpot_s for q in reqs]
    valid = [t for t in tpots if t is not None]
    energy = (_energy(pe, steps, total["emitted"], total["verified"], phase_time, idle_w, total_time)
              if pe.total_j is not None else dict.fromkeys(ENERGY_FIELDS))
    sources = tuple(sorted({str(r["source"]) for r in phases}))
    label_sets = [dict((r.header or {}).get("labels") or {}) for r in runs]
    labels = {k: v for k, v in label_sets[0].items() if all(k in s and s[k] == v for s in label_sets)}
    batch = max(int(r["batch"]) for r in phases)
    window = pool_windows([run_window(run, r.counters) for r, run in zip(runs, per_run)])
    window_ok, why = window_validity(window, batch, rule, counter=bool(pe.sub_windows),
                                     measured=any(s.startswith("measured") for s in sources))
    return Accounting(
        run_ids=tuple(r.run_id for r in runs), labels=labels, sources=sources,
        measured=all(s.startswith("measured") for s in sources), batch=batch,
        steps=sum(1 for st in steps if st.decode), rows_with_tpot=len(valid), **total,
        rejected_positions=sum(st.rejected for st in steps), row_steps=row_steps,
        total_time_s=total_time, prefill_time_s=prefill_time, decode_time_s=total_time - prefill_time,
        phase_time_s=phase_time, tokens_per_s=_ratio(total["emitted"], total_time),
        tau=acceptance_length(total["accepted"], row_steps),
        acceptance_rate=_ratio(total["accepted"], total["drafted"]),
        tpot_per_row_s=tuple(tpots), tpot_p50_s=percentile(valid, 50), tpot_p99_s=percentile(valid, 99),
        idle_w=idle_w, **energy, phase_energy_method=pe.method, phase_share_true=pe.share_true,
        phase_share_naive=pe.share_naive, attribution=_attribution(pe), window_valid=window_ok,
        window_invalid_reason=why, mean_active_rows=mean_active_rows(steps), window=window, requests=tuple(reqs),
        **{k: v for k, v in latency_percentiles(reqs).items() if not k.startswith("tpot")})


class _Run(NamedTuple):
    run_id: str | None
    header: dict[str, Any] | None
    phases: list[Record]
    counters: list[Record]
    loops: list[Record]


def _run(records: Sequence[Record], run_id: str | None) -> _Run:
    header = next((dict(r) for r in records if r.get("kind") == "run" and r.get("run_id") == run_id), None)
    mine = [r for r in records if r.get("run_id") == run_id]
    phases = [r for r in mine if r.get("kind") == "phase"]
    if run_id in (gone := unfinished_runs(records)):  # a partial run would count a fraction of a generation
        raise AccountingError(f"run {run_id!r} did not finish ({gone[run_id]}); its records are not counted")
    if not phases:
        raise AccountingError(f"no phase records for run {run_id!r}")
    return _Run(run_id, header, phases, [r for r in mine if r.get("kind") == "counter"],
                [r for r in mine if r.get("kind") == "loop"])


def _idle_w(runs: Sequence[_Run]) -> float | None:
    values = {(r.header or {}).get("idle_w") for r in runs}
    if len(values) > 1:
        raise AccountingError(f"runs {[r.run_id for r in runs]} disagree on idle power {sorted(values, key=str)}; "
                              f"pass idle_w= to account them together")
    return values.pop()


def account(records: Iterable[Record], *, run_id: str | None = None, idle_w: float | None = None,
            min_window_s: float = WindowRule.min_s, min_window_fill: float = WindowRule.min_fill) -> Accounting:
    """Compute the :class:`Accounting` of one run from its ledger records.

    Args:
        records: ledger records (run header, phase, counter and loop records), e.g. from ``read_ledger``.
        run_id: the run to account when the records hold several.
        idle_w: idle power in W; default: the run header's ``idle_w``.
        min_window_s: shortest valid steady-state window, s.
        min_window_fill: least valid mean active rows of the window, as a fraction of the batch.

    Returns:
        The run's :class:`Accounting`.

    Raises:
        AccountingError: no phase records, several runs and no ``run_id``, or a (step, phase)
            that appears twice in the run.
    """
    records = list(records)
    if run_id is None:
        ids = list(dict.fromkeys(r.get("run_id") for r in records))
        if len(ids) > 1:
            raise AccountingError(f"the records hold {len(ids)} runs {ids}; pass run_id= to pick one")
        run_id = ids[0] if ids else None
    return pool_runs(records, [run_id], idle_w=idle_w, min_window_s=min_window_s, min_window_fill=min_window_fill)


def pool_runs(records: Iterable[Record], run_ids: Sequence[str | None], *, idle_w: float | None = None,
              min_window_s: float = WindowRule.min_s, min_window_fill: float = WindowRule.min_fill) -> Accounting:
    """Account several runs of one configuration (e.g. its batches) as one.

    Args:
        records: ledger records holding every run in ``run_ids`` (others are ignored).
        run_ids: the runs to pool, in order (``tpot_per_row_s`` follows it).
        idle_w: idle power in W; default: the runs' common header ``idle_w``.
        min_window_s: shortest valid steady-state window (the runs' windows pooled), s.
        min_window_fill: least valid mean active rows of the pooled window, as a fraction of the batch.

    Returns:
        The pooled :class:`Accounting` (labels: those every run shares).

    Raises:
        AccountingError: no run ids, a run without phase records, a repeated (step, phase)
            in a run, or runs that disagree on idle power when ``idle_w`` is not given.
    """
    if not run_ids:
        raise AccountingError("no run ids to pool")
    records = list(records)
    runs = [_run(records, r) for r in dict.fromkeys(run_ids)]
    return _accounting(runs, _idle_w(runs) if idle_w is None else idle_w, WindowRule(min_window_s, min_window_fill))


__all__ = ["Accounting", "account", "pool_runs", "acceptance_length", "tau_of_steps",
           "energy_saving", "speedup", "LINE_ITEMS", "CLOSURE_RTOL"]
