"""How the report names a record and which of its figures it shows (tables, Markdown and plots alike).

A record's J/token is the steady-state window's (``window.j_per_token``) beside the whole
run's (``run.j_per_token``); a record from before serving windows (version 2, ``window`` None)
has only the run's, and a lockstep (``--schedule static``) record's window pools the all-busy
stretches of its batches, no steady state, so the report shows its run's J/token
(:func:`shown_j`). Every reader goes through these functions, so an old or static record is
never shown as if it had a window.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

from refspec.eval.baseline import compared_j_per_token
from refspec.eval.record import RunRecord

PHASE_ORDER = ("prefill", "draft", "verify", "commit", "other")


def fmt(x: Any, spec: str, scale: float = 1.0) -> str:
    """``x * scale`` formatted by ``spec``; ``n/a`` for None and NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(float(x) * scale, spec)


# ---- names and order ----------------------------------------------------------------------------
def config_label(r: RunRecord) -> str:
    """``none b8`` / ``ngram k4 b8`` (``tree``, a policy and ``INJECTED`` marked)."""
    if r.is_baseline:
        return f"none b{r.batch}"
    tree = " tree" if r.tree else ""
    inj = " INJECTED" if r.acceptance_injected else ""
    pol = "" if r.spec_policy == "fixed" else f" {r.spec_policy}"
    return f"{r.drafter}{tree} k{r.k}{pol} b{r.batch}{inj}"


def series_label(r: RunRecord) -> str:
    """Drafter and K (and a static schedule), the series a plot draws across batches."""
    static = ", static" if r.is_static else ""  # lockstep batches are a series of their own
    if r.is_baseline:
        return f"none (baseline{static})"
    pol = "" if r.spec_policy == "fixed" else f" {r.spec_policy}"
    return f"{r.drafter}{' tree' if r.tree else ''} k={r.k}{pol}{static}"


def sort_key(r: RunRecord) -> tuple:
    """Records in report order: corpus, batch, baseline first, drafter, K."""
    return (r.corpus, r.batch, not r.is_baseline, r.drafter, r.k)


def corpora(records: Iterable[RunRecord]) -> list[str]:
    """The records' corpora, sorted."""
    return sorted({r.corpus for r in records})


def energy_sources(records: Iterable[RunRecord]) -> list[str]:
    """Distinct energy sources in words."""
    return sorted({str(r.energy.energy_source_text or r.energy.energy_source) for r in records})


def injection_lines(records: Iterable[RunRecord]) -> list[str]:
    """The injection label of every injected record (deduplicated)."""
    out: list[str] = []
    for r in records:
        if r.acceptance_injected:
            label = (r.injection or {}).get("label") or "ACCEPTANCE INJECTED"
            if label not in out:
                out.append(label)
    return out


# ---- which J/token -------------------------------------------------------------------------------
def has_window(r: RunRecord) -> bool:
    """Whether ``r`` carries the serving fields (window J/token beside the run's)."""
    return r.window is not None


def is_static(r: RunRecord) -> bool:
    """A lockstep serving record, whose window figures are not shown."""
    return has_window(r) and r.is_static


def j_window(r: RunRecord) -> float | None:
    """Steady-state window J/token; None for a record without window fields."""
    return None if r.window is None else r.window.j_per_token


def j_run(r: RunRecord) -> float | None:
    """Whole-run J/token (an old record's only J/token)."""
    return r.run.j_per_token


def shown_j(r: RunRecord) -> float | None:
    """The J/token the report shows and ranks by: the window's, a static (lockstep) row's run's."""
    return j_run(r) if is_static(r) else compared_j_per_token(r)


def with_energy(records: Iterable[RunRecord]) -> list[RunRecord]:
    """The records that have both a compared J/token and a p99 TPOT."""
    return [r for r in records if compared_j_per_token(r) is not None and r.latency.tpot_p99_s is not None]


def setting(rows: Sequence[RunRecord], value: Callable[[RunRecord], Any]) -> str:
    """The value (a function of a record) every row shares; MIXED a/b/... when a merged directory's rows differ."""
    values = list(dict.fromkeys(str(value(r)) for r in rows))
    return values[0] if len(values) == 1 else "MIXED " + "/".join(values)


# ---- cells of the table and the Markdown -----------------------------------------------------------
def phases_text(r: RunRecord) -> str:
    """Energy shares ``prefill/draft/verify/commit`` in %."""
    share = r.energy.phase_share
    return "n/a" if not share else "/".join(f"{100 * share.get(p, 0.0):.0f}" for p in PHASE_ORDER[:4])


def ttft_text(r: RunRecord) -> str:
    """``p50/p99`` TTFT in ms."""
    return f"{fmt(r.latency.ttft_p50_s, '.0f', 1e3)}/{fmt(r.latency.ttft_p99_s, '.0f', 1e3)}"


def refills_text(r: RunRecord) -> str:
    """``median/max`` rows of the refill prefills, or n/a."""
    w = r.work
    if w.refills is None:
        return "n/a"
    return "none" if not w.refills else f"{w.refill_group_p50:g}/{w.refill_group_max}"


def vs_baseline_text(r: RunRecord) -> str:
    """The saving and speed-up against the baseline, in a few words."""
    if r.is_baseline:
        return "(baseline)"
    saving, speed = r.comparison.energy_saving_vs_baseline, r.comparison.speedup_vs_baseline
    if saving is None and speed is None:
        return "no baseline"
    parts = []
    if saving is not None:
        parts.append(f"{-100 * saving:+.1f}% J/tok ({'saving' if saving >= 0 else 'loss'})")
    if speed is not None:
        parts.append(f"{speed:.2f}x tok/s")
    return ", ".join(parts) + (" UNRELIABLE" if r.comparison.verdict_reliable is False else "")


def energy_source_words(r: RunRecord) -> str:
    """``measured by rapl`` (the counter's name) or ``modelled``: what a verdict's energy rests on."""
    source = r.energy.energy_source or ""
    if r.energy.energy_measured and source.startswith("measured:"):
        return "measured by " + source.split(":", 1)[1]
    if r.energy.energy_measured:
        return f"measured ({source})"
    return "simulated" if source.startswith("modelled:simulated") else "modelled"


def verdict(r: RunRecord) -> str | None:
    """One sentence: whether speculation saved energy per token in ``r`` against its baseline (None for a baseline)."""
    if r.is_baseline:
        return None
    where = f"on {r.corpus} at batch {r.batch}, {config_label(r).replace(f' b{r.batch}', '')}"
    saving, speed = r.comparison.energy_saving_vs_baseline, r.comparison.speedup_vs_baseline
    if saving is None:
        return f"{where}: no verdict (no baseline figure to compare with)."
    how = (f"saves {100 * saving:.1f}% energy per token against" if saving >= 0
           else f"costs {-100 * saving:.1f}% more energy per token than")
    pace = "" if speed is None else f", at {speed:.2f}x the tokens/s"
    which = "J/token, static schedule" if r.is_static else "steady-state window J/token"
    text = f"{where} {how} plain decoding ({which}, energy {energy_source_words(r)}{pace})."
    if r.comparison.verdict_reliable is False:
        text += f" UNRELIABLE: {r.comparison.verdict_unreliable_reason}."
    return text


def requests_text(records: Sequence[RunRecord]) -> str:
    """``requests served: 4 at batch 1, 32 at batch 8`` (``rows decoded`` when a record has no window)."""
    by_batch = {r.batch: r.stream.requests for r in records}
    what = "requests served" if all(has_window(r) for r in records) else "rows decoded"
    return f"{what}: " + ", ".join(f"{n} at batch {b}" for b, n in sorted(by_batch.items()))


def budgets_text(rows: Sequence[RunRecord]) -> str:
    """``budgets up to 64 new tokens (reference: 1..64, median 29)``; MIXED when the rows differ."""
    def one(r: RunRecord) -> str:
        n = r.stream.output_lengths
        spread = "" if not n else f" ({n['dist']}: {n['min']}..{n['max']}, median {n['p50']})"
        return f"budgets up to {r.stream.max_new_tokens} new tokens{spread}"

    texts = list(dict.fromkeys(one(r) for r in rows))
    return texts[0] if len(texts) == 1 else "MIXED " + " / ".join(texts)


def sampling_text(rows: Sequence[RunRecord]) -> str:
    """``greedy`` or ``temperature T``; MIXED when the rows differ."""
    return setting(rows, lambda r: "greedy" if r.greedy else f"temperature {r.temperature}")


__all__ = ["PHASE_ORDER", "fmt", "config_label", "series_label", "sort_key", "corpora", "energy_sources",
           "injection_lines", "has_window", "is_static", "j_window", "j_run", "shown_j", "with_energy", "setting",
           "phases_text", "ttft_text", "refills_text", "vs_baseline_text", "energy_source_words", "verdict", "requests_text", "budgets_text",
           "sampling_text"]
